"""`python -m mini_engine.run_batch -i requests.jsonl -o results.jsonl --model PATH [engine options]`:
vLLM's batch runner (`vllm run-batch`): a file of OpenAI Batch API requests in, their responses out.

Each input line is one request, `{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions",
"body": {...}}`, and each output line its result, in the input's order: `{"id": ..., "custom_id": ...,
"response": {"status_code": ..., "request_id": ..., "body": {...}}, "error": null}`. The requests
go to the server's own app (server/app.py), in this process, through an ASGI transport: a batch
line is rendered, checked, sampled and parsed exactly as the same request sent to `serve` would be,
and up to 2 x max_num_seqs of them are in flight at once, so that the engine batches them
continuously. A line that cannot run (not UTF-8 or not JSON, no custom_id, a custom_id seen before,
another method or URL, `stream`) or that the server refuses gets its error on its own output line,
in OpenAI's error shape, with the status the server would answer; the other lines run.

The input may be an http(s) URL (read with GET), and so may the output (sent with PUT once the
batch is done, from a temporary file in --output-tmp-dir, kept if every try fails); a local output
is written beside its final path and renamed onto it at the end, so that a batch that fails or is
stopped (SIGINT, SIGTERM) leaves no half-written results file. The command exits 1 if a line
failed in the server (a 5xx: the engine process gone, say), else 0.
"""
import argparse
import asyncio
import codecs
import contextlib
import json
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import httpx
from pydantic import TypeAdapter, ValidationError
from tqdm import tqdm

from mini_engine.serve import add_model_options, build_served_app, check_model_options, parse_command_line
from mini_engine.server.middleware import ENGINE_ROUTES
from mini_engine.server.protocol import error_body, random_id

# The routes a batch line may name: those that run requests on the engine (vLLM's runner takes chat
# completions, embeddings, score and rerank; OpenAI's Batch API completions and responses too), less
# SageMaker's /invocations, whose body names no route.
BATCH_URLS = ENGINE_ROUTES - {"/invocations"}
UPLOAD_TRIES, UPLOAD_RETRY_S = 5, 5.0       # as vLLM's
log = logging.getLogger("mini_engine.run_batch")


def is_url(path_or_url: str) -> bool:
    return path_or_url.startswith(("http://", "https://"))


@dataclass(frozen=True)
class BatchRequest:
    """One input line: a request to run, or why it cannot run (error)."""
    index: int                  # its place among the input's requests (non-empty lines)
    line_number: int            # in the input, from 1
    custom_id: str | None
    url: str | None = None
    body: dict | None = None
    error: str | None = None


AS_BOOL = TypeAdapter(bool)       # pydantic's reading of a bool field, as the server's requests read them


def streamed(value) -> bool:
    """Whether a body's `stream` asks for a stream, as the server's validation reads it ("true",
    1, "on", ... too); a value it would refuse is left to it to refuse."""
    try:
        return AS_BOOL.validate_python(value)
    except ValidationError:
        return False


def parse_line(index: int, line_number: int, raw: bytes, seen_ids: set[str]) -> BatchRequest:
    """A line as a BatchRequest; a malformed one keeps what could be read of its custom_id."""
    def refused(custom_id: str | None, why: str) -> BatchRequest:
        return BatchRequest(index, line_number, custom_id, error=f"line {line_number}: {why}")

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return refused(None, f"not UTF-8 ({e})")
    try:
        line = json.loads(text)
    except (ValueError, RecursionError) as e:       # a number too long, nesting too deep: not JSON we read
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
    if streamed(body.get("stream", False)):
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
    """The request's result line; never raises (an app that fails is the line's 500)."""
    if request.error is not None:
        return result_line(request.custom_id, 400, error=error_body(request.error, 400))
    try:
        # The body as JSON reads it (NaN and Infinity too): the server's checks then refuse what they should.
        response = await client.post(request.url, content=json.dumps(request.body),
                                     headers={"content-type": "application/json"})
        answer = response.json()
    except Exception as e:
        log.exception("batch request %r failed", request.custom_id)
        return result_line(request.custom_id, 500, error=error_body(f"the server failed: {e!r}", 500))
    if response.status_code == 200:
        return result_line(request.custom_id, 200, body=answer)
    return result_line(request.custom_id, response.status_code, error=answer)


