"""`python -m mini_engine.run_batch` (vLLM's `vllm run-batch`): a batch line gets what the server
answers the same request, in the input's order; a line that cannot run gets its own error line
and the others run; input and output over HTTP; a batch that fails leaves no results file."""
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

import mini_engine.run_batch as run_batch_module
from mini_engine.run_batch import BATCH_URLS, parse_line, results_file, split_lines
from tests.engine.test_embeddings import hf_embedding, write_embedding_checkpoint
from tests.server.conftest import MODEL_NAME, NUM_KV_BLOCKS, REPO, engine_processes

# As launched_server starts the session's server, so that the two engines are alike.
ENGINE_OPTIONS = ("--served-model-name", MODEL_NAME, "--num-kv-blocks", str(NUM_KV_BLOCKS), "--block-size", "16",
                  "--max-num-seqs", "128", "--log-level", "warning")


def run_batch(model: str, input_file: str, output_file: str, *options: str, check: bool = True):
    return subprocess.run([sys.executable, "-m", "mini_engine.run_batch", "-i", input_file, "-o", output_file,
                           "--model", model, *ENGINE_OPTIONS, *options],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=check)


def write_lines(path, lines: list) -> str:
    """Each line a JSON value, or its text, or its raw bytes."""
    with open(path, "wb") as f:
        for line in lines:
            f.write(line if isinstance(line, bytes) else (line if isinstance(line, str) else json.dumps(line)).encode())
            f.write(b"\n")
    return str(path)


def request(custom_id: str, url: str, body: dict, method: str = "POST") -> dict:
    return {"custom_id": custom_id, "method": method, "url": url, "body": body}


def assert_same_answer(got, expected, where: str = "body") -> None:
    """Equal, but for the ids and creation times of two runs of one request, and for log-probabilities,
    which a batch of other rows moves in their last digits (the tokens are the same)."""
    assert type(got) is type(expected), where
    if isinstance(got, dict):
        assert got.keys() == expected.keys(), where
        for key in got.keys() - {"id", "created", "created_at", "completed_at"}:
            assert_same_answer(got[key], expected[key], f"{where}.{key}")
    elif isinstance(got, list):
        assert len(got) == len(expected), where
        for i, (a, b) in enumerate(zip(got, expected)):
            assert_same_answer(a, b, f"{where}[{i}]")
    elif isinstance(got, float):
        assert got == pytest.approx(expected, rel=1e-4, abs=1e-5), where
    else:
        assert got == expected, where


GREEDY = {"temperature": 0, "max_tokens": 8}
RUNNABLE = [
    request("chat", "/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}],
                                             **GREEDY}),
    request("text", "/v1/completions", {"prompt": "The quick brown", "logprobs": 2, **GREEDY}),
    request("two prompts", "/v1/completions", {"prompt": ["Größe", "café, naïve\u2028x"], "echo": True, **GREEDY}),
    request("long", "/v1/completions", {"prompt": "def add(a, b):", "max_tokens": 40, "temperature": 0,
                                        "ignore_eos": True}),
    request("odd \ud800 id", "/v1/completions", {"prompt": [5, 6], "stream": "false", **GREEDY}),
    request("seeded n=2", "/v1/completions", {"prompt": "The quick", "n": 2, "seed": 3, "temperature": 1.0,
                                              "max_tokens": 8}),
    request("response", "/v1/responses", {"input": "Hello", "max_output_tokens": 8, "temperature": 0,
                                          "store": False}),
    request("bad temperature", "/v1/completions", {"prompt": "x", "temperature": -1}),
    request("nan temperature", "/v1/completions", {"prompt": "x", "temperature": float("nan")}),
    request("unknown model", "/v1/completions", {"model": "gpt-4", "prompt": "x"}),
    request("unknown field", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "colour": 1}),
]
NUM_ANSWERED = 7        # the first seven run; the others the server refuses
REFUSED = [      # each with what its error says
    ("not json", "not JSON"),
    ([1, 2], "not a JSON object"),
    (b'{"custom_id": "latin-1", "body": "caf\xe9"}', "not UTF-8"),
    (request("text", "/v1/completions", {"prompt": "x"}), "custom_id 'text' is an earlier line's"),
    ({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}, "no custom_id string"),
    (request("get", "/v1/completions", {"prompt": "x"}, method="GET"), "method 'GET': a batch request is a POST"),
    (request("models", "/v1/models", {}), "url '/v1/models' is not one a batch runs"),
    (request("stream", "/v1/completions", {"prompt": "x", "stream": True}), "a batch request is not streamed"),
    (request("no body", "/v1/completions", "prompt"), "body is not a JSON object"),
]


