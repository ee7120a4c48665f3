"""Behaviour a vLLM user relies on, checked against what vLLM's OpenAI server does (the vLLM source
each test follows is named in it)."""
import httpx

from tests.server.conftest import MODEL_NAME


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
