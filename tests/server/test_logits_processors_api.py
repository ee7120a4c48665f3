"""vLLM's --logits-processors and vllm_xargs: a server started with custom processors (loaded by
name in the engine's process and the API's) applies them to the requests whose vllm_xargs opt in,
on /v1/completions and /v1/chat/completions, streamed or not; a request a processor refuses is a
400 and the server goes on."""
import json

import httpx
import pytest

from mini_engine import LLM, SamplingParams
from mini_engine.serve import parse_args
from tests.server.conftest import MODEL_NAME, NUM_KV_BLOCKS, launched_server

PROCESSORS = ("tests.logits_processor_examples:TargetToken", "tests.logits_processor_examples.CountUp")


@pytest.fixture(scope="module")
def processed(tiny_model, tmp_path_factory):
    with launched_server(tiny_model, tmp_path_factory.mktemp("logits-processors-log"),
                         options=("--logits-processors", *PROCESSORS)) as handle:
        yield handle


@pytest.fixture
def served(processed):
    yield processed
    processed.check_idle_and_alive()


@pytest.fixture(scope="module")
def offline(tiny_model):
    return LLM(tiny_model, num_kv_blocks=NUM_KV_BLOCKS, logits_processors=list(PROCESSORS))


def post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + route, json={"model": MODEL_NAME, "temperature": 0, "max_tokens": 6,
                                                     "ignore_eos": True} | body, timeout=60)


def test_the_flag_takes_qualified_names():
    assert parse_args(["--logits-processors", *PROCESSORS]).logits_processors == list(PROCESSORS)
    assert parse_args([]).logits_processors is None


@pytest.mark.parametrize("xargs", [{"target_token": 42}, {"count_up": 30}, None])
def test_completions_follow_the_requests_processor(served, offline, xargs):
    prompt = [5, 6, 7, 8]
    r = post(served, "/v1/completions", {"prompt": prompt, "vllm_xargs": xargs})
    assert r.status_code == 200, r.text
    want = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, extra_args=xargs),
                            use_tqdm=False)[0].outputs[0]
    assert r.json()["choices"][0]["text"] == want.text
    if xargs and "target_token" in xargs:
        assert want.token_ids == [42] * 6
    elif xargs:
        assert want.token_ids == list(range(30, 36))


def test_a_chat_stream_follows_it_too(served, offline):
    r = post(served, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stream": True,
                                              "vllm_xargs": {"target_token": 42}})
    assert r.status_code == 200, r.text
    text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                   for line in r.text.splitlines() if line.startswith("data: {"))
    assert text == offline.tokenizer.decode([42] * 6)


def test_a_request_the_processor_refuses_is_a_400(served):
    r = post(served, "/v1/completions", {"prompt": [1, 2, 3], "vllm_xargs": {"target_token": -1}})
    assert r.status_code == 400 and "target_token must be a token id" in r.json()["error"]["message"]
    assert post(served, "/v1/completions", {"prompt": [1, 2, 3]}).status_code == 200