def test_a_batch_answers_as_the_server_does_in_the_inputs_order(tiny_model, served, tmp_path):
    """Two requests in flight at most, so that reading waits for room; blank lines skipped; the
    file starts with a UTF-8 BOM."""
    lines = ["\ufeff" + json.dumps(RUNNABLE[0]), ""] + RUNNABLE[1:] + [refused for refused, _ in REFUSED]
    input_file = write_lines(tmp_path / "requests.jsonl", lines)
    output_file = str(tmp_path / "results.jsonl")
    ran = run_batch(tiny_model, input_file, output_file, "--max-in-flight", "2")
    results = [json.loads(line) for line in open(output_file)]
    assert [r["custom_id"] for r in results] == [r["custom_id"] for r in RUNNABLE] + \
        [None, None, None, "text", None, "get", "models", "stream", "no body"]
    assert len({r["id"] for r in results}) == len({r["response"]["request_id"] for r in results}) == len(results)
    for line, result in zip(RUNNABLE, results):
        answer = httpx.post(served.base_url + line["url"], content=json.dumps(line["body"]), timeout=60,
                            headers={"content-type": "application/json"})
        status = result["response"]["status_code"]
        assert status == answer.status_code, (line["custom_id"], result)
        if status == 200:
            assert result["error"] is None
            assert_same_answer(result["response"]["body"], answer.json())
        else:
            assert result["response"]["body"] is None and result["error"] == answer.json()
    assert [r["response"]["status_code"] for r in results[:len(RUNNABLE)]] == [200] * NUM_ANSWERED + [400, 400, 404, 400]
    assert results[3]["response"]["body"]["usage"]["completion_tokens"] == 40
    first_refused_line = len(RUNNABLE) + 2      # after the blank line
    for i, ((_, why), result) in enumerate(zip(REFUSED, results[len(RUNNABLE):])):
        assert result["response"] == {"status_code": 400, "request_id": result["response"]["request_id"],
                                      "body": None}
        assert result["error"]["error"]["message"].startswith(f"line {first_refused_line + i}: {why}"), result
    usages = [r["response"]["body"]["usage"] for r in results[:NUM_ANSWERED]]
    completion_tokens = sum(u.get("completion_tokens", u.get("output_tokens")) for u in usages)
    assert f"{len(lines) - 1} requests ({len(lines) - 1 - NUM_ANSWERED} failed)" in ran.stdout
    assert f"and {completion_tokens} completion tokens" in ran.stdout


