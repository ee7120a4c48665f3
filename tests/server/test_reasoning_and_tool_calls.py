"""A server started as vLLM serves Qwen3 (--reasoning-parser qwen3 --enable-auto-tool-choice
--tool-call-parser hermes), through the openai client: reasoning apart from content, tool calls
as OpenAI's, streamed and not, and the tools and earlier calls given to the chat template.

A random model writes no tags by itself, so its tokenizer holds whole outputs as single tokens
(a thought with its answer, a tool call, a broken call) and a request allows one of them alone:
the engine generates it, the detokenizer decodes it and the server parses it, as for a real model.
"""
import json

import pytest

from mini_engine import LLM, SamplingParams
from mini_engine.chat_template import ChatTemplate
from mini_engine.reasoning import THINK_END, THINK_START
from mini_engine.tokenizer import load_tokenizer
from tests.server.conftest import MODEL_NAME, NUM_KV_BLOCKS, launched_server, write_tiny_model

# Qwen3's template in brief: the tools in the system turn, each earlier call as a <tool_call> block
# of JSON, tool results as user turns, an earlier thought from reasoning_content, and
# enable_thinking=False as an empty thought in the prompt; think_in_prompt opens one there, as the
# Thinking-2507 templates do.
QWEN3_LIKE_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}{{ '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.reasoning_content %}{{ '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- endif %}{{ message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}"
    "{{ call.function.arguments | tojson }}{{ '}\\n</tool_call>' }}{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- elif think_in_prompt is defined and think_in_prompt %}{{ '<think>\\n' }}{%- endif %}{%- endif %}")
THOUGHT = "<think>\nIt is June.\n</think>\n\nSunny."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>\n'
BROKEN_CALL = "<tool_call>\n{oops}\n</tool_call>"
CUT_CALL = CALL[:-len("</tool_call>\n")]             # max_tokens ended the output before the call's end tag
CALL_ARGUMENTS = '{"city": "Paris", "unit": "°C"}'
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                   "required": ["city"]}}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
PARSERS = ("--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return write_tiny_model(str(tmp_path_factory.mktemp("tiny-qwen3-tools")), QWEN3_LIKE_TEMPLATE,
                            added_tokens=(THINK_START, THINK_END, THOUGHT, CALL, BROKEN_CALL, CUT_CALL))


@pytest.fixture(scope="module")
def token_id(model):
    tokenizer = load_tokenizer(model)
    return {text: tokenizer.token_to_id(text) for text in (THINK_END, THOUGHT, CALL, BROKEN_CALL, CUT_CALL)}


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    with launched_server(model, tmp_path_factory.mktemp("parser-server-log"), options=PARSERS) as handle:
        yield handle


@pytest.fixture
def client(server):
    with server.checked_client() as c:
        yield c


def chat(client, stream: bool, **kwargs):
    """(message fields, finish reason) of a one-choice chat, its streamed deltas put together as
    OpenAI's clients do: text appended, tool calls by index."""
    extra = {k: kwargs.pop(k) for k in ("allowed_token_ids", "chat_template_kwargs", "ignore_eos") if k in kwargs}
    kwargs = {"model": MODEL_NAME, "messages": MESSAGES, "temperature": 0, "extra_body": extra} | kwargs
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        message = choice.message
        calls = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]
        return ({"reasoning": getattr(message, "reasoning", None), "content": message.content, "tool_calls": calls},
                choice.finish_reason)
    reasoning, content, calls, reasons = [], [], {}, []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        reasons.append(choice.finish_reason)
        reasoning.append(getattr(choice.delta, "reasoning", None) or "")
        content.append(choice.delta.content or "")
        for call in choice.delta.tool_calls or []:
            old = calls.get(call.index, (None, "", ""))
            calls[call.index] = (call.id or old[0], old[1] + (call.function.name or ""),
                                 old[2] + (call.function.arguments or ""))
    assert all(r is None for r in reasons[:-1])
    return ({"reasoning": "".join(reasoning) or None, "content": "".join(content) or None,
             "tool_calls": [calls[k] for k in sorted(calls)]}, reasons[-1])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_calls_come_back_as_openais(client, token_id, stream):
    message, finish = chat(client, stream, tools=TOOLS, allowed_token_ids=[token_id[CALL]], max_tokens=2)
    assert finish == "tool_calls"
    assert message["reasoning"] is None and message["content"] is None
    assert [call[1:] for call in message["tool_calls"]] == [("get_weather", CALL_ARGUMENTS)] * 2
    ids = [call[0] for call in message["tool_calls"]]
    assert len(set(ids)) == 2 and all(i.startswith("chatcmpl-tool-") for i in ids)

    message, finish = chat(client, stream, tools=TOOLS, allowed_token_ids=[token_id[CALL]], max_tokens=2,
                           parallel_tool_calls=False)
    assert [call[1:] for call in message["tool_calls"]] == [("get_weather", CALL_ARGUMENTS)]

    # A call whose end tag max_tokens cut off is read when the output ends; finish_reason is
    # "tool_calls" then too, as vLLM's.
    message, finish = chat(client, stream, tools=TOOLS, allowed_token_ids=[token_id[CUT_CALL]], max_tokens=1)
    assert [call[1:] for call in message["tool_calls"]] == [("get_weather", CALL_ARGUMENTS)]
    assert message["content"] is None and finish == "tool_calls"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_reasoning_apart_from_content(client, token_id, stream):
    message, finish = chat(client, stream, allowed_token_ids=[token_id[THOUGHT]], max_tokens=1)
    assert message == {"reasoning": "\nIt is June.\n", "content": "\n\nSunny.", "tool_calls": []}
    assert finish == "length"
    # enable_thinking=False closes the thought in the prompt: what follows is all content.
    message, _ = chat(client, stream, allowed_token_ids=[token_id[THOUGHT]], max_tokens=1,
                      chat_template_kwargs={"enable_thinking": False})
    assert message == {"reasoning": None, "content": THOUGHT, "tool_calls": []}


