"""OpenAI's Responses API (POST /v1/responses, GET /v1/responses/{id}), through OpenAI's client and
as raw server-sent events: a response's text is the chat completion's for the same messages and
parameters, its stream's events come in OpenAI's order and add up to the whole response, and
reasoning, tool calls and their round trip, kept responses and LoRA adapters work as vLLM's.

A random model writes no tags by itself: as in test_reasoning_and_tool_calls.py, its tokenizer
holds whole outputs (a thought with its answer, a tool call) as single tokens, which a request's
logit_bias (vLLM's extension of the Responses request) makes it write.
"""
import concurrent.futures
import json
import re

import httpx
import openai
import pytest

from mini_engine.chat_template import ChatTemplate
from mini_engine.reasoning import THINK_END, THINK_START
from mini_engine.server.output_parsers import ParsedText, ToolCall
from mini_engine.server.responses_output import ResponseOutput
from mini_engine.tokenizer import load_tokenizer
from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME, forcing_bias, launched_server, write_tiny_model
from tests.server.test_reasoning_and_tool_calls import (CALL, CALL_ARGUMENTS, PARSERS, QWEN3_LIKE_TEMPLATE, THOUGHT,
                                                        UNIT_TOOL)

GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})
# The Responses API's flat function tool, and the chat API's of the same function.
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                          "required": ["city"]}}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
# The Qwen3-like template, with OpenAI's reasoning effort for its thinking: "none" closes the
# thought in the prompt (Qwen3's enable_thinking=False), any other effort opens it there.
EFFORT_TEMPLATE = QWEN3_LIKE_TEMPLATE.replace(
    "enable_thinking is defined and enable_thinking is false",
    "reasoning_effort is defined and reasoning_effort == 'none'",
).replace("think_in_prompt is defined and think_in_prompt", "reasoning_effort is defined and reasoning_effort")
assert EFFORT_TEMPLATE.count("reasoning_effort") == 4


def item_pattern(kind: str) -> str:
    if kind == "function_call":
        return ("response.output_item.added (response.function_call_arguments.delta )*"
                "response.function_call_arguments.done response.output_item.done ")
    text = "output_text" if kind == "message" else "reasoning_text"
    return (f"response.output_item.added response.content_part.added (response.{text}.delta )+"
            f"response.{text}.done response.content_part.done response.output_item.done ")


def check_stream(events: list[dict], kinds: list[str], final: str) -> dict:
    """Asserts OpenAI's order of events for output items of these kinds, each event's place, and
    that each item's deltas add up to its done event's text; returns the finished response."""
    types = " ".join(event["type"] for event in events) + " "
    pattern = "response.created response.in_progress " + "".join(map(item_pattern, kinds)) + final + " "
    assert re.fullmatch(pattern, types), types
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    response = events[-1]["response"]
    assert events[0]["response"]["id"] == response["id"] and events[0]["response"]["status"] == "in_progress"
    added = {e["output_index"]: e["item"] for e in events if e["type"] == "response.output_item.added"}
    done = {e["output_index"]: e["item"] for e in events if e["type"] == "response.output_item.done"}
    assert list(added) == list(done) == list(range(len(kinds))) and list(done.values()) == response["output"]
    for index, item in added.items():
        assert item["status"] == "in_progress" and done[index]["id"] == item["id"]
        mine = [e for e in events if e.get("output_index") == index and e["type"].endswith((".delta", ".done"))
                and "item" not in e]
        assert all(e["item_id"] == item["id"] for e in mine)
        deltas = "".join(e["delta"] for e in mine if e["type"].endswith(".delta"))
        if item["type"] == "function_call":
            assert deltas == done[index]["arguments"] == mine[-1]["arguments"]
        else:
            assert deltas == done[index]["content"][0]["text"] == mine[-2]["text"] == mine[-1]["part"]["text"]
    return response