class OrderedWriter:
    """Writes results in the input's order as they finish: a result waits only for those before
    it, so memory holds at most the lines finished out of order. ASCII JSON: no character in a
    result (a lone surrogate, U+2028) can fail the write or split the line for a reader."""

    def __init__(self, file):
        self.file = file
        self.waiting: dict[int, dict] = {}
        self.next_index = 0

    def add(self, index: int, result: dict) -> None:
        self.waiting[index] = result
        while self.next_index in self.waiting:
            self.file.write(json.dumps(self.waiting.pop(self.next_index)) + "\n")
            self.next_index += 1


@dataclass
class BatchSummary:
    requests: int = 0
    failed: int = 0
    server_failed: int = 0      # 5xx: the server, not the request
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    statuses: dict[int, int] = field(default_factory=dict)

    def count(self, result: dict) -> None:
        self.requests += 1
        status = result["response"]["status_code"]
        self.statuses[status] = self.statuses.get(status, 0) + 1
        self.failed += status != 200
        self.server_failed += status >= 500
        usage = (result["response"]["body"] or {}).get("usage") or {}
        # The Responses API names them input and output tokens.
        self.prompt_tokens += usage.get("prompt_tokens") or usage.get("input_tokens") or 0
        self.completion_tokens += usage.get("completion_tokens") or usage.get("output_tokens") or 0

    def __str__(self) -> str:
        rate = self.completion_tokens / self.wall_s if self.wall_s else 0.0
        return (f"{self.requests} requests ({self.failed} failed) in {self.wall_s:.2f} s: {self.prompt_tokens} prompt "
                f"and {self.completion_tokens} completion tokens, {rate:,.0f} completion tok/s")


def split_lines(chunks: Iterator[bytes] | list[bytes], tail: bytearray) -> Iterator[bytes]:
    """The whole lines in tail + chunks, split at b"\\n" alone (not at \\r, U+2028 or U+0085, which
    JSON strings may hold); what follows the last newline stays in tail."""
    for chunk in chunks:
        tail += chunk
        *whole, rest = tail.split(b"\n")
        yield from whole
        tail[:] = rest