def test_a_parsed_answer_has_the_role_it_continues(client, token_id):
    """vLLM's get_chat_request_role holds for an answer the output parsers read too: without a
    generation prompt the choice continues the final message, in its role."""
    whole = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0, max_tokens=1,
                                           extra_body={"allowed_token_ids": [token_id[THOUGHT]],
                                                       "add_generation_prompt": False})
    message = whole.choices[0].message
    assert (message.role, message.reasoning, message.content) == ("user", "\nIt is June.\n", "\n\nSunny.")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_thought_the_prompt_opened_is_reasoning(client, model, stream):
    """The model's own greedy text, with no tags: all of it reasoning, as LLM.generate writes it."""
    template = ChatTemplate.from_pretrained(model)
    prompt = template.render(MESSAGES, think_in_prompt=True)
    assert prompt.endswith("<think>\n")
    llm = LLM(model, num_kv_blocks=NUM_KV_BLOCKS)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = llm.generate([load_tokenizer(model).encode(prompt).ids], params, use_tqdm=False)[0].outputs[0].text
    message, finish = chat(client, stream, max_tokens=12, ignore_eos=True,
                           chat_template_kwargs={"think_in_prompt": True})
    assert expected.strip() and message == {"reasoning": expected, "content": None, "tool_calls": []}
    assert finish == "length"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_text_that_is_no_call_stays_content(client, token_id, stream):
    message, finish = chat(client, stream, tools=TOOLS, allowed_token_ids=[token_id[BROKEN_CALL]], max_tokens=1)
    assert message == {"reasoning": None, "content": BROKEN_CALL, "tool_calls": []} and finish == "length"
    # tool_choice "none": the tools are shown to the model, and its calls are left as text.
    message, finish = chat(client, stream, tools=TOOLS, tool_choice="none", allowed_token_ids=[token_id[CALL]],
                           max_tokens=1)
    assert message == {"reasoning": None, "content": CALL, "tool_calls": []} and finish == "length"