def raw_events(base_url: str, body: dict) -> list[dict]:
    """A streamed response's events as the server sends them: each named by an `event:` line that
    is its data's type."""
    with httpx.stream("POST", base_url + "/v1/responses", json=body | {"stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    events = []
    for block in text.strip().split("\n\n"):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        events.append(json.loads(data[len("data: "):]))
        assert events[-1]["type"] == name[len("event: "):]
    return events


def without_ids(response: dict) -> dict:
    """A response without what differs between two runs of one request: ids and times."""
    out = {k: v for k, v in response.items() if k not in ("id", "created_at")}
    out["output"] = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in response["output"]]
    return out


def post(base_url: str, body: dict) -> httpx.Response:
    return httpx.post(base_url + "/v1/responses", json={"model": MODEL_NAME} | body, timeout=60)


# ---- the plain server (conftest's: ChatML, no parsers, no kept responses) ----

@pytest.fixture
def client(served):
    with served.openai_client() as c:
        yield c


CASES = {
    "a text": ("Straße? 你好 🚀", None, [{"role": "user", "content": "Straße? 你好 🚀"}]),
    "messages with instructions": (
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
         {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Straße?"},
                                                          {"type": "input_text", "text": "🚀"}]}],
        "Answer briefly.",
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Straße?\n🚀"}]),
    "an earlier response's message and a developer turn": (
        [{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "Hi"},
         {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
          "content": [{"type": "output_text", "text": "Hello!", "annotations": []}]},
         {"role": "user", "content": "Again?"}],
        None,
        [{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again?"}]),
}


@pytest.mark.parametrize("case", CASES)
def test_greedy_text_is_the_chat_completions(client, case):
    """The oracle: the chat endpoint's greedy text for the messages the input means, streamed and
    not, with the same usage; max_output_tokens cut it, so the status is incomplete."""
    input_, instructions, messages = CASES[case]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, **GREEDY)
    response = client.responses.create(model=MODEL_NAME, input=input_, instructions=instructions,
                                       max_output_tokens=16, **GREEDY)
    assert chat.choices[0].message.content.strip()
    assert response.output_text == chat.choices[0].message.content
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL_NAME
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"
    assert message.id.startswith("msg_") and [c.type for c in message.content] == ["output_text"]
    assert message.content[0].annotations == []
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == \
        (chat.usage.prompt_tokens, 16, chat.usage.prompt_tokens + 16)
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    # the chat request just sent the same prompt: every whole block but the last token's was cached
    assert response.usage.input_tokens_details.cached_tokens == (chat.usage.prompt_tokens - 1) // 16 * 16
    assert (response.instructions, response.max_output_tokens, response.temperature) == (instructions, 16, 0)

    streamed = list(client.responses.create(model=MODEL_NAME, input=input_, instructions=instructions,
                                            max_output_tokens=16, stream=True, **GREEDY))
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == response.output_text
    assert streamed[-1].type == "response.incomplete" and streamed[-1].response.output_text == response.output_text
    assert streamed[-1].response.usage == response.usage


def test_a_stop_string_completes_the_response(served, client):
    """A response that ends before max_output_tokens is "completed", as is its stream (read raw,
    and by the client's stream helper, which accumulates the events as it goes)."""
    body = {"input": "Hello", "max_output_tokens": 16, "temperature": 0, "ignore_eos": True}
    text = post(served.base_url, body).json()["output"][0]["content"][0]["text"]
    stop = text[len(text) // 2:][:3]
    assert stop.strip() and stop in text
    whole = post(served.base_url, body | {"stop": [stop]}).json()
    assert whole["status"] == "completed" and whole["incomplete_details"] is None
    assert whole["output"][0]["content"][0]["text"] == text[:text.index(stop)]
    assert whole["output"][0]["status"] == "completed"
    events = raw_events(served.base_url, {"model": MODEL_NAME} | body | {"stop": [stop]})
    assert without_ids(check_stream(events, ["message"], "response.completed")) == without_ids(whole)
    with client.responses.stream(model=MODEL_NAME, input="Hello", max_output_tokens=16, temperature=0,
                                 extra_body={"ignore_eos": True, "stop": [stop]}) as stream:
        final = stream.get_final_response()
    assert final.output_text == text[:text.index(stop)] and final.status == "completed"


def test_raw_stream_events_in_openais_order(served):
    events = raw_events(served.base_url, {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 12,
                                          "temperature": 0, "ignore_eos": True, "metadata": {"k": "v"}})
    response = check_stream(events, ["message"], "response.incomplete")
    whole = post(served.base_url, {"input": "Hi", "max_output_tokens": 12, "temperature": 0, "ignore_eos": True,
                                   "metadata": {"k": "v"}}).json()
    # the second request reads the first's prompt blocks from the prefix cache: its one difference
    cached = whole["usage"]["input_tokens_details"].pop("cached_tokens")
    assert cached >= response["usage"]["input_tokens_details"].pop("cached_tokens")
    assert without_ids(response) == without_ids(whole)
    assert response["metadata"] == {"k": "v"} and response["store"] is False
    assert sum(e["type"] == "response.output_text.delta" for e in events) > 1


def test_the_first_token_an_eos_is_an_empty_completed_response(client, tiny_model):
    eos = load_tokenizer(tiny_model).token_to_id("<|im_end|>")
    response = client.responses.create(model=MODEL_NAME, input="Hi", extra_body={"logit_bias": {str(eos): 100}})
    assert response.status == "completed" and response.output == [] and response.output_text == ""
    assert response.usage.output_tokens == 1


BAD = {
    "an unknown field": ({"frobnicate": 1}, 400, "frobnicate is not a supported parameter"),
    "background": ({"background": True}, 400, "background=True is not supported"),
    "logprobs asked by include": ({"include": ["message.output_text.logprobs"]}, 400, "include="),
    "top_logprobs": ({"top_logprobs": 3}, 400, "top_logprobs=3"),
    "truncation auto": ({"truncation": "auto"}, 400, "truncation='auto'"),
    "a stored prompt": ({"prompt": {"id": "pmpt_1"}}, 400, "prompt="),
    "store without a store": ({"store": True}, 400, "VLLM_ENABLE_RESPONSES_API_STORE=1"),
    "previous_response_id without a store": ({"previous_response_id": "resp_1"}, 404, "keeps no responses"),
    "a web search tool": ({"tools": [{"type": "web_search"}]}, 400, "only function tools"),
    "a tool without a name": ({"tools": [{"type": "function"}]}, 400, "needs a name"),
    "a bad tool_choice": ({"tools": [WEATHER], "tool_choice": "always"}, 400, "tool_choice must be"),
    "tool_choice required without tools": ({"tool_choice": "required"}, 400, "only allowed when tools are set"),
    "auto tool choice without its parser": ({"tools": [WEATHER]}, 400, "--enable-auto-tool-choice"),
    "a named tool that is not one": ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "x"}}, 400,
                                     "not one of the request's tools"),
    "a bad text format": ({"text": {"format": {"type": "xml"}}}, 400, "text.format must be"),
    "a json schema without its schema": ({"text": {"format": {"type": "json_schema", "name": "a"}}}, 400,
                                         "text.format must be"),
    "terse verbosity": ({"text": {"verbosity": "low"}}, 400, "text.verbosity"),
    "an image": ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
                 "input[0]: only text content parts"),
    "an unknown role": ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input[0]: role must be"),
    "a call without its call_id": ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400,
                                   "input[0]: needs 'call_id'"),
    "an unknown item": ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "'item_reference' are not supported"),
    "zero max_output_tokens": ({"max_output_tokens": 0}, 400, "max_output_tokens must be"),
    "max_output_tokens past max_model_len": ({"max_output_tokens": MAX_MODEL_LEN}, 400,
                                             f"plus max_output_tokens={MAX_MODEL_LEN} exceeds max_model_len"),
    "a prompt past max_model_len": ({"input": "fox " * MAX_MODEL_LEN}, 400, "max_model_len"),
    "negative temperature": ({"temperature": -1}, 400, "temperature"),
    "a logit_bias outside the vocabulary": ({"logit_bias": {"9999999": 1}}, 400, "outside the vocabulary"),
    "an unknown model": ({"model": "gpt-4"}, 404, "The model `gpt-4` does not exist."),
    "a bad json schema": ({"text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "nope"}}}}, 400,
                          "Unsupported type"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_requests_get_their_4xx(served, case):
    """Each a 4xx naming what is wrong (the Responses field, not the chat request's it became);
    the server goes on serving (served checks it, and that no KV block is held)."""
    fields, status, message = BAD[case]
    r = post(served.base_url, {"input": "Hi", "max_output_tokens": 4} | fields)
    error = r.json()["error"]
    assert r.status_code == status and message in error["message"], error
    if case == "zero max_output_tokens":
        assert error["param"] == "max_output_tokens"
    assert post(served.base_url, {"input": "Hi", "max_output_tokens": 2}).status_code == 200


def test_bad_requests_leave_a_running_response_alone(served):
    """A stream runs while bad requests come and go: it ends as it would have alone."""
    body = {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 48, "temperature": 0, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(raw_events, served.base_url, body)
        for fields, status, _ in list(BAD.values())[:8]:
            assert post(served.base_url, {"input": "Hi", "max_output_tokens": 4} | fields).status_code == status
        response = check_stream(running.result(), ["message"], "response.incomplete")
    assert response["usage"]["output_tokens"] == 48
    assert without_ids(response) == without_ids(post(served.base_url, body).json())


def test_a_client_that_leaves_a_stream_frees_its_request(served):
    with httpx.stream("POST", served.base_url + "/v1/responses", timeout=60,
                      json={"model": MODEL_NAME, "input": "Hi", "stream": True, "max_output_tokens": 400,
                            "ignore_eos": True}) as r:
        lines = r.iter_lines()
        assert next(lines) == "event: response.created"
    served.wait_idle()


def test_retrieving_without_a_store_is_a_404(served):
    r = httpx.get(served.base_url + "/v1/responses/resp_123", timeout=30)
    assert r.status_code == 404 and "Response with id 'resp_123' not found." in r.json()["error"]["message"]


# ---- a server started as vLLM serves Qwen3 (reasoning and tool call parsers), keeping responses ----

@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory) -> str:
    return write_tiny_model(str(tmp_path_factory.mktemp("tiny-qwen3-responses")), EFFORT_TEMPLATE,
                            added_tokens=(THINK_START, THINK_END, THOUGHT, CALL))


@pytest.fixture(scope="module")
def bias(qwen3_model) -> dict:
    """logit_bias that makes the model write one of the whole outputs."""
    return forcing_bias(qwen3_model, (THOUGHT, CALL))


@pytest.fixture(scope="module")
def qwen3_server(qwen3_model, tmp_path_factory):
    with launched_server(qwen3_model, tmp_path_factory.mktemp("responses-server-log"), options=PARSERS,
                         env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"}) as handle:
        yield handle


@pytest.fixture
def qwen3(qwen3_server):
    with qwen3_server.checked_client() as c:
        yield c


def thought(bias: dict) -> dict:
    """The model writes THOUGHT, and the stop string after its answer ends the response."""
    return {"logit_bias": bias[THOUGHT], "stop": ["Sunny."], "include_stop_str_in_output": True}


def test_a_thought_is_a_reasoning_item_before_the_message(qwen3_server, qwen3, bias):
    response = qwen3.responses.create(model=MODEL_NAME, input="Weather?", max_output_tokens=8,
                                      extra_body=thought(bias))
    assert response.status == "completed" and [item.type for item in response.output] == ["reasoning", "message"]
    reasoning = response.output[0]
    assert reasoning.id.startswith("rs_") and reasoning.summary == [] and reasoning.status == "completed"
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", "\nIt is June.\n")]
    assert response.output_text == "\n\nSunny."
    # vLLM's count: the output tokens between <think> and </think>, which this one token holds.
    assert response.usage.output_tokens == 1 and response.usage.output_tokens_details.reasoning_tokens == 0

    body = {"input": "Weather?", "max_output_tokens": 8} | thought(bias)
    events = raw_events(qwen3_server.base_url, {"model": MODEL_NAME} | body)
    streamed = check_stream(events, ["reasoning", "message"], "response.completed")
    assert without_ids(streamed) == without_ids(post(qwen3_server.base_url, body).json())
    assert events[3]["part"] == {"type": "reasoning_text", "text": ""}


def test_reasoning_effort_goes_to_the_chat_template(qwen3_server, qwen3, qwen3_model):
    """As vLLM passes it, `reasoning_effort`: this template opens the thought for it, so the whole
    greedy output is reasoning, counted as such, and is the chat endpoint's reasoning for it."""
    messages = [{"role": "user", "content": "Weather?"}]
    chat = qwen3.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True,
                                                     "chat_template_kwargs": {"reasoning_effort": "low"}})
    response = qwen3.responses.create(model=MODEL_NAME, input="Weather?", max_output_tokens=12, temperature=0,
                                      reasoning={"effort": "low"}, extra_body={"ignore_eos": True})
    expected = chat.choices[0].message.reasoning
    assert expected.strip() and response.output[0].content[0].text == expected
    assert [item.type for item in response.output] == ["reasoning"] and response.output[0].status == "incomplete"
    assert response.usage.output_tokens_details.reasoning_tokens == response.usage.output_tokens == 12
    assert response.usage.input_tokens == chat.usage.prompt_tokens and response.reasoning.effort == "low"
    events = raw_events(qwen3_server.base_url, {"model": MODEL_NAME, "input": "Weather?", "max_output_tokens": 12,
                                                "temperature": 0, "reasoning": {"effort": "low"}, "ignore_eos": True})
    check_stream(events, ["reasoning"], "response.incomplete")


def test_a_tool_call_and_its_round_trip(qwen3_server, qwen3, qwen3_model, bias):
    """A call is a function_call item, streamed as OpenAI's; sent back with its output, both reach
    the chat template as the chat API's assistant tool_calls and tool message would."""
    extra = {"logit_bias": bias[CALL], "stop": ["</tool_call>"], "include_stop_str_in_output": True}
    response = qwen3.responses.create(model=MODEL_NAME, input="Weather in Paris?", tools=[WEATHER],
                                      max_output_tokens=4, extra_body=extra)
    assert response.status == "completed" and response.output_text == ""
    (call,) = response.output
    assert (call.type, call.name, call.arguments, call.status) == ("function_call", "get_weather", CALL_ARGUMENTS,
                                                                   "completed")
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert response.tools[0].name == "get_weather" and response.tool_choice == "auto"

    body = {"input": "Weather in Paris?", "tools": [WEATHER], "max_output_tokens": 4} | extra
    events = raw_events(qwen3_server.base_url, {"model": MODEL_NAME} | body)
    streamed = check_stream(events, ["function_call"], "response.completed")
    assert without_ids(streamed) == without_ids(post(qwen3_server.base_url, body).json())

    # OpenAI's stream helper, which agent SDKs read, puts the events back together.
    with qwen3.responses.stream(model=MODEL_NAME, input="Weather in Paris?", tools=[WEATHER], max_output_tokens=4,
                                extra_body=extra) as stream:
        (helped,) = stream.get_final_response().output
    assert (helped.name, helped.arguments) == ("get_weather", CALL_ARGUMENTS)

    turn = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(mode="json", exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "20 °C"}]
    again = qwen3.responses.create(model=MODEL_NAME, input=turn, tools=[WEATHER], tool_choice="none",
                                   max_output_tokens=1)
    chat_turn = [{"role": "user", "content": "Weather in Paris?"},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"id": call.call_id, "type": "function",
                      "function": {"name": "get_weather", "arguments": CALL_ARGUMENTS}}]},
                 {"role": "tool", "tool_call_id": call.call_id, "content": "20 °C"}]
    chat = qwen3.chat.completions.create(model=MODEL_NAME, messages=chat_turn, tools=[CHAT_WEATHER],
                                         tool_choice="none", max_tokens=1)
    prompt = ChatTemplate.from_pretrained(qwen3_model).render(
        [chat_turn[0], {**chat_turn[1], "tool_calls": [{**chat_turn[1]["tool_calls"][0], "function": {
            "name": "get_weather", "arguments": json.loads(CALL_ARGUMENTS)}}]}, chat_turn[2]],
        tools=[{"type": "function", "function": {**CHAT_WEATHER["function"]}}])
    assert "<tool_response>\n20 °C\n</tool_response>" in prompt and CALL.strip()[:30] in prompt
    assert again.usage.input_tokens == chat.usage.prompt_tokens == len(load_tokenizer(qwen3_model).encode(prompt).ids)


