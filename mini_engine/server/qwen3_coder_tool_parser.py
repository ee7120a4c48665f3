"""Qwen3-Coder's tool calls (vLLM's `--tool-call-parser qwen3_coder`). Its chat template asks for
XML-style calls, each parameter's value as raw text:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A value becomes the JSON type that the request's tool schema gives its parameter (convert_value),
less one newline on each side (the template's). As vLLM streams them, a call's name goes out once
its <function=NAME> tag is whole, with "{"; then each parameter, once its value has ended, as a
piece of the JSON object (`"city": "Paris"`, then `, "unit": ...`), and "}" at </function>.

The text is read as it streams, one delta at a time, with the same parts whatever the deltas'
boundaries: nothing is consumed until it is whole, and text that may begin a tag is held back
until the next delta says (`final` flushes it). Text around the calls is content, except where it
is only whitespace before, between or after calls; a block that turns out to be no call (no
<function= before its </tool_call>, a name that is not a name, or an unclosed one at the end) is
content as written. A call that the output's end cuts short is read as if closed, as vLLM reads it.

Where vLLM differs: its whole-text parser drops the text after the first call and keeps
whitespace before it, and fails the whole output on a number it cannot hold ("inf"); it finds a
value's end past a literal </parameter> inside code by looking ahead, where here the first end
tag ends it; its streamed parser leaves a bare <function= (no <tool_call>) as content.
"""
import ast
import json
import math

from mini_engine.server.output_parsers import ToolCall, partial_tag_length

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
FUNCTION_START, FUNCTION_END = "<function=", "</function>"
PARAMETER_START, PARAMETER_END = "<parameter=", "</parameter>"
VALUE_ENDS = (PARAMETER_END, PARAMETER_START, FUNCTION_END, TOOL_CALL_END)      # the first of them ends a value
NOT_IN_NAME = set("{}<>\"' \t\n\r")     # vLLM's: a <function={{ tc.name }}> is a template's text, not a call

# vLLM's type names (a schema's "type", lower-cased) and prefixes.
STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
INTEGER_PREFIXES = ("int", "uint", "long", "short", "unsigned")
NUMBER_PREFIXES = ("num", "float")
BOOLEAN_TYPES = ("boolean", "bool", "binary")
CONTAINER_TYPES = ("object", "array", "arr")
CONTAINER_PREFIXES = ("dict", "list")


def schema_type(schema) -> tuple[str, bool]:
    """(a parameter's type, lower-cased; whether it may be null), as vLLM reads them: "type", or the
    first non-null type of an "anyOf" (and of a "type" list, which vLLM reads as one odd name);
    anything else is a string."""
    if not isinstance(schema, dict):
        return "string", False
    if "type" in schema and isinstance(schema["type"], list):
        options = [{"type": t} for t in schema["type"]]
    elif "type" in schema:
        kind = str(schema["type"]).strip().lower()
        return kind, kind == "null"
    else:
        options = schema.get("anyOf") if isinstance(schema.get("anyOf"), list) else []
    kinds = [str(option["type"]).strip().lower() for option in options if isinstance(option, dict) and "type" in option]
    others = [kind for kind in kinds if kind != "null"]
    return (others[0] if others else "string"), "null" in kinds


def is_json(value) -> bool:
    """A Python literal may be a set, bytes or NaN, which a call's JSON arguments cannot hold."""
    try:
        json.dumps(value, allow_nan=False)
        return True
    except (TypeError, ValueError):
        return False