def test_the_template_gets_the_tools_and_earlier_calls(client, model):
    """The prompt's token count is that of the template given the tools, and an earlier call's
    arguments (a JSON string in OpenAI's messages) as an object, as vLLM gives them."""
    turns = MESSAGES + [
        {"role": "assistant", "content": "", "reasoning": "Ask the tool.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": CALL_ARGUMENTS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "20 °C"}]
    response = client.chat.completions.create(model=MODEL_NAME, messages=turns, tools=TOOLS, max_tokens=1)
    template, tokenizer = ChatTemplate.from_pretrained(model), load_tokenizer(model)
    rendered = [{**turns[0]}, {**turns[1], "reasoning_content": "Ask the tool.", "tool_calls": [
        {**turns[1]["tool_calls"][0], "function": {"name": "get_weather", "arguments": json.loads(CALL_ARGUMENTS)}}]},
        {**turns[2]}]
    prompt = template.render(rendered, tools=TOOLS)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}' in prompt
    assert "<think>\nAsk the tool.\n</think>" in prompt and '"description": "The weather in a city."' in prompt
    assert response.usage.prompt_tokens == len(tokenizer.encode(prompt).ids)
    assert response.usage.prompt_tokens > len(tokenizer.encode(template.render(rendered)).ids)
    # tool_choice "none" shows the model the same tools.
    none = client.chat.completions.create(model=MODEL_NAME, messages=turns, tools=TOOLS, tool_choice="none",
                                          max_tokens=1)
    assert none.usage.prompt_tokens == response.usage.prompt_tokens
    # As vLLM gives them: a function's unset fields as nulls, and keys of its own (OpenAI's strict).
    bare = [{"type": "function", "function": {"name": "now", "strict": True}}]
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=bare, max_tokens=1)
    shown = [{"type": "function", "function": {"name": "now", "description": None, "parameters": None, "strict": True}}]
    prompt = template.render(MESSAGES, tools=shown)
    assert '"description": null, "parameters": null, "strict": true' in prompt
    assert response.usage.prompt_tokens == len(tokenizer.encode(prompt).ids)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_each_completion_has_its_own_parser(client, token_id, stream):
    """n=2: each choice's text goes through a parser of its own (one allowed token, so sampling at
    temperature 1 writes the same output in both)."""
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, n=2, temperature=1, max_tokens=2, tools=TOOLS,
                  extra_body={"allowed_token_ids": [token_id[CALL]]})
    if not stream:
        choices = client.chat.completions.create(**kwargs).choices
        calls = {c.index: [(k, t.function.name, t.function.arguments) for k, t in enumerate(c.message.tool_calls)]
                 for c in choices}
        finishes = {c.index: c.finish_reason for c in choices}
    else:   # each choice's calls are numbered from 0 (a parser shared by both would count to 3)
        calls, finishes = {0: [], 1: []}, {}
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                calls[c.index] += [(t.index, t.function.name, t.function.arguments) for t in c.delta.tool_calls or []]
                finishes[c.index] = c.finish_reason or finishes.get(c.index)
    assert calls == {k: [(0, "get_weather", CALL_ARGUMENTS), (1, "get_weather", CALL_ARGUMENTS)] for k in (0, 1)}
    assert finishes == {0: "tool_calls", 1: "tool_calls"}


UNIT_TOOL = {"type": "function", "function": {"name": "set_unit", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["C", "F"]}}, "required": ["unit"],
    "additionalProperties": False}}}
NOW_TOOL = {"type": "function", "function": {"name": "now"}}       # no parameters: {} is its call's


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_named_tool_choice_calls_it(client, token_id, stream):
    """Structured outputs hold the output to the function's parameters: the output is its
    arguments, streamed as they come; finish_reason is the engine's, as OpenAI's for a named one.
    (enable_thinking=False: the prompt closes the thought, so the call comes first.)"""
    message, finish = chat(client, stream, tools=[UNIT_TOOL, NOW_TOOL], max_tokens=80,
                           tool_choice={"type": "function", "function": {"name": "set_unit"}},
                           chat_template_kwargs={"enable_thinking": False})
    assert finish == "stop" and message["content"] is None and message["reasoning"] is None
    (call_id, name, arguments), = message["tool_calls"]
    assert call_id.startswith("chatcmpl-tool-") and name == "set_unit" and json.loads(arguments)["unit"] in ("C", "F")
    # A template that opens the thought in the prompt: the model thinks freely (until the bias on
    # </think> ends the thought), and structured outputs hold what follows, as vLLM's with a
    # reasoning parser.
    thinking = dict(max_tokens=80, chat_template_kwargs={"think_in_prompt": True}, temperature=1, seed=3,
                    logit_bias={str(token_id[THINK_END]): 8})
    message, finish = chat(client, stream, tools=[UNIT_TOOL, NOW_TOOL],
                           tool_choice={"type": "function", "function": {"name": "set_unit"}}, **thinking)
    assert message["reasoning"] and THINK_END not in message["reasoning"] and finish == "stop"
    assert message["content"] is None and json.loads(message["tool_calls"][0][2])["unit"] in ("C", "F")
    message, finish = chat(client, stream, response_format={"type": "json_schema", "json_schema": {
        "name": "unit", "schema": UNIT_TOOL["function"]["parameters"]}}, **thinking)
    assert message["reasoning"] and json.loads(message["content"])["unit"] in ("C", "F") and finish == "stop"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_choice_required_calls_one_of_the_tools(client, stream):
    """vLLM's schema for "required": an array of {"name", "parameters"}, here of one call at most
    (parallel_tool_calls false)."""
    message, finish = chat(client, stream, tools=[UNIT_TOOL, NOW_TOOL], tool_choice="required", max_tokens=165,
                           parallel_tool_calls=False, chat_template_kwargs={"enable_thinking": False})
    assert finish == "tool_calls" and message["content"] is None
    (_, name, arguments), = message["tool_calls"]
    assert (name, json.loads(arguments)) in [("now", {}), ("set_unit", {"unit": "C"}), ("set_unit", {"unit": "F"})]
