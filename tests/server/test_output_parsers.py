"""The chat output parsers (Qwen3's reasoning, Hermes-style tool calls) on whole texts, and the same
parts whatever deltas the text streams in."""
import json
import random

import pytest

from mini_engine.server.output_parsers import ChatOutputParser, ParserOptions

GENERATION_PROMPT = "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
THINKING_PROMPT = GENERATION_PROMPT + "<think>\n"                    # Qwen3-Thinking-2507's templates
NOT_THINKING_PROMPT = GENERATION_PROMPT + "<think>\n\n</think>\n\n"  # Qwen3's, with enable_thinking=False
PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>'
LYON = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>'
PARIS_CALL = ("get_weather", '{"city": "Paris", "unit": "°C"}')
LYON_CALL = ("get_weather", '{"city": "Lyon"}')

# (prompt, output, reasoning parsed, tool calls parsed) -> (reasoning, content, calls)
CASES = {
    "thought then answer": (GENERATION_PROMPT, "<think>\nLet me see.\n</think>\n\nSunny.", True, False,
                            ("\nLet me see.\n", "\n\nSunny.", [])),
    "no thought": (GENERATION_PROMPT, "Sunny, 20 °C.", True, False, ("", "Sunny, 20 °C.", [])),
    "whitespace before the thought": (GENERATION_PROMPT, "\n <think>a</think>b", True, False, ("a", "b", [])),
    "a tag after text is text": (GENERATION_PROMPT, "Write <think> and </think>.", True, False,
                                 ("", "Write <think> and </think>.", [])),
    "the prompt opened the thought": (THINKING_PROMPT, "hmm</think>\n\nSunny.", True, False, ("hmm", "\n\nSunny.", [])),
    "the prompt opened the thought, and the model again": (THINKING_PROMPT, " <think>x</think>y", True, False,
                                                           ("x", "y", [])),
    "the prompt opened the thought, whitespace first": (THINKING_PROMPT, "\n x</think>y", True, False,
                                                        ("\n x", "y", [])),
    "an end tag alone is content": (GENERATION_PROMPT, "x</think>y", True, False, ("", "x</think>y", [])),
    "the prompt closed the thought": (NOT_THINKING_PROMPT, "<think>x</think>y", True, False,
                                      ("", "<think>x</think>y", [])),
    "a thought cut short": (GENERATION_PROMPT, "<think>still going </thi", True, False,
                            ("still going </thi", "", [])),
    "reasoning off": (GENERATION_PROMPT, "<think>a</think>b", False, False, ("", "<think>a</think>b", [])),
    "two calls after a thought": (GENERATION_PROMPT, f"<think>\nNeed both.\n</think>\n\n{PARIS}\n{LYON}", True, True,
                                  ("\nNeed both.\n", "", [PARIS_CALL, LYON_CALL])),
    "text before a call is vLLM's content": (GENERATION_PROMPT, f"Checking.\n\n{PARIS}\n", False, True,
                                             ("", "Checking.\n\n", [PARIS_CALL])),
    "text after a call stays": (GENERATION_PROMPT, f"{PARIS}\nThen Lyon:\n{LYON}", False, True,
                                ("", "\nThen Lyon:\n", [PARIS_CALL, LYON_CALL])),
    "a call that is not JSON stays text": (GENERATION_PROMPT, "Hm.\n<tool_call>\n{oops}\n</tool_call>", False, True,
                                           ("", "Hm.\n<tool_call>\n{oops}\n</tool_call>", [])),
    "a call without a name stays text": (GENERATION_PROMPT, ' <tool_call>{"arguments": {}}</tool_call>', False, True,
                                         ("", ' <tool_call>{"arguments": {}}</tool_call>', [])),
    "a call that is a list stays text": (GENERATION_PROMPT, "<tool_call>[1]</tool_call>", False, True,
                                         ("", "<tool_call>[1]</tool_call>", [])),
    "string arguments become a JSON string": (GENERATION_PROMPT,
                                              '<tool_call>{"name": "f", "arguments": "hi"}</tool_call>', False, True,
                                              ("", "", [("f", '"hi"')])),
    "NaN is not JSON": (GENERATION_PROMPT, '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', False,
                        True, ("", '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', [])),
    "no arguments are {}": (GENERATION_PROMPT, '<tool_call>{"name": "now"}</tool_call>', False, True,
                            ("", "", [("now", "{}")])),
    "an unclosed call at the end": (GENERATION_PROMPT, PARIS[:-len("</tool_call>")], False, True,
                                    ("", "", [PARIS_CALL])),
    "an unclosed call that is not JSON": (GENERATION_PROMPT, '<tool_call>\n{"name": "get_w', False, True,
                                          ("", '<tool_call>\n{"name": "get_w', [])),
    "a tag in a sentence": (GENERATION_PROMPT, "<tool_call> tags are how I call tools.", False, True,
                            ("", "<tool_call> tags are how I call tools.", [])),
    "whitespace alone is content": (GENERATION_PROMPT, "\n\n", False, True, ("", "\n\n", [])),
    "calls are not looked for in the thought": (GENERATION_PROMPT, f"<think>{PARIS}</think>ok", True, True,
                                                (PARIS, "ok", [])),
    "tool calls off": (GENERATION_PROMPT, PARIS, True, False, ("", PARIS, [])),
}


