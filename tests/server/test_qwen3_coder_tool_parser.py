"""Qwen3-Coder's XML-style tool calls (--tool-call-parser qwen3_coder), against vLLM's semantics:
each value typed by the request's tool schema, one newline stripped on each side, the name sent
once its tag is whole and the arguments as pieces of the JSON object; the same parts whatever
deltas the text streams in (whole, a character at a time, token-like pieces, every split in two).
Then a server started with the parser, whose tiny tokenizer holds a whole call as one token that
logit_bias makes the random model write (as test_reasoning_and_tool_calls.py does for hermes)."""
import json
import random
import re

import pytest

from mini_engine.reasoning import THINK_END, THINK_START
from mini_engine.server.output_parsers import ChatOutputParser, ParsedText, ParserOptions
from mini_engine.server.qwen3_coder_tool_parser import Qwen3CoderToolParser, convert_value
from mini_engine.server.responses_output import ResponseOutput
from tests.server.conftest import MODEL_NAME, forcing_bias, launched_server, write_tiny_model
from tests.server.test_reasoning_and_tool_calls import UNIT_TOOL


def tool(name: str, **properties) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {key: {"type": kind} for key, kind in properties.items()}}}}


TOOLS = [tool("get_weather", city="string", state="string", days="integer"),
         tool("calculate_area", shape="string", dimensions="object", precision="integer", scale="number",
              exact="boolean", sides="array", note="string"),
         {"type": "function", "function": {"name": "now"}}]


