"""vLLM's request-level metrics on /metrics: each finished request's prompt and output lengths and
its max_tokens, its phases (queue, prefill, decode, inference), the tokens of every engine step,
and the prefix cache's lookups and hits as counters."""
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from mini_engine.server.metrics import token_buckets
from tests.server.conftest import MODEL_NAME


def complete(served, prompt: list[int], max_tokens: int) -> None:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    r = httpx.post(served.base_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == max_tokens


def grew(before: dict, after: dict, name: str) -> float:
    return after[f"mini_engine:{name}"] - before.get(f"mini_engine:{name}", 0.0)


def test_request_lengths_phases_and_step_tokens(served):
    before = served.wait_idle()
    # Prompts under one 16-token block: nothing for the prefix cache to serve, so every prompt token is computed.
    prompts, max_tokens = [[7 + i, 17, 300 + i, 42] * (i + 1) for i in range(3)], [3, 5, 7]
    for prompt, n in zip(prompts, max_tokens):
        complete(served, prompt, n)
    after = served.wait_idle()
    for name in ("request_prompt_tokens", "request_generation_tokens", "request_params_max_tokens",
                 "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds"):
        assert grew(before, after, f"{name}_count") == 3, name
    assert grew(before, after, "request_prompt_tokens_sum") == sum(map(len, prompts))
    assert grew(before, after, "request_generation_tokens_sum") == grew(before, after, "request_params_max_tokens_sum") == 15
    # The phases add up: prefill + decode = inference; queue + inference ends at the engine's last
    # token, which the API process, whose end-to-end time ends there, sees a little later.
    queue, prefill, decode, inference, e2e = (grew(before, after, f"{name}_sum") for name in (
        "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
        "request_inference_time_seconds", "e2e_request_latency_seconds"))
    assert min(queue, prefill, decode) > 0
    assert abs(prefill + decode - inference) < 1e-6 and 0 <= e2e - (queue + inference) < 0.5
    # As vLLM counts a step's tokens: each generated one, and a request's prompt in the step of its first.
    assert grew(before, after, "iteration_tokens_total_sum") == sum(map(len, prompts)) + sum(max_tokens)
    assert grew(before, after, "iteration_tokens_total_count") >= max(max_tokens)


def test_a_requests_queue_time_ends_at_its_first_admission(tiny_model):
    """With one sequence at a time, the second request is admitted only after the first has run:
    its stamp is its admission, not its arrival."""
    from mini_engine import LLM, SamplingParams
    engine = LLM(tiny_model, num_kv_blocks=64, max_num_seqs=1).engine
    first = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    second = engine.add_request([8, 9, 10], SamplingParams(max_tokens=4, ignore_eos=True))
    first_output = None
    while engine.has_unfinished_requests():
        if any(out.seq is first for out in engine.step()) and first_output is None:
            first_output = time.perf_counter()
    assert first.first_scheduled_time < first_output < second.first_scheduled_time


def test_prefix_cache_lookups_and_hits_are_counters(served):
    before = served.wait_idle()
    prompt = [11 + i % 50 for i in range(40)]       # two whole 16-token blocks and a part
    complete(served, prompt, 2)
    complete(served, prompt, 2)
    after = served.wait_idle()
    assert grew(before, after, "prefix_cache_queries_total") == 80
    assert grew(before, after, "prefix_cache_hits_total") == 32
    families = {f.name: f.type for f in text_string_to_metric_families(httpx.get(served.base_url + "/metrics").text)}
    assert families["mini_engine:prefix_cache_hits"] == families["mini_engine:prefix_cache_queries"] == "counter"
    assert families["mini_engine:iteration_tokens_total"] == "histogram"


def test_token_buckets_are_vllms_one_two_five():
    assert token_buckets(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    assert token_buckets(1) == (1,) and token_buckets(100)[-1] == 100