def parse(prompt: str, pieces: list[str], reasoning: bool, tool_calls: bool, parallel: bool = True):
    parser = ChatOutputParser(prompt, reasoning, tool_calls, parallel)
    parts = [parser.feed(piece, final=k == len(pieces) - 1) for k, piece in enumerate(pieces)]
    calls = [call for part in parts for call in part.tool_calls]
    assert [call.index for call in calls] == list(range(len(calls)))
    for call in calls:
        json.loads(call.arguments)
    return ("".join(p.reasoning for p in parts), "".join(p.content for p in parts),
            [(call.name, call.arguments) for call in calls])


def random_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("name", list(CASES))
def test_whole_text(name):
    prompt, text, reasoning, tool_calls, expected = CASES[name]
    assert parse(prompt, [text], reasoning, tool_calls) == expected


@pytest.mark.parametrize("name", list(CASES))
def test_any_deltas_give_the_whole_texts_parts(name):
    prompt, text, reasoning, tool_calls, expected = CASES[name]
    assert parse(prompt, list(text), reasoning, tool_calls) == expected, "a character a delta"
    for cut in range(1, len(text)):
        assert parse(prompt, [text[:cut], text[cut:]], reasoning, tool_calls) == expected, cut
    rng = random.Random(name)
    for _ in range(30):
        pieces = random_pieces(text, rng)
        assert parse(prompt, pieces, reasoning, tool_calls) == expected, pieces
    # A stream that ends with an empty delta (the engine's last one carries only the finish reason).
    assert parse(prompt, [text, ""], reasoning, tool_calls) == expected


def test_text_that_may_begin_a_tag_is_held_until_the_next_delta():
    parser = ChatOutputParser(GENERATION_PROMPT, True, True)
    assert parser.feed("<thi").reasoning == parser.feed("").content == ""
    assert parser.feed("nk>Let</th").reasoning == "Let"
    part = parser.feed("ink>Hi <tool")
    assert (part.reasoning, part.content) == ("", "Hi ")
    part = parser.feed("_call>")
    assert (part.content, part.tool_calls) == ("", [])
    part = parser.feed('{"name": "f"}</tool_call>')
    assert [call.name for call in part.tool_calls] == ["f"] and parser.called_tools


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = f"{PARIS}\n{LYON}"
    assert parse(GENERATION_PROMPT, [text], False, True, parallel=False) == ("", "", [PARIS_CALL])
    assert parse(GENERATION_PROMPT, list(text), False, True, parallel=False) == ("", "", [PARIS_CALL])


def test_each_call_has_its_own_id():
    parser = ChatOutputParser(GENERATION_PROMPT, False, True)
    calls = parser.feed(f"{PARIS}{LYON}", final=True).tool_calls
    assert len({call.id for call in calls}) == 2 and all(call.id.startswith("chatcmpl-tool-") for call in calls)
    assert calls[1].to_json(streamed=True) == {"index": 1, "id": calls[1].id, "type": "function",
                                               "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}


def test_parser_options_are_checked():
    with pytest.raises(ValueError, match="reasoning_parser"):
        ParserOptions(reasoning_parser="deepseek_r1")
    with pytest.raises(ValueError, match="tool_call_parser"):
        ParserOptions(tool_call_parser="mistral")
    with pytest.raises(ValueError, match="needs a tool_call_parser"):
        ParserOptions(enable_auto_tool_choice=True)
    assert ParserOptions("qwen3", "hermes", True).auto_tool_choice
    assert not ParserOptions(tool_call_parser="hermes").auto_tool_choice


def test_a_named_tool_streams_its_arguments_as_one_call():
    """tool_choice naming a function: the content is its arguments; the first delta opens the
    call (id, name), the rest only add arguments, whatever the deltas."""
    arguments = '{"city": "Paris", "unit": "°C"}'
    rng = random.Random(0)
    for pieces in [[arguments], list(arguments), *(random_pieces(arguments, rng) for _ in range(20))]:
        parser = ChatOutputParser(GENERATION_PROMPT, True, False, forced_tool="get_weather")
        deltas = [call.to_json(streamed=True) for k, piece in enumerate(pieces)
                  for call in parser.feed(piece, final=k == len(pieces) - 1).tool_calls]
        assert deltas[0]["function"]["name"] == "get_weather" and deltas[0]["id"].startswith("chatcmpl-tool-")
        assert all(d.keys() == {"index", "function"} and d["function"].keys() == {"arguments"} for d in deltas[1:])
        assert "".join(d["function"]["arguments"] for d in deltas) == arguments
        assert {d["index"] for d in deltas} == {0} and parser.finish_reason("stop") == "stop"


def test_tool_choice_required_reads_the_array_at_the_end():
    text = '[{"name": "get_weather", "parameters": {"city": "Lyon"}}, {"name": "now", "parameters": {}}]'
    parser = ChatOutputParser(GENERATION_PROMPT, False, False, forced_tool="")
    assert parser.feed(text[:30]).tool_calls == [] and parser.feed(text[30:]).tool_calls == []
    part = parser.feed("", final=True)
    assert [(c.index, c.name, c.arguments) for c in part.tool_calls] == [(0, "get_weather", '{"city": "Lyon"}'),
                                                                          (1, "now", "{}")]
    assert part.content == "" and parser.finish_reason("stop") == "tool_calls"
    cut = ChatOutputParser(GENERATION_PROMPT, False, False, forced_tool="")
    part = cut.feed(text[:40], final=True)
    assert (part.content, part.tool_calls) == (text[:40], []) and cut.finish_reason("length") == "length"
