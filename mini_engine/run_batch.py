"""`python -m mini_engine.run_batch -i requests.jsonl -o results.jsonl --model PATH [engine options]`:
vLLM's batch runner (`vllm run-batch`): a file of OpenAI Batch API requests in, their responses out.

Each input line is one request, `{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions",
"body": {...}}`, and each output line its result, in the input's order: `{"id": ..., "custom_id": ...,
"response": {"status_code": ..., "request_id": ..., "body": {...}}, "error": null}`. The requests
go to the server's own app (server/app.py), in this process, through an ASGI transport: a batch
line is rendered, checked, sampled and parsed exactly as the same request sent to `serve` would be,
and up to 2 x max_num_seqs of them are in flight at once, so that the engine batches them
continuously. A line that cannot run (not JSON, no custom_id, a custom_id seen before, another
method or URL, `stream`) or that the server refuses gets its error on its own output line, in
OpenAI's error shape, with the status the server would answer; the other lines run.

The input may be an http(s) URL (read with GET), and so may the output (sent with PUT once the
batch is done, from a temporary file in --output-tmp-dir, or from memory); a local output is
written beside its final path and renamed onto it at the end, so that a run that fails leaves no
half-written results file.
"""
import argparse
import asyncio
import contextlib
import json
import logging
import os
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from mini_engine.serve import add_model_options, build_served_app, check_model_options
from mini_engine.server.protocol import error_body, random_id

# The routes a batch line may name, as the server serves them (vLLM's runner takes chat
# completions, embeddings, score and rerank; completions, classify and pooling run here too).
BATCH_URLS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/score", "/v1/score",
                        "/rerank", "/v1/rerank", "/v2/rerank", "/classify", "/v1/classify", "/pooling"})
log = logging.getLogger("mini_engine.run_batch")


@dataclass(frozen=True)
class BatchRequest:
    """One input line: a request to run, or why it cannot run (error)."""
    index: int                  # its place among the input's requests (non-empty lines)
    line_number: int            # in the input, from 1
    custom_id: str | None
    url: str | None = None
    body: dict | None = None
    error: str | None = None


def parse_line(index: int, line_number: int, text: str, seen_ids: set[str]) -> BatchRequest:
    """A line as a BatchRequest; a malformed one keeps what could be read of its custom_id."""
    def refused(custom_id: str | None, why: str) -> BatchRequest:
        return BatchRequest(index, line_number, custom_id, error=f"line {line_number}: {why}")

    try:
        line = json.loads(text)
    except json.JSONDecodeError as e:
        return refused(None, f"not JSON ({e})")
    if not isinstance(line, dict):
        return refused(None, "not a JSON object")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str):
        return refused(None, "no custom_id string")
    if custom_id in seen_ids:
        return refused(custom_id, f"custom_id {custom_id!r} is an earlier line's; each request's is its own")
    seen_ids.add(custom_id)
    method, url, body = line.get("method"), line.get("url"), line.get("body")
    if method != "POST":
        return refused(custom_id, f"method {method!r}: a batch request is a POST")
    if url not in BATCH_URLS:
        return refused(custom_id, f"url {url!r} is not one a batch runs; these are: {', '.join(sorted(BATCH_URLS))}")
    if not isinstance(body, dict):
        return refused(custom_id, "body is not a JSON object")
    if body.get("stream"):
        return refused(custom_id, "a batch request is not streamed: stream must be false")
    return BatchRequest(index, line_number, custom_id, url, body)


def result_line(custom_id: str | None, status_code: int, body: dict | None = None,
                error: dict | None = None) -> dict:
    """An output line, as vLLM's BatchRequestOutput: the body on success, else the error (OpenAI's
    error object) and no body."""
    return {"id": random_id("vllm"), "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": random_id("vllm-batch"), "body": body},
            "error": error}


async def run_request(client: httpx.AsyncClient, request: BatchRequest) -> dict:
    if request.error is not None:
        return result_line(request.custom_id, 400, error=error_body(request.error, 400))
    try:
        response = await client.post(request.url, json=request.body)
        answer = response.json()
    except Exception as e:      # the app failed: this line's error, not the batch's
        log.exception("batch request %r failed", request.custom_id)
        return result_line(request.custom_id, 500, error=error_body(f"the server failed: {e!r}", 500))
    if response.status_code == 200:
        return result_line(request.custom_id, 200, body=answer)
    return result_line(request.custom_id, response.status_code, error=answer)


class OrderedWriter:
    """Writes results in the input's order as they finish: a result waits only for those before
    it, so memory holds at most the lines finished out of order."""

    def __init__(self, file):
        self.file = file
        self.waiting: dict[int, dict] = {}
        self.next_index = 0

    def add(self, index: int, result: dict) -> None:
        self.waiting[index] = result
        while self.next_index in self.waiting:
            self.file.write(json.dumps(self.waiting.pop(self.next_index), ensure_ascii=False) + "\n")
            self.next_index += 1


