"""vLLM's development routes (VLLM_SERVER_DEV_MODE=1): /sleep, /wake_up, /is_sleeping and
/reset_prefix_cache on a server started with --enable-sleep-mode: a sleep and a wake leave greedy
outputs as they were, requests while asleep get a 503, and what cannot be done now (a sleep or a
reset while a request runs) a 409 that loses nothing."""
import json

import httpx
import pytest

from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME, launched_server

PROMPT = "The quick brown fox"
GREEDY = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("dev-server-traces")


@pytest.fixture(scope="module")
def dev_server(tiny_model, tmp_path_factory, profile_dir):
    with launched_server(tiny_model, tmp_path_factory.mktemp("dev-server-log"), options=("--enable-sleep-mode",),
                         env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_TORCH_PROFILER_DIR": str(profile_dir)}) as handle:
        yield handle


@pytest.fixture
def dev(dev_server):
    with httpx.Client(base_url=dev_server.base_url, timeout=60) as client:
        yield client
    dev_server.check_idle_and_alive()


def completion_text(client: httpx.Client) -> str:
    response = client.post("/v1/completions", json=GREEDY)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_sleep_and_wake_keep_the_outputs(dev):
    before = completion_text(dev)
    assert dev.get("/is_sleeping").json() == {"is_sleeping": False}
    assert dev.post("/sleep", params={"level": 1}).json() == {"is_sleeping": True}
    assert dev.get("/is_sleeping").json() == {"is_sleeping": True}
    asleep = dev.post("/v1/completions", json=GREEDY)
    assert asleep.status_code == 503 and "asleep" in asleep.json()["error"]["message"]
    # The weights first, then the KV cache, as an RL trainer wakes them.
    assert dev.post("/wake_up", params={"tags": "weights"}).json() == {"is_sleeping": True}
    assert dev.post("/wake_up", params={"tags": "kv_cache"}).json() == {"is_sleeping": False}
    assert completion_text(dev) == before
    assert dev.post("/sleep").status_code == 200 and dev.post("/wake_up").json() == {"is_sleeping": False}
    assert completion_text(dev) == before


def test_reset_prefix_cache(dev, dev_server):
    """The cache's hit rate (hit over queried prompt tokens, since start): a prompt's second run
    hits its full blocks; after a reset its third finds none, so the rate falls (a hit would raise it)."""
    long_prompt = GREEDY | {"prompt": " ".join(["the quick brown fox jumps over the lazy dog"] * 8)}
    for _ in range(2):
        assert dev.post("/v1/completions", json=long_prompt).status_code == 200
    rate = dev_server.metrics()["mini_engine:prefix_cache_hit_rate"]
    assert rate > 0
    assert dev.post("/reset_prefix_cache").json() == {"reset": True}
    assert dev.post("/v1/completions", json=long_prompt).status_code == 200
    assert dev_server.metrics()["mini_engine:prefix_cache_hit_rate"] < rate


def test_not_now_is_a_conflict_that_loses_nothing(dev):
    """A sleep or a reset while a request streams: 409, and the request ends as it would have. The
    request is long (480 tokens, hundreds of steps) so that it still runs when the calls arrive."""
    long_request = GREEDY | {"max_tokens": MAX_MODEL_LEN - 32}
    expected = dev.post("/v1/completions", json=long_request).json()["choices"][0]["text"]
    with dev.stream("POST", "/v1/completions", json=long_request | {"stream": True}) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        for route in ("/sleep", "/reset_prefix_cache"):
            refused = dev.post(route)
            assert refused.status_code == 409, (route, refused.text)
        rest = [line for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
    text = "".join(json.loads(line[len("data: "):])["choices"][0]["text"] for line in [first, *rest])
    assert text == expected
    assert dev.get("/is_sleeping").json() == {"is_sleeping": False}


def test_pause_keep_freezes_a_stream_that_resume_continues(dev):
    """vLLM's /pause?mode=keep&clear_cache=false, /is_paused, /resume: a streaming request stops
    between tokens while paused and then ends as it would have; a request sent while paused waits
    and runs after; a mode vLLM does not know is a 400."""
    import threading
    long_request = GREEDY | {"max_tokens": 200}
    expected = dev.post("/v1/completions", json=long_request).json()["choices"][0]["text"]
    assert dev.post("/pause", params={"mode": "drain"}).status_code == 400
    late = {}
    with dev.stream("POST", "/v1/completions", json=long_request | {"stream": True}) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert dev.post("/pause", params={"mode": "keep", "clear_cache": "false"}).json() == {"is_paused": True}
        assert dev.get("/is_paused").json() == {"is_paused": True}
        waiter = threading.Thread(target=lambda: late.update(dev.post("/v1/completions", json=GREEDY).json()))
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive(), "a request ran while paused"
        assert dev.post("/resume").json() == {"is_paused": False}
        rest = [line for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
    waiter.join(60)
    text = "".join(json.loads(line[len("data: "):])["choices"][0]["text"] for line in [first, *rest])
    assert text == expected
    assert late["choices"][0]["text"] == completion_text(dev)
    assert dev.get("/is_paused").json() == {"is_paused": False}


def test_bad_requests(dev):
    assert dev.post("/sleep", params={"level": 2}).status_code == 400      # nothing here would load weights again
    assert dev.post("/sleep", params={"level": 7}).status_code == 400
    bad_tag = dev.post("/wake_up", params={"tags": "everything"})
    assert bad_tag.status_code == 400 and "tags" in bad_tag.json()["error"]["message"]
    assert dev.get("/is_sleeping").json() == {"is_sleeping": False}


def test_routes_exist_only_in_dev_mode(served):
    with httpx.Client(base_url=served.base_url, timeout=10) as client:
        for route in ("/sleep", "/wake_up", "/reset_prefix_cache", "/pause", "/resume"):
            assert client.post(route).status_code == 404
        assert client.get("/is_sleeping").status_code == 404 and client.get("/is_paused").status_code == 404


def test_start_and_stop_profile_write_the_engines_trace(dev, profile_dir):
    """vLLM's /start_profile and /stop_profile (with VLLM_TORCH_PROFILER_DIR set): the engine
    process's steps between them in a Chrome trace there; out of order, a 409."""
    assert dev.post("/stop_profile").status_code == 409
    assert dev.post("/start_profile").json() == {"profiling": True}
    assert dev.post("/start_profile").status_code == 409
    before = completion_text(dev)
    stopped = dev.post("/stop_profile").json()
    assert stopped["profiling"] is False and stopped["trace"].startswith(str(profile_dir))
    with open(stopped["trace"]) as f:
        names = {event.get("name", "") for event in json.load(f)["traceEvents"]}
    assert any("linear" in name for name in names)
    assert completion_text(dev) == before


def test_reset_external_forgets_the_host_tier(tiny_model, tmp_path):
    """--kv-offloading-size (vLLM's flag): after a plain /reset_prefix_cache the host tier still
    holds the prompt's blocks, which vLLM's counters vllm:external_prefix_cache_{queries,hits}
    count as they are loaded; after ?reset_external=true it holds none."""
    long_prompt = GREEDY | {"prompt": " ".join(["the quick brown fox jumps over the lazy dog"] * 8)}
    options = ("--kv-offloading-size", "0.01", "--kv-offloading-backend", "native")
    with launched_server(tiny_model, tmp_path, options=options, env={"VLLM_SERVER_DEV_MODE": "1"}) as server, \
            httpx.Client(base_url=server.base_url, timeout=60) as dev:
        def external_hits() -> float:
            return server.metrics()["mini_engine:external_prefix_cache_hits_total"]
        first = dev.post("/v1/completions", json=long_prompt).json()["choices"][0]["text"]
        assert dev.post("/reset_prefix_cache").json() == {"reset": True}
        assert dev.post("/v1/completions", json=long_prompt).json()["choices"][0]["text"] == first
        hits = external_hits()
        assert hits > 0 and server.metrics()["mini_engine:external_prefix_cache_queries_total"] >= hits
        assert dev.post("/reset_prefix_cache", params={"reset_external": "true"}).json() == {"reset": True}
        assert dev.post("/v1/completions", json=long_prompt).json()["choices"][0]["text"] == first
        assert external_hits() == hits
        server.check_idle_and_alive()