def literal(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return text


def convert_value(text: str, schema) -> object:
    """A parameter's raw text as the type its schema (None: not one of the tool's parameters) says,
    as vLLM converts it; text that is not of that type stays a string (a boolean that is neither
    true nor false is false, as in vLLM)."""
    if schema is None:
        return text
    kind, nullable = schema_type(schema)
    if text.lower() in ("null", "none") and (nullable or kind not in STRING_TYPES):
        return None
    if kind in STRING_TYPES:
        return text
    if kind.startswith(INTEGER_PREFIXES):
        try:
            return int(text)
        except ValueError:
            return text
    if kind.startswith(NUMBER_PREFIXES):
        try:
            number = float(text)
        except ValueError:
            return text
        if not math.isfinite(number):      # JSON has no NaN or Infinity
            return text
        return int(number) if number.is_integer() else number
    if kind in BOOLEAN_TYPES:
        return text.lower() == "true"
    container = kind in CONTAINER_TYPES or kind.startswith(CONTAINER_PREFIXES)
    value = text
    if container:
        try:
            value = json.loads(text)
        except ValueError:
            pass
    if value is text:
        value = literal(text)           # Python's literals too: {'a': True}, as vLLM reads them
    if container and isinstance(value, str):
        value = literal(value)          # a dict written as a string of its repr, as some templates teach
    return value if is_json(value) else text


def tool_properties(tools: list[dict] | None) -> dict[str, dict]:
    """Each tool's parameters' schemas by the tool's name (the first tool of a name, as vLLM's)."""
    properties = {}
    for tool in tools or []:
        function = tool.get("function") or {}
        if isinstance(function.get("name"), str) and function["name"] not in properties:
            schemas = (function.get("parameters") or {}).get("properties")
            properties[function["name"]] = schemas if isinstance(schemas, dict) else {}
    return properties


def earliest(text: str, tags: tuple[str, ...], start: int = 0) -> tuple[int, str | None]:
    """Where the first of tags begins in text (from start), and which: (-1, None) where none does."""
    found = [(at, tag) for tag in tags if (at := text.find(tag, start)) >= 0]
    return min(found) if found else (-1, None)


def held_length(text: str, tags: tuple[str, ...]) -> int:
    return max(partial_tag_length(text, tag) for tag in tags)


class Qwen3CoderToolParser:
    """One completion's content through Qwen3-Coder's calls: feed(text, final) -> (content, calls),
    as ToolCallParser's. tools: the request's (OpenAI's JSON), whose schemas type the arguments;
    parallel False: calls after the first are read and dropped (parallel_tool_calls)."""

    def __init__(self, tools: list[dict] | None, parallel: bool = True):
        self.properties = tool_properties(tools)
        self.parallel = parallel
        self.text = ""              # what is not consumed yet
        self.state = "text"         # text, opening, body, value, after_function
        self.wrapped = False        # the open call began with <tool_call> (not a bare <function=)
        self.function = ""          # the open call's name
        self.parameter = ""         # the open value's parameter
        self.num_parameters = 0     # of the open call, so far
        self.scanned = 0            # how much of an open value holds none of VALUE_ENDS
        self.num_calls = 0
        self.blank = ""             # the text since the last call, held while it is only whitespace
        self.in_text = False        # that text has more than whitespace: it goes out as it comes
        self.deferred = ""          # content that followed a call's piece in a delta: sent with the next
        self.content: list[str] = []
        self.calls: dict[int, ToolCall] = {}    # this delta's pieces, one ToolCall a call

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        self.text += text
        self.content, self.calls = [self.deferred], {}
        self.deferred = ""
        step = {"text": self.read_text, "opening": self.read_opening, "body": self.read_body,
                "value": self.read_value, "after_function": self.read_after_function}
        while step[self.state](final):
            pass
        if final:
            # The end: no next delta to wait for; whitespace alone is content, unless it separated calls.
            self.content += [self.deferred, "" if self.num_calls else self.blank]
            self.text = self.deferred = self.blank = ""
        return "".join(self.content), list(self.calls.values())

    # ---- what goes out ----

    def say(self, text: str) -> None:
        """Content. After a call's piece in the same delta it waits for the next delta, so that a
        delta's content never follows its calls (the Responses API writes a delta's text first)."""
        if not text:
            return
        if not self.in_text:
            self.blank += text
            if not self.blank.strip():
                return
            text, self.blank, self.in_text = self.blank, "", True
        if self.calls:
            self.deferred += text
        else:
            self.content.append(text)

    def piece(self, arguments: str, name: str = "") -> None:
        """More of the open call: its name and "{" (a new call), or its arguments' next piece."""
        index = self.num_calls - 1
        if index > 0 and not self.parallel:
            return
        if name:
            self.calls[index] = ToolCall(index, name, arguments)
        elif index in self.calls:
            self.calls[index].arguments += arguments
        else:
            self.calls[index] = ToolCall(index, self.function, arguments, continued=True)

    def end_value(self, text: str) -> None:
        value = text[1:] if text.startswith("\n") else text
        value = value[:-1] if value.endswith("\n") else value
        schemas = self.properties.get(self.function, {})
        converted = convert_value(value, schemas.get(self.parameter) if self.parameter in schemas else None)
        separator = ", " if self.num_parameters else ""
        self.num_parameters += 1
        self.piece(f"{separator}{json.dumps(self.parameter, ensure_ascii=False)}: "
                   f"{json.dumps(converted, ensure_ascii=False)}")

    def end_call(self, state: str) -> None:
        self.piece("}")
        self.state = state

    # ---- the states: each reads self.text, True where it moved on (then the next state reads) ----

    def read_text(self, final: bool) -> bool:
        at, _ = earliest(self.text, (TOOL_CALL_START, FUNCTION_START))
        if at < 0:
            keep = 0 if final else held_length(self.text, (TOOL_CALL_START, FUNCTION_START))
            self.say(self.text[:len(self.text) - keep])
            self.text = self.text[len(self.text) - keep:]
            return False
        self.say(self.text[:at])
        self.text, self.state = self.text[at:], "opening"
        return True

    def read_opening(self, final: bool) -> bool:
        """From <tool_call> (or a bare <function=, which vLLM's non-streamed parser also reads as a
        call) to its function's name: a call, or text."""
        self.wrapped = self.text.startswith(TOOL_CALL_START)
        at, tag = earliest(self.text, (FUNCTION_START, TOOL_CALL_END), len(TOOL_CALL_START) if self.wrapped else 0)
        if tag == TOOL_CALL_END:                # no function in it: text, its end tag too
            return self.not_a_call(at + len(TOOL_CALL_END))
        if tag is None:
            return self.not_a_call(len(self.text)) if final else False
        start = at + len(FUNCTION_START)
        end = self.text.find(">", start)
        name = self.text[start:end if end >= 0 else len(self.text)]
        bad = next((start + k for k, c in enumerate(name) if c in NOT_IN_NAME), None)
        if bad is not None or end == start:     # text after all, up to the character that says so
            return self.not_a_call(start if bad is None else bad)
        if end < 0:                             # the name goes on in the next delta
            return self.not_a_call(len(self.text)) if final else False
        self.num_calls += 1
        self.blank, self.in_text = "", False            # whitespace before the call was a separator
        self.function, self.num_parameters = name, 0
        self.piece("{", name)
        self.text, self.state = self.text[end + 1:], "body"
        return True

    def not_a_call(self, length: int) -> bool:
        self.say(self.text[:length])
        self.text, self.state = self.text[length:], "text"
        return True

    def read_body(self, final: bool) -> bool:
        """Between a call's parameters: text other than tags is dropped, as vLLM drops it."""
        at, tag = earliest(self.text, (PARAMETER_START, FUNCTION_END, TOOL_CALL_END))
        if tag is None:
            keep = 0 if final else held_length(self.text, (PARAMETER_START, FUNCTION_END, TOOL_CALL_END))
            self.text = self.text[len(self.text) - keep:]
            if final:
                self.end_call("text")
            return False
        if tag == PARAMETER_START:
            end = self.text.find(">", at)
            if end < 0:
                self.text = "" if final else self.text[at:]
                if final:           # a parameter cut short in its name is dropped, as vLLM drops it
                    self.end_call("text")
                return False
            self.parameter = self.text[at + len(PARAMETER_START):end]
            self.text, self.state, self.scanned = self.text[end + 1:], "value", 0
            return True
        self.text = self.text[at + len(tag):]
        self.end_call("after_function" if tag == FUNCTION_END and self.wrapped else "text")
        return True

    def read_value(self, final: bool) -> bool:
        """A value ends at </parameter>, or where the next parameter, the function or the call
        begins (a missing end tag, as vLLM's pattern allows), or at the output's end."""
        at, tag = earliest(self.text, VALUE_ENDS, self.scanned)
        if tag is None:
            if final:
                self.end_value(self.text)
                self.text = ""
                self.end_call("text")
                return False
            self.scanned = max(0, len(self.text) - max(map(len, VALUE_ENDS)) + 1)
            return False
        self.end_value(self.text[:at])
        self.text = self.text[at + len(PARAMETER_END) if tag == PARAMETER_END else at:]
        self.state = "body"
        return True

    def read_after_function(self, final: bool) -> bool:
        """Whitespace, then the call's </tool_call>; anything else ends the call too."""
        rest = self.text.lstrip()
        if rest.startswith(TOOL_CALL_END):
            self.text, self.state = rest[len(TOOL_CALL_END):], "text"
            return True
        if TOOL_CALL_END.startswith(rest):     # whitespace alone, or the end tag begun
            self.text = "" if final else rest
            self.state = "text" if final else self.state
            return False
        self.text, self.state = rest, "text"
        return True