async def input_lines(path_or_url: str) -> AsyncIterator[tuple[int, bytes]]:
    """The input's non-blank lines (bytes, a UTF-8 BOM dropped) and their numbers from 1, streamed
    from a file or an http(s) GET."""
    number, tail = 0, bytearray()

    def numbered(lines):
        nonlocal number
        for line in lines:
            number += 1
            if number == 1:
                line = line.removeprefix(codecs.BOM_UTF8)
            if line.strip():
                yield number, line

    if is_url(path_or_url):
        async with httpx.AsyncClient(timeout=None) as client, client.stream("GET", path_or_url) as response:
            response.raise_for_status()
            async for chunk in response.aiter_bytes():
                for item in numbered(split_lines([chunk], tail)):
                    yield item
    else:
        with open(path_or_url, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                for item in numbered(split_lines([chunk], tail)):
                    yield item
    for item in numbered([bytes(tail)]):
        yield item


def count_lines(path_or_url: str) -> int | None:
    """A local input's non-blank lines, for the progress bar's total (None over http)."""
    if is_url(path_or_url):
        return None
    with open(path_or_url, "rb") as f:
        return sum(1 for line in f if line.strip())


async def run_batch(app, input_path: str, output_file, max_in_flight: int) -> BatchSummary:
    """Runs input_path's requests through app (within its lifespan, which stops its engine
    process however the batch ends) and writes their results to output_file, at most
    max_in_flight requests in flight."""
    summary, writer = BatchSummary(), OrderedWriter(output_file)
    room = asyncio.Semaphore(max_in_flight)
    progress = tqdm(total=count_lines(input_path), unit="req", desc="Running batch", mininterval=5)
    tasks, failures = set(), []

    async def run_one(client: httpx.AsyncClient, request: BatchRequest) -> None:
        try:
            result = await run_request(client, request)
        finally:
            room.release()
        summary.count(result)
        writer.add(request.index, result)
        progress.update()

    def finished(task: asyncio.Task) -> None:
        tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            failures.append(task.exception())     # a result that could not be written: the batch fails

    start = time.perf_counter()
    try:
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://mini-engine", timeout=None) as client:
            seen_ids = set()
            index = 0
            async for line_number, raw in input_lines(input_path):
                await room.acquire()       # reading waits while max_in_flight requests run
                if failures:
                    break
                task = asyncio.create_task(run_one(client, parse_line(index, line_number, raw, seen_ids)))
                tasks.add(task)
                task.add_done_callback(finished)
                index += 1
            await asyncio.gather(*tasks, return_exceptions=True)
            if failures:
                raise failures[0]
            summary.wall_s = time.perf_counter() - start
            progress.close()
    finally:
        progress.close()
        for task in tasks:
            task.cancel()
    return summary


async def upload(path: str, url: str) -> None:
    """PUT path's content to url, tried UPLOAD_TRIES times (as vLLM's): large uploads time out."""
    with open(path, "rb") as f:
        content = f.read()
    for attempt in range(1, UPLOAD_TRIES + 1):
        try:
            async with httpx.AsyncClient(timeout=1000) as client:
                (await client.put(url, content=content)).raise_for_status()
            return
        except httpx.HTTPError as e:
            if attempt == UPLOAD_TRIES:
                raise
            log.warning("uploading the results to %s failed (try %d of %d: %s); again in %.0f s", url, attempt,
                        UPLOAD_TRIES, e, UPLOAD_RETRY_S)
            await asyncio.sleep(UPLOAD_RETRY_S)


@contextlib.contextmanager
def results_file(path_or_url: str, tmp_dir: str | None):
    """A file to write the results into, which becomes path_or_url when the batch ends well: a
    local file renamed onto it (made as open() makes files, so with the umask's mode), or an
    upload with PUT. A batch that fails leaves nothing; an upload that fails every try leaves the
    results in tmp_dir, and says where."""
    uploading = is_url(path_or_url)
    if uploading:
        directory, name = tmp_dir or os.environ.get("TMPDIR", "/tmp"), "batch_output"
    else:
        directory, name = os.path.split(os.path.abspath(path_or_url))
    temp_path = os.path.join(directory, f".{name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(temp_path, "x", encoding="utf-8") as f:
            yield f
        if not uploading:
            os.replace(temp_path, path_or_url)
            return
        try:
            asyncio.run(upload(temp_path, path_or_url))
        except BaseException:
            log.error("the results could not be uploaded to %s; they are in %s", path_or_url, temp_path)
            temp_path = None        # kept
            raise
    finally:
        if temp_path is not None and os.path.exists(temp_path):
            os.unlink(temp_path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m mini_engine.run_batch", description=__doc__.split("\n\n")[0])
    parser.add_argument("-i", "--input-file", required=True,
                        help="the requests, one JSON object a line: a file, or an http(s) URL to GET")
    parser.add_argument("-o", "--output-file", required=True,
                        help="the results, one JSON object a line: a file, or an http(s) URL to PUT")
    parser.add_argument("--output-tmp-dir", default=None,
                        help="where the results wait before they are uploaded to an http(s) --output-file "
                        "(default: $TMPDIR or /tmp); a local output waits beside itself")
    parser.add_argument("--max-in-flight", type=int, default=None,
                        help="requests running at once (default: 2 x max_num_seqs for each engine, as vLLM's)")
    add_model_options(parser)
    args = parse_command_line(parser, argv)
    check_model_options(parser, args)
    if args.max_in_flight is not None and args.max_in_flight < 1:
        parser.error("--max-in-flight must be at least 1")
    if not is_url(args.input_file) and (not os.path.exists(args.input_file) or os.path.isdir(args.input_file)):
        parser.error(f"--input-file {args.input_file}: no such file")
    if not is_url(args.output_file):
        if os.path.isdir(args.output_file):
            parser.error(f"--output-file {args.output_file} is a folder")
        if not os.path.isdir(os.path.dirname(os.path.abspath(args.output_file))):
            parser.error(f"--output-file {args.output_file}: its folder does not exist")
    if args.output_tmp_dir is not None and not os.path.isdir(args.output_tmp_dir):
        parser.error(f"--output-tmp-dir {args.output_tmp_dir}: no such folder")
    return args


def stop_on_sigterm(signum, frame):
    """SIGTERM (a job scheduler's stop) unwinds as Ctrl-C does: the engine process stopped, no
    half-written results left."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)       # else a line a request
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        with results_file(args.output_file, args.output_tmp_dir) as output:
            app, _ = build_served_app(args)
            max_in_flight = args.max_in_flight or 2 * app.state.server.config.max_num_seqs * args.data_parallel_size
            summary = asyncio.run(run_batch(app, args.input_file, output, max_in_flight))
    except KeyboardInterrupt:
        print("stopped: no results written", file=sys.stderr)
        return 130
    print(f"{summary}; results in {args.output_file}")
    if summary.server_failed:
        print(f"{summary.server_failed} requests failed in the server (status 5xx)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
