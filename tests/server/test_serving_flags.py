"""vLLM's serving flags that a deployment's command line carries: --enable-request-id-headers,
--enable-server-load-tracking (GET /load), --disable-fastapi-docs, --response-role, --root-path
and --disable-uvicorn-access-log, on one server started with all of them."""
import asyncio
import re

import httpx
import pytest

from mini_engine.server.middleware import ENGINE_ROUTES, ServerLoad, ServerLoadMiddleware
from tests.server.conftest import MODEL_NAME, launched_server

KEY = "flag-key"
FLAGS = ("--enable-request-id-headers", "--enable-server-load-tracking", "--disable-fastapi-docs", "--response-role",
         "bot", "--root-path", "/api", "--disable-uvicorn-access-log", "--api-key", KEY, "--log-level", "info")
AUTH = {"Authorization": f"Bearer {KEY}"}
COMPLETION = {"model": MODEL_NAME, "prompt": "Hello", "temperature": 0, "max_tokens": 4}


@pytest.fixture(scope="module")
def flagged(tiny_model, tmp_path_factory):
    with launched_server(tiny_model, tmp_path_factory.mktemp("flagged-server-log"), options=FLAGS) as handle:
        yield handle


def test_each_response_carries_the_requests_id_or_a_new_one(flagged):
    url = flagged.base_url
    given = httpx.post(url + "/v1/completions", json=COMPLETION, headers=AUTH | {"X-Request-Id": "mine-42"}, timeout=60)
    assert given.status_code == 200 and given.headers["x-request-id"] == "mine-42"
    new = [httpx.get(url + "/v1/models", headers=AUTH, timeout=10).headers["x-request-id"] for _ in range(2)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", rid) for rid in new) and new[0] != new[1]
    refused = httpx.get(url + "/v1/models", timeout=10)                 # no key: a 401, with its id
    assert refused.status_code == 401 and re.fullmatch(r"[0-9a-f]{32}", refused.headers["x-request-id"])
    preflight = httpx.options(url + "/v1/completions", timeout=10, headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 200 and re.fullmatch(r"[0-9a-f]{32}", preflight.headers["x-request-id"])
    cross_origin = httpx.get(url + "/v1/models", headers=AUTH | {"Origin": "https://app.example"}, timeout=10)
    assert "x-request-id" in cross_origin.headers["access-control-expose-headers"].lower()     # a browser may read it


def test_load_is_open_and_counts_nothing_once_requests_end(flagged):
    url = flagged.base_url
    assert httpx.get(url + "/load", timeout=10).json() == {"server_load": 0}      # no key needed, as /health
    for _ in range(3):
        assert httpx.post(url + "/v1/completions", json=COMPLETION, headers=AUTH, timeout=60).status_code == 200
    with httpx.stream("POST", url + "/v1/completions", json=COMPLETION | {"stream": True}, headers=AUTH,
                      timeout=60) as stream:
        assert [line for line in stream.iter_lines() if line][-1] == "data: [DONE]"
    assert httpx.get(url + "/load", timeout=10).json() == {"server_load": 0}


def test_docs_are_gone_and_probes_stay_open_under_the_root_path(flagged):
    url = flagged.base_url
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(url + path, headers=AUTH, timeout=10).status_code == 404, path
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(url + "/v1/models", headers=AUTH, timeout=10).status_code == 200


def test_a_chat_answer_takes_the_response_role(flagged):
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "max_tokens": 4}
    answer = httpx.post(flagged.base_url + "/v1/chat/completions", json=chat, headers=AUTH, timeout=60).json()
    assert answer["choices"][0]["message"]["role"] == "bot"
    # Continuing the final message keeps its role, as before.
    continued = chat | {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well"}],
                        "add_generation_prompt": False, "continue_final_message": True}
    answer = httpx.post(flagged.base_url + "/v1/chat/completions", json=continued, headers=AUTH, timeout=60).json()
    assert answer["choices"][0]["message"]["role"] == "assistant"


def test_no_access_log_lines(flagged):
    httpx.get(flagged.base_url + "/health", timeout=10)
    log = open(flagged.log_path).read()
    assert "Application startup complete" in log         # the log runs at info
    assert '"GET /health HTTP/1.1"' not in log


def test_the_load_middleware_counts_engine_routes_until_their_responses_end():
    load, started, release = ServerLoad(), asyncio.Event(), asyncio.Event()

    async def app(scope, receive, send):
        started.set()
        await release.wait()

    async def request(method: str, path: str, root_path: str = ""):
        await ServerLoadMiddleware(app, load)({"type": "http", "method": method, "path": root_path + path,
                                               "root_path": root_path}, None, None)

    async def scenario():
        for method, path, root, counted in (("POST", "/v1/chat/completions", "", 1), ("POST", "/v1/models", "", 0),
                                            ("GET", "/v1/completions", "", 0), ("POST", "/rerank", "/api", 1)):
            started.clear()
            release.clear()
            task = asyncio.create_task(request(method, path, root))
            await started.wait()
            assert load.in_progress == counted, path
            release.set()
            await task
            assert load.in_progress == 0
        async def failing_app(scope, receive, send):
            raise RuntimeError("the route failed")

        with pytest.raises(RuntimeError, match="the route failed"):
            await ServerLoadMiddleware(failing_app, load)({"type": "http", "method": "POST",
                                                           "path": "/v1/completions"}, None, None)
        assert load.in_progress == 0

    asyncio.run(scenario())


def test_each_engine_route_is_a_post_route_of_the_server():
    """ENGINE_ROUTES is kept by hand: a typo would leave a route uncounted by /load and out of batches
    (a built app would start an engine, so the routes are read from the sources)."""
    import inspect

    from mini_engine.server import app, sagemaker
    posted = set(re.findall(r'@app\.post\("([^"]+)"\)', inspect.getsource(app) + inspect.getsource(sagemaker)))
    assert ENGINE_ROUTES <= posted, ENGINE_ROUTES - posted
    assert {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings"} <= ENGINE_ROUTES


def test_a_completions_id_is_built_on_the_clients_request_id(served):
    """vLLM's: X-Request-Id (with or without --enable-request-id-headers), else the body's request_id;
    two requests that send the same id both run (the engine's own ids stay unique)."""
    url = served.base_url

    async def same_id_twice():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(client.post(url + "/v1/completions", json=COMPLETION | {"prompt": [5, i]},
                                                      headers={"X-Request-Id": "trace-7"}) for i in range(2)))

    assert [r.json()["id"] for r in asyncio.run(same_id_twice())] == ["cmpl-trace-7"] * 2
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "request_id": "from-body"}
    assert httpx.post(url + "/v1/chat/completions", json=chat, timeout=60).json()["id"] == "chatcmpl-from-body"
    header_wins = httpx.post(url + "/v1/chat/completions", json=chat, headers={"X-Request-Id": "hdr"}, timeout=60)
    assert header_wins.json()["id"] == "chatcmpl-hdr"
    with httpx.stream("POST", url + "/v1/completions", json=COMPLETION | {"stream": True, "request_id": "s1"},
                      timeout=60) as stream:
        chunks = [line for line in stream.iter_lines() if line.startswith("data: {")]
    assert chunks and all('"id": "cmpl-s1"' in chunk or '"id":"cmpl-s1"' in chunk for chunk in chunks)
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", httpx.post(url + "/v1/completions", json=COMPLETION,
                                                         timeout=60).json()["id"])
    served.check_idle_and_alive()