def call(name: str, *parameters: tuple[str, str]) -> str:
    """A call as Qwen3-Coder's chat template writes one."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


DALLAS = call("get_weather", ("city", "Dallas"), ("state", "TX"))
DALLAS_ARGS = '{"city": "Dallas", "state": "TX"}'
ORLANDO = call("get_weather", ("city", "Orlando"), ("days", "3"))
ORLANDO_ARGS = '{"city": "Orlando", "days": 3}'
CODE = "def area(r):\n    return 3.14 * r * r\n"      # its own last newline stays: one is the template's

# output -> (content, [(name, arguments)]), as vLLM's parser reads them (differences: see the cases'
# names and the parser's docstring).
CASES = {
    "no call": ("This is a test without tools", ("This is a test without tools", [])),
    "one call": (DALLAS, ("", [("get_weather", DALLAS_ARGS)])),
    "content before a call": ("Sure! Let me check the weather for you." + DALLAS,
                              ("Sure! Let me check the weather for you.", [("get_weather", DALLAS_ARGS)])),
    "two calls, whitespace between and after them dropped": (
        f"Both.\n\n{DALLAS}\n{ORLANDO}\n", ("Both.\n\n", [("get_weather", DALLAS_ARGS), ("get_weather", ORLANDO_ARGS)])),
    "content after a call (streamed vLLM's; its whole-text parser drops it)": (
        f"{DALLAS}\nThat is all.", ("\nThat is all.", [("get_weather", DALLAS_ARGS)])),
    "typed by the schema": (
        call("calculate_area", ("shape", "rectangle"), ("dimensions", '{"width": 10, \n "square": false}'),
             ("precision", "2"), ("scale", "2.50"), ("exact", "True"), ("sides", "[1, null]"), ("note", "42")),
        ("", [("calculate_area", '{"shape": "rectangle", "dimensions": {"width": 10, "square": false}, '
                                 '"precision": 2, "scale": 2.5, "exact": true, "sides": [1, null], "note": "42"}')])),
    "a whole number is an integer, Python's literals read": (
        call("calculate_area", ("scale", "3.0"), ("dimensions", "{'r': None, 'ok': False}"), ("sides", "(1, 2)")),
        ("", [("calculate_area", '{"scale": 3, "dimensions": {"r": null, "ok": false}, "sides": [1, 2]}')])),
    "a value not of its type stays a string": (
        call("calculate_area", ("precision", "two"), ("scale", "wide"), ("dimensions", "{not json"),
             ("sides", "[1, 2"), ("exact", "yes")),
        ("", [("calculate_area", '{"precision": "two", "scale": "wide", "dimensions": "{not json", '
                                 '"sides": "[1, 2", "exact": false}')])),    # a boolean that is not one: false
    "null is null, except for a string": (
        call("get_weather", ("days", "null"), ("city", "null")), ("", [("get_weather", '{"days": null, "city": "null"}')])),
    "a string keeps its inner newlines": (
        call("calculate_area", ("note", CODE), ("shape", "\n\ncircle\n\n")),
        ("", [("calculate_area", json.dumps({"note": CODE, "shape": "\n\ncircle\n\n"}))])),
    "a parameter the tool lacks, or a tool the request lacks, stays text": (
        call("get_weather", ("extra", "42")) + call("launch", ("count", "3")),
        ("", [("get_weather", '{"extra": "42"}'), ("launch", '{"count": "3"}')])),
    "no parameters": (call("now"), ("", [("now", "{}")])),
    "no </function> at the end: read as closed": (
        DALLAS[:-len("</function>\n</tool_call>")], ("", [("get_weather", DALLAS_ARGS)])),
    "cut in a value": (DALLAS[:DALLAS.index("TX") + 1], ("", [("get_weather", '{"city": "Dallas", "state": "T"}')])),
    "cut in a parameter's name: the parameter dropped": (
        DALLAS[:DALLAS.index("=state") + 3], ("", [("get_weather", '{"city": "Dallas"}')])),
    "cut in the end tag": (DALLAS[:-3], ("", [("get_weather", DALLAS_ARGS)])),
    "no </parameter>: the next tag ends the value": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nLyon\n<parameter=days>\n2\n</function></tool_call>",
        ("", [("get_weather", '{"city": "Lyon", "days": 2}')])),
    "no <tool_call>: a bare function is a call (vLLM's whole-text parser)": (
        "<function=get_weather>\n<parameter=city>\nDallas\n</parameter>\n</function>",
        ("", [("get_weather", '{"city": "Dallas"}')])),
    "a <tool_call> without a function stays content": (
        'Hm.\n<tool_call>\n{"name": "get_weather"}\n</tool_call>',
        ('Hm.\n<tool_call>\n{"name": "get_weather"}\n</tool_call>', [])),
    "a name that is a template's text stays content": (
        "<tool_call>\n<function={{ name }}>\n</function>\n</tool_call>",
        ("<tool_call>\n<function={{ name }}>\n</function>\n</tool_call>", [])),
    "cut in the function's name: content": ("Hm. <tool_call>\n<function=get_wea", ("Hm. <tool_call>\n<function=get_wea", [])),
    "a tag begun at the end is content": ("See <tool_", ("See <tool_", [])),
    "whitespace alone is content": ("\n\n", ("\n\n", [])),
    "whitespace before a call is dropped, not text after it (vLLM keeps the whitespace)": (
        f"\n{DALLAS}Done.", ("Done.", [("get_weather", DALLAS_ARGS)])),
    "text where </tool_call> should be ends the call (vLLM's drops the text)": (
        "<tool_call>\n<function=now>\n</function>\nDone.", ("Done.", [("now", "{}")])),
    "an unclosed <tool_call> without a function stays content": ("Hm. <tool_call>\nnothing",
                                                                 ("Hm. <tool_call>\nnothing", [])),
    "a number JSON cannot hold stays text (vLLM's whole-text parser fails on inf)": (
        call("calculate_area", ("scale", "inf"), ("precision", "nan")),
        ("", [("calculate_area", '{"scale": "inf", "precision": "nan"}')])),
}


def streamed(text: str, deltas: list[str], parallel: bool = True, tools=TOOLS) -> tuple[str, list[tuple[str, str]]]:
    """The parser fed these deltas (the last one final): content joined, calls put together by
    index as OpenAI's clients do, after checking each call's first piece names it and the later
    pieces go on with it."""
    assert "".join(deltas) == text
    parser = Qwen3CoderToolParser(tools, parallel)
    content, calls, ids = [], {}, set()
    for k, delta in enumerate(deltas):
        part, pieces = parser.feed(delta, final=k == len(deltas) - 1)
        content.append(part)
        assert len({piece.index for piece in pieces}) == len(pieces)       # one piece a call a delta
        for piece in pieces:
            assert piece.continued == (piece.index in calls)
            if not piece.continued:
                assert piece.index == len(calls) and piece.arguments.startswith("{") and piece.id not in ids
                ids.add(piece.id)
                calls[piece.index] = (piece.name, "")
            calls[piece.index] = (calls[piece.index][0], calls[piece.index][1] + piece.arguments)
    assert parser.num_calls >= len(calls)
    return "".join(content), [calls[k] for k in sorted(calls)]


def splits(text: str) -> dict[str, list[str]]:
    """Ways the text may stream: whole, a character at a time, token-like pieces (tags cut where a
    tokenizer might cut them), and random cuts; then an empty final delta after it whole."""
    rng = random.Random(len(text))
    cuts = [sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 12))) for _ in range(3)] if len(text) > 1 else []
    ways = {"whole": [text], "by character": list(text), "then an empty final delta": [text, ""],
            "token-like": re.findall(r"</?|[a-z_]+|=|>|\n|[^<a-z_=>\n]+", text)}
    for k, points in enumerate(cuts):
        ways[f"random {k}"] = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    return ways


@pytest.mark.parametrize("name", CASES)
def test_whole_and_streamed_text_parse_as_vllm_reads_it(name):
    text, expected = CASES[name]
    for way, deltas in splits(text).items():
        assert streamed(text, deltas) == expected, way
    for at in range(len(text) + 1):     # every split in two
        assert streamed(text, [text[:at], text[at:]]) == expected, at


def test_arguments_stream_as_vllms_pieces():
    """The name (with "{") once its tag is whole, each parameter once its value has ended, "}" at
    </function>; nothing of the call is content."""
    parser = Qwen3CoderToolParser(TOOLS)
    sent = []
    for k, char in enumerate("Hi " + DALLAS):
        content, pieces = parser.feed(char)
        assert "<" not in content
        sent += [(k, piece.name if not piece.continued else None, piece.arguments) for piece in pieces]
    at = ("Hi " + DALLAS).index
    assert sent == [(at("\n<parameter=city>") - 1, "get_weather", "{"), (at("</parameter>\n<parameter=state>") + 11,
                                                                   None, '"city": "Dallas"'),
                    (at("</parameter>\n</function>") + 11, None, ', "state": "TX"'),
                    (at("</function>") + 10, None, "}")]
    assert parser.feed("", final=True) == ("", [])


def test_parallel_tool_calls_false_keeps_the_first():
    text = f"{DALLAS}\n{ORLANDO}"
    for deltas in splits(text).values():
        assert streamed(text, deltas, parallel=False) == ("", [("get_weather", DALLAS_ARGS)])


def test_without_tools_every_value_is_a_string():
    assert streamed(ORLANDO, [ORLANDO], tools=None) == ("", [("get_weather", '{"city": "Orlando", "days": "3"}')])


@pytest.mark.parametrize("schema, text, value", [
    ({"anyOf": [{"type": "string"}, {"type": "null"}]}, "None", None),       # vLLM's nullable
    ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, "7", 7),
    ({"type": ["integer", "null"]}, "7", 7),
    ({"type": ["string", "null"]}, "7", "7"),           # vLLM's reads the list as one type's name: 7
    ({"enum": ["C", "F"]}, "C", "C"),                   # no type: a string
    ({"type": "int64"}, "-3", -3), ({"type": "float"}, "1e3", 1000), ({"type": "dict"}, '"{\'a\': 1}"', {"a": 1}),
    ({"type": "object"}, "{1, 2}", "{1, 2}"),           # a set is no JSON
    ({"type": "any"}, "[1, 2]", [1, 2]), ({"type": "any"}, "x", "x"),      # other types: a Python literal, or text
    ({"type": "boolean"}, "FALSE", False),
])
def test_values_take_their_schemas_type(schema, text, value):
    assert convert_value(text, schema) == value and type(convert_value(text, schema)) is type(value)


def test_the_server_option_and_the_chat_parser_select_it():
    assert ParserOptions(tool_call_parser="qwen3_coder", enable_auto_tool_choice=True).auto_tool_choice
    prompt = "<|im_start|>assistant\n"
    parser = ChatOutputParser(prompt, True, True, tool_call_parser="qwen3_coder", tools=TOOLS)
    parsed = parser.feed(f"{THINK_START}\nAsk.\n{THINK_END}\n\n{ORLANDO}", final=True)
    assert (parsed.reasoning, parsed.content) == ("\nAsk.\n", "")
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("get_weather", ORLANDO_ARGS)]
    assert parser.finish_reason("stop") == "tool_calls"
    hermes = ChatOutputParser(prompt, False, True, tools=TOOLS).feed(ORLANDO, final=True)
    assert hermes.content == ORLANDO and not hermes.tool_calls


def test_a_delta_with_a_calls_end_and_text_keeps_the_responses_items_in_order():
    """Text after a call's last piece in the same delta goes out with the next delta, so that the
    Responses API (which writes a delta's text before its calls) keeps the call in one item."""
    parser, output = Qwen3CoderToolParser(TOOLS), ResponseOutput()
    cut = DALLAS.index("</parameter>\n</function>")
    for delta, final in [(DALLAS[:cut], False), (DALLAS[cut:] + "\nDone.", False), ("", True)]:
        content, calls = parser.feed(delta, final)
        output.feed(ParsedText(content=content, tool_calls=calls))
    output.finish("completed")
    assert [(item["type"], item.get("arguments")) for item in output.items] == [("function_call", DALLAS_ARGS),
                                                                                ("message", None)]
    assert output.items[1]["content"][0]["text"] == "\nDone."


# ---- a server started with the parser ----

# Qwen3-Coder's template in brief: the tools in the system turn, then ChatML.
QWEN3_CODER_LIKE_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}{{ '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{{ '<|im_start|>' + message.role + '\\n' + (message.content or '') + "
    "'<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
SERVED_CALL = call("get_weather", ("city", "Paris"), ("days", "3"))
SERVED_ARGS = '{"city": "Paris", "days": 3}'           # days an integer: the request's tools reached the parser
TEXT_THEN_CALL = "Checking.\n\n" + SERVED_CALL
CUT_CALL = SERVED_CALL[:-len("\n</function>\n</tool_call>")]
OPTIONS = ("--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return write_tiny_model(str(tmp_path_factory.mktemp("tiny-qwen3-coder")), QWEN3_CODER_LIKE_TEMPLATE,
                            added_tokens=(SERVED_CALL, TEXT_THEN_CALL, CUT_CALL))


@pytest.fixture(scope="module")
def bias(model) -> dict:
    """logit_bias that makes the model write one of the whole outputs."""
    return forcing_bias(model, (SERVED_CALL, TEXT_THEN_CALL, CUT_CALL))


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    with launched_server(model, tmp_path_factory.mktemp("qwen3-coder-server-log"), options=OPTIONS) as handle:
        yield handle


@pytest.fixture
def client(server):
    with server.checked_client() as c:
        yield c


def chat(client, stream: bool, **kwargs) -> tuple[str | None, list[tuple[str, str, str]], str]:
    """(content, calls, finish reason) of a one-choice chat, a stream's deltas put together as
    OpenAI's clients do."""
    kwargs = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Weather in Paris?"}],
              "tools": [TOOLS[0]], "temperature": 0} | kwargs
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, reasons = [], {}, []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        reasons.append(choice.finish_reason)
        content.append(choice.delta.content or "")
        for piece in choice.delta.tool_calls or []:
            old = calls.get(piece.index, (None, "", ""))
            calls[piece.index] = (piece.id or old[0], old[1] + (piece.function.name or ""),
                                  old[2] + (piece.function.arguments or ""))
    assert all(reason is None for reason in reasons[:-1])
    return "".join(content) or None, [calls[k] for k in sorted(calls)], reasons[-1]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_served_qwen3_coder_call_is_openais(client, bias, stream):
    content, calls, finish = chat(client, stream, logit_bias=bias[SERVED_CALL], max_tokens=2)
    assert content is None and finish == "tool_calls"
    assert [c[1:] for c in calls] == [("get_weather", SERVED_ARGS)] * 2
    assert len({c[0] for c in calls}) == 2 and all(c[0].startswith("chatcmpl-tool-") for c in calls)

    _, calls, _ = chat(client, stream, logit_bias=bias[SERVED_CALL], max_tokens=2, parallel_tool_calls=False)
    assert [c[1:] for c in calls] == [("get_weather", SERVED_ARGS)]
    content, calls, finish = chat(client, stream, logit_bias=bias[TEXT_THEN_CALL], max_tokens=1)
    assert content == "Checking.\n\n" and [c[1:] for c in calls] == [("get_weather", SERVED_ARGS)]
    # max_tokens cut the call before its end tags: read as closed, as vLLM reads it.
    content, calls, finish = chat(client, stream, logit_bias=bias[CUT_CALL], max_tokens=1)
    assert content is None and [c[1:] for c in calls] == [("get_weather", SERVED_ARGS)] and finish == "tool_calls"
    # tool_choice "none": the call stays text.
    content, calls, finish = chat(client, stream, logit_bias=bias[SERVED_CALL], max_tokens=1, tool_choice="none")
    assert (content, calls, finish) == (SERVED_CALL, [], "length")


def test_a_served_call_is_a_responses_function_call(client, bias):
    weather = {"type": "function", **TOOLS[0]["function"]}
    response = client.responses.create(model=MODEL_NAME, input="Weather in Paris?", tools=[weather],
                                       max_output_tokens=1, extra_body={"logit_bias": bias[TEXT_THEN_CALL]})
    assert [(item.type, getattr(item, "arguments", None)) for item in response.output] == [
        ("message", None), ("function_call", SERVED_ARGS)]
    assert response.output_text == "Checking.\n\n" and response.output[1].name == "get_weather"


def test_a_forced_tool_choice_is_json_whatever_the_parser(client):
    """A named function or "required": structured outputs hold the output to JSON calls, which
    ForcedToolCallParser reads (not Qwen3-Coder's XML), as with hermes."""
    _, calls, finish = chat(client, False, tools=[UNIT_TOOL], max_tokens=80,
                            tool_choice={"type": "function", "function": {"name": "set_unit"}})
    (_, name, arguments), = calls
    assert name == "set_unit" and json.loads(arguments)["unit"] in ("C", "F") and finish == "stop"
    _, calls, finish = chat(client, False, tools=[UNIT_TOOL], max_tokens=165, tool_choice="required",
                            parallel_tool_calls=False)
    (_, name, arguments), = calls
    assert name == "set_unit" and json.loads(arguments)["unit"] in ("C", "F") and finish == "tool_calls"