def test_a_named_tool_choice_streams_its_arguments(qwen3_server, qwen3):
    """Structured outputs hold the output to the function's parameters (reasoning effort "none"
    closes the thought in the prompt): the arguments stream into one function_call item."""
    unit = {"type": "function", "name": "set_unit", "parameters": UNIT_TOOL["function"]["parameters"]}
    # Greedy: the streamed call and the whole one below are compared, which sampling would part.
    body = {"model": MODEL_NAME, "input": "Unit?", "tools": [unit], "max_output_tokens": 80, "temperature": 0,
            "tool_choice": {"type": "function", "name": "set_unit"}, "reasoning": {"effort": "none"}}
    events = raw_events(qwen3_server.base_url, body)
    response = check_stream(events, ["function_call"], "response.completed")
    (call,) = response["output"]
    assert call["name"] == "set_unit" and json.loads(call["arguments"])["unit"] in ("C", "F")
    assert sum(e["type"] == "response.function_call_arguments.delta" for e in events) > 1
    whole = post(qwen3_server.base_url, body).json()
    assert whole["output"][0]["name"] == "set_unit" and json.loads(whole["output"][0]["arguments"]) == \
        json.loads(call["arguments"])


def test_json_schema_text_format(qwen3):
    schema = UNIT_TOOL["function"]["parameters"]
    response = qwen3.responses.create(model=MODEL_NAME, input="Unit?", max_output_tokens=80,
                                      reasoning={"effort": "none"},
                                      text={"format": {"type": "json_schema", "name": "unit", "schema": schema}})
    assert response.status == "completed" and json.loads(response.output_text)["unit"] in ("C", "F")
    assert response.text.format.type == "json_schema"