@dataclass
class BatchSummary:
    requests: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    statuses: dict[int, int] = field(default_factory=dict)

    def count(self, result: dict) -> None:
        self.requests += 1
        status = result["response"]["status_code"]
        self.statuses[status] = self.statuses.get(status, 0) + 1
        self.failed += status != 200
        usage = (result["response"]["body"] or {}).get("usage") or {}
        self.prompt_tokens += usage.get("prompt_tokens") or 0
        self.completion_tokens += usage.get("completion_tokens") or 0

    def __str__(self) -> str:
        rate = self.completion_tokens / self.wall_s if self.wall_s else 0.0
        return (f"{self.requests} requests ({self.failed} failed) in {self.wall_s:.2f} s: {self.prompt_tokens} prompt "
                f"and {self.completion_tokens} completion tokens, {rate:,.0f} completion tok/s")


async def input_lines(path_or_url: str) -> AsyncIterator[tuple[int, str]]:
    """The input's non-empty lines and their numbers (from 1), streamed from a file or an http(s) GET."""
    if path_or_url.startswith(("http://", "https://")):
        async with httpx.AsyncClient(timeout=None) as client, client.stream("GET", path_or_url) as response:
            response.raise_for_status()
            number = 0
            async for line in response.aiter_lines():
                number += 1
                if line.strip():
                    yield number, line
        return
    with open(path_or_url, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                yield number, line


async def run_batch(app, input_path: str, output_file, max_in_flight: int) -> BatchSummary:
    """Runs input_path's requests through app (its engine process shut down here, however the
    batch ends) and writes their results to output_file, at most max_in_flight requests in flight."""
    summary, writer = BatchSummary(), OrderedWriter(output_file)
    room = asyncio.Semaphore(max_in_flight)
    progress = tqdm(unit="req", desc="Running batch", mininterval=5)

    async def run_one(request: BatchRequest) -> None:
        try:
            result = await run_request(client, request)
        finally:
            room.release()
        summary.count(result)
        writer.add(request.index, result)
        progress.update()

    start = time.perf_counter()
    engine = app.state.server.async_engine
    engine.start()      # what the app's lifespan does under uvicorn
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://mini-engine",
                                     timeout=None) as client:
            tasks, seen_ids = set(), set()
            index = 0
            async for line_number, text in input_lines(input_path):
                await room.acquire()       # reading waits while max_in_flight requests run
                task = asyncio.create_task(run_one(parse_line(index, line_number, text, seen_ids)))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                index += 1
            progress.total = index
            progress.refresh()
            await asyncio.gather(*tasks)
        summary.wall_s = time.perf_counter() - start
    finally:
        engine.shutdown()
        progress.close()
    return summary


@contextlib.contextmanager
def results_file(path_or_url: str, tmp_dir: str | None):
    """A file to write the results into, which becomes path_or_url when the batch ends well: a
    local file renamed onto it, or an upload with PUT."""
    uploading = path_or_url.startswith(("http://", "https://"))
    directory = tmp_dir if uploading else os.path.dirname(os.path.abspath(path_or_url))
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=directory, prefix=".batch_output_", suffix=".jsonl",
                                     delete=False) as f:
        temp_path = f.name
    try:
        with open(temp_path, "w", encoding="utf-8") as f:
            yield f
        if uploading:
            with open(temp_path, "rb") as f:
                httpx.put(path_or_url, content=f.read(), timeout=None).raise_for_status()
        else:
            os.replace(temp_path, path_or_url)
    finally:
        if os.path.exists(temp_path):
            os.unlink(temp_path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m mini_engine.run_batch", description=__doc__.split("\n\n")[0])
    parser.add_argument("-i", "--input-file", required=True,
                        help="the requests, one JSON object a line: a file, or an http(s) URL to GET")
    parser.add_argument("-o", "--output-file", required=True,
                        help="the results, one JSON object a line: a file, or an http(s) URL to PUT")
    parser.add_argument("--output-tmp-dir", default=None,
                        help="where the results wait before they are uploaded to an http(s) --output-file "
                        "(default: the system's temporary directory)")
    parser.add_argument("--max-in-flight", type=int, default=None,
                        help="requests running at once (default: 2 x max_num_seqs, as vLLM's)")
    add_model_options(parser)
    args = parser.parse_args(argv)
    check_model_options(parser, args)
    if args.max_in_flight is not None and args.max_in_flight < 1:
        parser.error("--max-in-flight must be at least 1")
    if not args.input_file.startswith(("http://", "https://")) and not os.path.isfile(args.input_file):
        parser.error(f"--input-file {args.input_file}: no such file")
    if not args.output_file.startswith(("http://", "https://")) and \
            not os.path.isdir(os.path.dirname(os.path.abspath(args.output_file))):
        parser.error(f"--output-file {args.output_file}: its folder does not exist")
    return args


def main(argv: list[str] | None = None) -> BatchSummary:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)       # else a line a request
    with results_file(args.output_file, args.output_tmp_dir) as output:
        app, _ = build_served_app(args)
        max_in_flight = args.max_in_flight or 2 * app.state.server.config.max_num_seqs
        summary = asyncio.run(run_batch(app, args.input_file, output, max_in_flight))
    print(f"{summary}; results in {args.output_file}")
    return summary


if __name__ == "__main__":
    main()
