"""Each bad request gets its 4xx with OpenAI's error JSON, and the server keeps serving, the
requests already running included."""
import threading

import httpx
import openai
import pytest

from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME

OK = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4}
CHAT_OK = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
TOOLS = [{"type": "function", "function": {"name": "f"}}]

BAD_COMPLETIONS = {
    "prompt beyond max_model_len": (OK | {"prompt": [1] * (MAX_MODEL_LEN + 10)}, 400, "max_model_len"),
    "prompt plus max_tokens beyond max_model_len": (OK | {"prompt": [1] * 500, "max_tokens": 20}, 400,
                                                    "max_model_len"),
    "negative max_tokens": (OK | {"max_tokens": -1}, 400, "max_tokens"),
    "zero max_tokens": (OK | {"max_tokens": 0}, 400, "max_tokens"),
    "unknown model": (OK | {"model": "gpt-4"}, 404, "does not exist"),
    "n of 0": (OK | {"n": 0}, 400, "n must be"),
    "min_tokens above max_tokens": (OK | {"min_tokens": 5}, 400, "min_tokens"),
    "greedy n > 1": (OK | {"n": 2, "temperature": 0}, 400, "n must be 1 when sampling greedily"),
    "best_of": (OK | {"best_of": 3}, 400, "best_of"),
    "echo of an empty prompt": (OK | {"echo": True, "prompt": []}, 400, "the prompt is empty"),
    "priority under fcfs": (OK | {"priority": 1}, 400, "--scheduling-policy priority"),
    "echo with negative max_tokens": (OK | {"echo": True, "max_tokens": -1}, 400, "max_tokens"),
    "echo alone of a max_model_len prompt": (OK | {"echo": True, "max_tokens": 0, "prompt": [1] * MAX_MODEL_LEN}, 400,
                                             "needs a prompt shorter than max_model_len"),
    "presence_penalty above 2": (OK | {"presence_penalty": 2.5}, 400, "presence_penalty"),
    "frequency_penalty below -2": (OK | {"frequency_penalty": -3}, 400, "frequency_penalty"),
    "repetition_penalty zero": (OK | {"repetition_penalty": 0}, 400, "repetition_penalty"),
    "min_p above 1": (OK | {"min_p": 1.5}, 400, "min_p"),
    "logit_bias key not a token id": (OK | {"logit_bias": {"five": 10}}, 400, "logit_bias keys"),
    "logit_bias outside the vocabulary": (OK | {"logit_bias": {"9999999": 1}}, 400, "outside the vocabulary"),
    "unknown parameter": (OK | {"frobnicate": 1}, 400, "frobnicate is not a supported parameter"),
    "too many logprobs": (OK | {"logprobs": 50}, 400, "logprobs"),
    "too many prompt_logprobs": (OK | {"prompt_logprobs": 50}, 400, "prompt_logprobs"),
    "prompt_logprobs streamed": (OK | {"prompt_logprobs": 1, "stream": True}, 400, "not supported with stream"),
    "allowed_token_ids empty": (OK | {"allowed_token_ids": []}, 400, "allowed_token_ids"),
    "a bad regex": (OK | {"structured_outputs": {"regex": "(ab"}}, 400, "structured_outputs: Regex parsing error"),
    "two structured outputs at once": (OK | {"structured_outputs": {"regex": "a", "choice": ["b"]}}, 400,
                                       "exactly one"),
    "an unknown structured output": (OK | {"structured_outputs": {"xml": "a"}}, 400, "xml"),
    "allowed_token_ids outside the vocabulary": (OK | {"allowed_token_ids": [9999999]}, 400, "outside the vocabulary"),
    "negative temperature": (OK | {"temperature": -1}, 400, "temperature"),
    "top_p zero": (OK | {"top_p": 0}, 400, "top_p"),
    "bad top_k": (OK | {"top_k": -5}, 400, "top_k"),
    "top_k past int64": (OK | {"top_k": 2 ** 63}, 400, "top_k"),
    "negative seed": (OK | {"seed": -3}, 400, "seed"),
    "negative stop token": (OK | {"stop_token_ids": [-1]}, 400, "stop_token_ids"),
    "empty prompt": (OK | {"prompt": ""}, 400, "empty"),
    "token id beyond the vocabulary": (OK | {"prompt": [10 ** 7]}, 400, "prompt token ids"),
    "a token id beyond the vocabulary in a batch": (OK | {"prompt": [[5, 6], [10 ** 7]]}, 400, "prompt 1:"),
    "a batch prompt beyond max_model_len": (OK | {"prompt": [[5, 6], [1] * (MAX_MODEL_LEN + 10)]}, 400,
                                            "prompt 1:"),
    "an empty prompt in a batch": (OK | {"prompt": ["Hi", ""]}, 400, "prompt 1:"),
    "texts and token ids in one batch": (OK | {"prompt": ["Hi", [5, 6]]}, 400, "prompt"),
    "prompt of the wrong type": (OK | {"prompt": 5}, 400, "prompt"),
    "missing prompt": ({"model": MODEL_NAME}, 400, "prompt"),
    "wrong max_tokens type": (OK | {"max_tokens": "many"}, 400, "max_tokens"),
}
BAD_CHAT = {
    "image content": (CHAT_OK | {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "text content"),
    "chat top_logprobs without logprobs": (CHAT_OK | {"top_logprobs": 2}, 400, "needs logprobs=true"),
    "chat too many top_logprobs": (CHAT_OK | {"logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    "missing messages": ({"model": MODEL_NAME}, 400, "messages"),
    "chat negative n": (CHAT_OK | {"n": -1}, 400, "n must be"),
    "chat unknown model": (CHAT_OK | {"model": "nope"}, 404, "does not exist"),
    "bad stream_options": (CHAT_OK | {"stream": True, "stream_options": {"bogus": 1}}, 400, "bogus"),
    "a message the template cannot render": (CHAT_OK | {"messages": [{"role": "user"}]}, 400, "chat template"),
    "tools without --enable-auto-tool-choice": (CHAT_OK | {"tools": TOOLS}, 400, "requires --enable-auto-tool-choice"),
    "a tool that is not a function": (CHAT_OK | {"tools": [{"type": "retrieval"}], "tool_choice": "none"}, 400,
                                      "tools.0.type"),
    "a tool without a function": (CHAT_OK | {"tools": [{"type": "function"}], "tool_choice": "none"}, 400,
                                  "tools.0.function"),
    "tool_choice without tools": (CHAT_OK | {"tool_choice": "none"}, 400, "only allowed when tools are set"),
    "an unknown response_format": (CHAT_OK | {"response_format": {"type": "xml"}}, 400, "response_format"),
    "json_schema without a schema": (CHAT_OK | {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x"}}}, 400, "needs"),
    "json_schema that is not an object": (CHAT_OK | {"response_format": {"type": "json_schema", "json_schema": "x"}},
                                          400, "needs"),
    "a schema that is not one": (CHAT_OK | {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": 5}}}}, 400, "properties must be an object"),
    "response_format and structured_outputs": (CHAT_OK | {"response_format": {"type": "json_object"},
                                                          "structured_outputs": {"regex": "a"}}, 400, "both constrain"),
    "a forced tool_choice and response_format": (CHAT_OK | {"tools": TOOLS, "tool_choice": "required",
                                                            "response_format": {"type": "json_object"}}, 400,
                                                 "both constrain"),
    "a named tool that is not among the tools": (CHAT_OK | {"tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "g"}}}, 400, "not one of the request's tools"),
    "a tool_choice of the wrong shape": (CHAT_OK | {"tools": TOOLS, "tool_choice": {"type": "function"}}, 400,
                                         "tool_choice must be"),
    "tool_choice required without tools": (CHAT_OK | {"tools": [], "tool_choice": "required"}, 400, "needs tools"),
    "stream_options without stream": (CHAT_OK | {"stream_options": {"include_usage": True}}, 400, "stream=true"),
    "template kwargs that set a request field": (CHAT_OK | {"chat_template_kwargs": {"add_generation_prompt": False}},
                                                 400, "chat_template_kwargs"),
}


def check_error(r: httpx.Response, status: int, words: str):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["type"]


@pytest.mark.parametrize("name", list(BAD_COMPLETIONS))
def test_bad_completion_request(served, name):
    body, status, words = BAD_COMPLETIONS[name]
    check_error(httpx.post(served.base_url + "/v1/completions", json=body, timeout=10), status, words)


@pytest.mark.parametrize("name", list(BAD_CHAT))
def test_bad_chat_request(served, name):
    body, status, words = BAD_CHAT[name]
    check_error(httpx.post(served.base_url + "/v1/chat/completions", json=body, timeout=10), status, words)


def test_malformed_json_and_unknown_routes(served):
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = httpx.post(served.base_url + path, content=b'{"model": "tiny-qwen3", "prompt": ',
                       headers={"content-type": "application/json"}, timeout=10)
        check_error(r, 400, "not valid JSON")
    check_error(httpx.get(served.base_url + "/v1/nothing-here", timeout=10), 404, "Not Found")


def test_openai_client_raises_the_right_errors(served):
    with served.openai_client(timeout=30) as client:
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            client.completions.create(model="gpt-4", prompt="x")
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=-1)
        with pytest.raises(openai.BadRequestError, match="max_model_len"):
            client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x" * 3000}])


def test_bad_requests_do_not_disturb_running_ones(served):
    results = []

    def good():
        with served.openai_client() as c:
            chunks = list(c.completions.create(model=MODEL_NAME, prompt="Steady", max_tokens=150, stream=True,
                                               stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True}))
            results.append(chunks[-1].usage.completion_tokens)

    threads = [threading.Thread(target=good) for _ in range(4)]
    for t in threads:
        t.start()
    for body, status, words in list(BAD_COMPLETIONS.values()) * 2:
        check_error(httpx.post(served.base_url + "/v1/completions", json=body, timeout=10), status, words)
    for t in threads:
        t.join(timeout=60)
    assert results == [150] * 4
    r = httpx.post(served.base_url + "/v1/completions", json=OK, timeout=10)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