def test_a_pooling_models_batch_embeds_as_transformers_does(tiny_model, tmp_path):
    model = write_embedding_checkpoint(tiny_model, str(tmp_path / "embedding-model"))
    tokens = [5, 6, 7, 8, 9]
    lines = [request("embed", "/v1/embeddings", {"input": tokens, "encoding_format": "float"}),
             request("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})]
    output_file = str(tmp_path / "results.jsonl")
    # On the CPU on any machine: transformers' reference is computed there.
    run_batch(model, write_lines(tmp_path / "requests.jsonl", lines), output_file, "--runner", "pooling",
              "--device", "cpu")
    embedded, chat = (json.loads(line) for line in open(output_file))
    assert embedded["response"]["status_code"] == 200 and embedded["error"] is None
    torch.testing.assert_close(torch.tensor(embedded["response"]["body"]["data"][0]["embedding"]),
                               hf_embedding(tiny_model, tokens), atol=2e-5, rtol=1e-4)
    assert chat["response"]["status_code"] == 400 and chat["error"]["error"]["message"]


class FileServer(http.server.BaseHTTPRequestHandler):
    """GET answers the files in `served`; PUT keeps the body in `uploads`."""
    served: dict[str, bytes] = {}
    uploads: dict[str, bytes] = {}

    def do_GET(self):
        body = self.served.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.end_headers()
        self.wfile.write(body or b"")

    def do_PUT(self):
        self.uploads[self.path] = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def file_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FileServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    FileServer.served, FileServer.uploads = {}, {}
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_input_read_and_results_sent_over_http(tiny_model, file_server, tmp_path):
    lines = [request(f"r{i}", "/v1/completions", {"prompt": [3 + i, 4, 5], **GREEDY}) for i in range(3)]
    FileServer.served["/in.jsonl"] = "\n".join(json.dumps(line) for line in lines).encode()
    waiting_room = tmp_path / "upload-tmp"
    waiting_room.mkdir()
    run_batch(tiny_model, file_server + "/in.jsonl", file_server + "/out.jsonl", "--output-tmp-dir", str(waiting_room))
    results = [json.loads(line) for line in FileServer.uploads["/out.jsonl"].decode().splitlines()]
    assert [r["custom_id"] for r in results] == ["r0", "r1", "r2"]
    assert all(r["response"]["status_code"] == 200 and r["response"]["body"]["usage"]["completion_tokens"] == 8
               for r in results)
    assert os.listdir(waiting_room) == []       # the temporary file went with the upload


def test_a_batch_whose_input_cannot_be_read_leaves_no_results_file(tiny_model, file_server, tmp_path):
    """The engine process is stopped too: the command returns rather than waiting on it."""
    output_file = tmp_path / "results.jsonl"
    ran = run_batch(tiny_model, file_server + "/missing.jsonl", str(output_file), check=False)
    assert ran.returncode != 0 and "404" in ran.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the engine process through /proc")
def test_sigterm_stops_the_engine_and_leaves_no_results(tiny_model, tmp_path):
    """A job scheduler's stop mid-batch: the command ends, its engine process with it, and neither
    a results file nor its temporary file is left."""
    lines = [request(f"r{i}", "/v1/completions", {"prompt": [5, 6, i], "max_tokens": 400, "ignore_eos": True})
             for i in range(64)]
    input_file = write_lines(tmp_path / "requests.jsonl", lines)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    process = subprocess.Popen([sys.executable, "-m", "mini_engine.run_batch", "-i", input_file, "-o",
                                str(out_dir / "results.jsonl"), "--model", tiny_model, *ENGINE_OPTIONS,
                                "--max-in-flight", "4"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        for _ in range(600):
            engines = engine_processes(process.pid)
            if engines and os.listdir(out_dir):      # the engine is up and the results file begun
                break
            time.sleep(0.1)
        assert engines, "the engine process did not start"
        time.sleep(1.0)         # requests running
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130 and "stopped: no results written" in err, err
    assert os.listdir(out_dir) == []
    assert not any(os.path.exists(f"/proc/{pid}") for pid in engines), "the engine process outlived the batch"


@pytest.mark.parametrize("argv,message", [
    (["-i", "/no/such/file.jsonl", "-o", "out.jsonl"], "no such file"),
    (["-i", __file__, "-o", "/no/such/folder/out.jsonl"], "its folder does not exist"),
    (["-i", __file__, "-o", "out.jsonl", "--max-in-flight", "0"], "--max-in-flight must be at least 1"),
    (["-i", __file__, "-o", "out.jsonl", "--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
    (["-i", __file__, "-o", os.path.dirname(__file__)], "is a folder"),
    (["-i", os.path.dirname(__file__), "-o", "out.jsonl"], "no such file"),
    (["-i", __file__, "-o", "http://x/out", "--output-tmp-dir", "/no/such/dir"], "--output-tmp-dir /no/such/dir: no such"),
])
def test_bad_command_lines_stop_before_the_model_loads(argv, message, capsys):
    from mini_engine import run_batch as module
    with pytest.raises(SystemExit):
        module.parse_args(argv)
    assert message in capsys.readouterr().err


def test_each_url_a_batch_runs_is_a_post_route_of_the_server():
    """A typo in BATCH_URLS would send its lines to a 404 (a built app would start an engine, so
    the routes are read from the app's source)."""
    import inspect
    import re

    from mini_engine.server.app import build_app
    posted = set(re.findall(r'@app\.post\("([^"]+)"\)', inspect.getsource(build_app)))
    assert BATCH_URLS <= posted and "/v1/completions" in BATCH_URLS, BATCH_URLS - posted


def line_bytes(value) -> bytes:
    return json.dumps(value).encode()


def test_parse_line_keeps_the_custom_id_of_a_line_it_refuses():
    seen = {"a"}
    assert parse_line(0, 1, line_bytes(request("a", "/v1/completions", {})), seen).error.startswith("line 1: custom_id")
    refused = parse_line(1, 7, line_bytes(request("b", "/v1/models", {})), seen)
    assert (refused.custom_id, refused.line_number, refused.url) == ("b", 7, None)
    ok = parse_line(2, 8, line_bytes(request("c", "/v1/completions", {"prompt": "x"})), seen)
    assert ok.error is None and (ok.url, ok.body) == ("/v1/completions", {"prompt": "x"}) and seen == {"a", "b", "c"}


@pytest.mark.parametrize("raw,why", [
    (b'{"custom_id": "x\xff"}', "not UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, "not JSON"),         # deeper than the parser recurses
    (b'{"custom_id": "big", "n": ' + b"9" * 5000 + b"}", "not JSON"),     # past int's digit limit
    (b"NaN", "not a JSON object"),
])
def test_a_line_no_json_reader_takes_is_its_own_error(raw, why):
    refused = parse_line(0, 3, raw, set())
    assert refused.error.startswith(f"line 3: {why}") and refused.url is None


@pytest.mark.parametrize("stream,refused", [(True, True), ("true", True), (1, True), (False, False),
                                            ("false", False), (0, False), (None, False), ("maybe", False)])
def test_stream_is_read_as_the_server_reads_it(stream, refused):
    """A value the server would refuse ("maybe") is left to the server's own 400."""
    got = parse_line(0, 1, line_bytes(request("s", "/v1/completions", {"prompt": "x", "stream": stream})), set())
    assert (got.error is not None) == refused


def test_lines_split_at_newlines_alone():
    """U+2028, U+0085 and \r may sit inside a JSON string; a line may arrive in pieces."""
    tail = bytearray()
    text = '{"a": "x\u2028y\u0085z\r"}\n{"b": 1}\n{"c"'.encode()
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    assert list(split_lines(pieces, tail)) == ['{"a": "x\u2028y\u0085z\r"}'.encode(), b'{"b": 1}']
    assert bytes(tail) == b'{"c"'


def test_an_upload_that_fails_every_try_keeps_the_results(tmp_path, monkeypatch, caplog):
    def refuse(request):
        return httpx.Response(503)

    tries = []
    real_client = httpx.AsyncClient
    monkeypatch.setattr(run_batch_module, "UPLOAD_RETRY_S", 0.0)
    monkeypatch.setattr(run_batch_module.httpx, "AsyncClient",
                        lambda **kwargs: real_client(transport=httpx.MockTransport(
                            lambda request: tries.append(request) or refuse(request))))
    with pytest.raises(httpx.HTTPStatusError):
        with results_file("http://example.invalid/out.jsonl", str(tmp_path)) as f:
            f.write("result\n")
    assert len(tries) == run_batch_module.UPLOAD_TRIES
    kept, = os.listdir(tmp_path)
    assert open(tmp_path / kept).read() == "result\n" and str(tmp_path / kept) in caplog.text


def test_a_local_results_file_is_made_with_the_umasks_mode(tmp_path):
    previous = os.umask(0o022)
    try:
        with results_file(str(tmp_path / "out.jsonl"), None) as f:
            f.write("x\n")
    finally:
        os.umask(previous)
    assert os.stat(tmp_path / "out.jsonl").st_mode & 0o777 == 0o644 and os.listdir(tmp_path) == ["out.jsonl"]
