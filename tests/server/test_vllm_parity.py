"""Behaviour a vLLM user relies on, checked against what vLLM's OpenAI server does (the vLLM source
each test follows is named in it)."""
from types import SimpleNamespace

import httpx
from prometheus_client.parser import text_string_to_metric_families

from mini_engine.config import EngineConfig
from mini_engine.server.app import OpenAIServer
from mini_engine.server.engine_process import EngineStats
from mini_engine.server.metrics import ServerMetrics
from mini_engine.server.protocol import CompletionRequest
from tests.server.conftest import MODEL_NAME
from tests.test_generation_config import QWEN3_GENERATION_CONFIG, with_generation_config


def post(served, path: str, body: dict) -> dict:
    r = httpx.post(served.base_url + path, json={"model": MODEL_NAME} | body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_text_parts_of_a_message_join_with_newlines(served):
    """vllm/entrypoints/chat_utils.py (_parse_chat_message_content_parts): for a template that takes
    string content, a message's text parts become one string joined with "\\n"."""
    def chat(content) -> dict:
        return post(served, "/v1/chat/completions", {"messages": [{"role": "user", "content": content}],
                                                     "max_tokens": 4, "temperature": 0, "ignore_eos": True})

    parts = chat([{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}])
    joined = chat("Hello\nworld")
    assert parts["usage"] == joined["usage"]
    assert parts["choices"][0]["message"] == joined["choices"][0]["message"]


def test_completion_max_tokens_absent_or_null_is_16(served):
    """vllm/entrypoints/openai/completion/protocol.py: max_tokens defaults to 16, and its
    normalize_null_max_tokens validator makes an explicit null the same 16 (vLLM #45491; before it,
    vLLM answered a null with a 500). Not max_model_len minus the prompt, as chat's default is."""
    for body in ({}, {"max_tokens": None}):
        out = post(served, "/v1/completions", {"prompt": "Hello", "ignore_eos": True} | body)
        assert out["usage"]["completion_tokens"] == 16, body
        assert out["choices"][0]["finish_reason"] == "length"


def stats(num_preemptions: int) -> EngineStats:
    return EngineStats(num_running=0, num_waiting=0, kv_blocks_used=0, kv_blocks_total=8,
                       prefix_cache_hit_tokens=0, prefix_cache_queried_tokens=0, num_preemptions=num_preemptions)


def test_preemptions_are_a_counter_named_like_vllms():
    """vllm/v1/metrics/loggers.py: Counter "vllm:num_preemptions", which Prometheus exposes as
    vllm:num_preemptions_total, so that rate() and dashboards written for vLLM work on it."""
    metrics = ServerMetrics(MODEL_NAME)
    for running_total in (0, 2, 2, 5):      # what the engine reports after each step
        metrics.engine(0).update_engine_state(stats(running_total))
    family = next(f for f in text_string_to_metric_families(metrics.render().decode())
                  if f.name == "mini_engine:num_preemptions")
    assert family.type == "counter"
    assert [(s.name, s.value) for s in family.samples if s.name.endswith("_total")] == \
        [("mini_engine:num_preemptions_total", 5.0)]


def test_server_fills_only_what_the_request_leaves_unset(tiny_checkpoint, tmp_path):
    """vllm/entrypoints/openai (to_sampling_params with the model's diff_sampling_param): a field
    the request leaves unset or null takes the checkpoint's generation_config.json value."""
    path = with_generation_config(tiny_checkpoint, tmp_path, QWEN3_GENERATION_CONFIG)
    server = SimpleNamespace(config=EngineConfig(path, device="cpu", num_kv_blocks=8))

    def params(**fields):
        return OpenAIServer.sampling_params(server, CompletionRequest(model="m", prompt="x", **fields), 7, None)

    assert (params().temperature, params().top_k, params().top_p) == (0.6, 20, 0.95)
    # null is unset, as OpenAI reads it.
    assert (params(temperature=None, top_k=None).temperature, params(top_k=None).top_k) == (0.6, 20)
    p = params(temperature=0.0, top_k=-1, top_p=1.0)
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (0.0, -1, 1.0, 7)


def test_model_left_out_or_empty_is_the_served_model(served):
    """vllm/entrypoints/openai/protocol.py: `model: Optional[str] = None` on every request, and
    serving_engine.py's _check_model (_is_model_supported: `if not model_name: return True`) serves
    a request without one, or with "", by the served model; any other name it does not serve is a
    404. So SageMaker's /invocations bodies need no model either."""
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    completion = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    for path, body in [("/v1/chat/completions", chat), ("/v1/completions", completion), ("/invocations", chat),
                       ("/invocations", completion)]:
        named = post(served, path, body)
        for unnamed in (body, body | {"model": ""}):
            r = httpx.post(served.base_url + path, json=unnamed, timeout=60)
            assert r.status_code == 200, (path, unnamed, r.text)
            assert (r.json()["model"], r.json()["choices"]) == (MODEL_NAME, named["choices"])
    r = httpx.post(served.base_url + "/v1/responses", json={"input": "Hi", "max_output_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == MODEL_NAME, r.text
    r = httpx.post(served.base_url + "/v1/chat/completions", json=chat | {"model": "gpt-4"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["message"] == "The model `gpt-4` does not exist."


def test_chat_answers_in_the_role_it_continues(served, client):
    """vllm/entrypoints/openai/serving_chat.py get_chat_request_role: with add_generation_prompt the
    answer's role is the response role ("assistant"); without one it is the final message's, which
    the choices continue; the same in a stream's first chunk as in the whole answer."""
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to"}]
    prefilled = conversation + [{"role": "assistant", "content": "One,"}]
    for messages, fields, role in [(conversation, {}, "assistant"),
                                   (conversation, {"add_generation_prompt": False}, "user"),
                                   (conversation, {"add_generation_prompt": False, "continue_final_message": True},
                                    "user"),
                                   (prefilled, {"add_generation_prompt": False}, "assistant")]:
        body = {"messages": messages, "max_tokens": 3, "temperature": 1.0, "seed": 3, "n": 2, "ignore_eos": True}
        whole = post(served, "/v1/chat/completions", body | fields)
        assert [c["message"]["role"] for c in whole["choices"]] == [role, role], fields
        chunks = list(client.chat.completions.create(model=MODEL_NAME, stream=True, messages=messages, max_tokens=3,
                                                     temperature=1.0, seed=3, n=2,
                                                     extra_body={"ignore_eos": True} | fields))
        assert [c.delta.role for c in chunks[0].choices] == [role, role], fields
        assert all(c.delta.role is None for chunk in chunks[1:] for c in chunk.choices)


def test_generation_configs_max_new_tokens_caps_every_request(tiny_model, tmp_path):
    """vLLM #12242 (vllm/entrypoints/utils.py get_max_tokens): max_new_tokens from
    --override-generation-config (or generation_config.json) caps the max_tokens of every request,
    a chat's default (the rest of the context) and a completion's 16 included, without an error."""
    from tests.server.conftest import launched_server
    with launched_server(tiny_model, tmp_path, options=("--override-generation-config", '{"max_new_tokens": 5}')) as server:
        messages = [{"role": "user", "content": "Hi"}]
        for path, body in (("/v1/completions", {"prompt": "Hello", "max_tokens": 50}),
                           ("/v1/completions", {"prompt": "Hello"}),
                           ("/v1/chat/completions", {"messages": messages}),
                           ("/v1/chat/completions", {"messages": messages, "max_completion_tokens": 3})):
            out = post(server, path, body | {"ignore_eos": True, "temperature": 0})
            assert out["usage"]["completion_tokens"] == (3 if "max_completion_tokens" in body else 5), body
            assert out["choices"][0]["finish_reason"] == "length"
        server.check_idle_and_alive()