def test_kept_responses_are_read_back_and_continued(qwen3_server, qwen3, bias):
    """With VLLM_ENABLE_RESPONSES_API_STORE=1, store defaults to true: a response reads back as it
    was, and previous_response_id continues its conversation (its messages, then its reasoning and
    answer as the assistant's turn; not its instructions)."""
    first = qwen3.responses.create(model=MODEL_NAME, input="Weather?", instructions="Be brief.", max_output_tokens=8,
                                   extra_body=thought(bias))
    assert first.store is True
    read = qwen3.responses.retrieve(first.id)
    assert read.model_dump() == first.model_dump()
    second = qwen3.responses.create(model=MODEL_NAME, input="And tomorrow?", previous_response_id=first.id,
                                    max_output_tokens=1)
    assert second.previous_response_id == first.id
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "\n\nSunny.", "reasoning": "\nIt is June.\n"},
                {"role": "user", "content": "And tomorrow?"}]
    chat = qwen3.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1)
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    # The same conversation sent whole, the first response's output items as input.
    whole = qwen3.responses.create(model=MODEL_NAME, max_output_tokens=1, input=[
        {"role": "user", "content": "Weather?"}, *[item.model_dump(mode="json", exclude_none=True)
                                                   for item in first.output],
        {"role": "user", "content": "And tomorrow?"}])
    assert whole.usage.input_tokens == chat.usage.prompt_tokens

    unkept = qwen3.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=1, store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        qwen3.responses.retrieve(unkept.id)
    r = post(qwen3_server.base_url, {"input": "Hi", "previous_response_id": "resp_nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


# ---- the output items, built from parsed text (no server) ----

def test_output_items_follow_the_order_of_the_text():
    """One item open at a time: answer text after a call opens a second message item; a forced
    function's arguments, continued, stay in their call's item; the last item takes the response's
    status."""
    output = ResponseOutput()
    started = {"id": "resp_1", "status": "in_progress"}
    events = [output.event("response.created", response=started),
              output.event("response.in_progress", response=started)]
    for parsed in [ParsedText(reasoning="Hm"), ParsedText(reasoning=".", content="A"),
                   ParsedText(content="B", tool_calls=[ToolCall(0, "f", '{"a": ')]),
                   ParsedText(tool_calls=[ToolCall(0, "f", "1}", continued=True)]), ParsedText(content="C")]:
        events += output.feed(parsed)
    events += output.finish("incomplete")
    events.append(output.event("response.incomplete", response={"id": "resp_1", "output": output.items}))
    check_stream(events, ["reasoning", "message", "function_call", "message"], "response.incomplete")
    assert [(item["type"], item["status"]) for item in output.items] == [
        ("reasoning", "completed"), ("message", "completed"), ("function_call", "completed"), ("message", "incomplete")]
    assert output.items[0]["content"] == [{"type": "reasoning_text", "text": "Hm."}]
    assert output.items[1]["content"][0]["text"] == "AB" and output.items[2]["arguments"] == '{"a": 1}'


def test_a_calls_end_and_the_text_after_it_in_one_delta():
    """The last delta holds a call's last piece and then text (a parser that streams a call's
    arguments in pieces, qwen3_coder's): the piece closes its call's item before the text opens a
    message item, and no second function_call item is made of it."""
    output = ResponseOutput()
    for parsed in [ParsedText(content="Hi", tool_calls=[ToolCall(0, "f", '{"a": 1')]),
                   ParsedText(content="\nDone.", tool_calls=[ToolCall(0, "f", "}", continued=True)])]:
        output.feed(parsed)
    output.finish("completed")
    assert [(item["type"], item.get("arguments")) for item in output.items] == [
        ("message", None), ("function_call", '{"a": 1}'), ("message", None)]
    assert output.items[2]["content"][0]["text"] == "\nDone."


# ---- LoRA adapters ----

def test_an_adapters_response_is_its_chat_completion(tiny_model, tmp_path_factory):
    """The model names an adapter (--lora-modules), whose tokens the response has: the chat
    completion's with the same adapter, not the base model's."""
    from tests.lora_reference import write_adapter      # here: it skips where peft is not installed
    adapter = write_adapter(tiny_model, str(tmp_path_factory.mktemp("responses-lora") / "first"), seed=1, alpha=64)
    options = ("--enable-lora", "--max-loras", "1", "--max-lora-rank", "8", "--lora-modules", f"first={adapter}")
    with launched_server(tiny_model, tmp_path_factory.mktemp("responses-lora-log"), options=options) as server:
        with server.openai_client() as client:
            texts = {}
            for model in ("first", MODEL_NAME):
                response = client.responses.create(model=model, input="Hi", max_output_tokens=12, **GREEDY)
                chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                      max_tokens=12, **GREEDY)
                assert response.output_text == chat.choices[0].message.content and response.model == model
                texts[model] = response.output_text
            assert texts["first"] != texts[MODEL_NAME]
        server.wait_idle()
