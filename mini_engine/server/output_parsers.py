"""A chat completion's text split into what OpenAI's clients read apart: Qwen3's reasoning (between
<think> and </think>), the answer's content, and its tool calls (Hermes-style <tool_call> blocks of
JSON, which Qwen3's chat template teaches the model to write). vLLM's `--reasoning-parser qwen3` and
`--tool-call-parser hermes` do this job there.

Both parsers read text as it streams, one delta at a time, and give the same parts whatever the
deltas' boundaries: a delta that ends with what may be the start of a tag is held back until the
next one says (`final` flushes it). A response that is not streamed is the same parser fed once.
Nothing is lost: a tool call that is not valid JSON stays in the content as the model wrote it.
"""
import json
from dataclasses import dataclass, field

from mini_engine.reasoning import REASONING_PARSERS, THINK_END, THINK_START
from mini_engine.server.protocol import random_id

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_CALL_PARSERS = ("hermes", "qwen3_coder")  # qwen3_coder: Qwen3-Coder's XML-style calls (qwen3_coder_tool_parser.py)


def not_json(constant: str):
    """json.loads reads NaN and Infinity, which JSON (and so a tool call's arguments) has not."""
    raise ValueError(f"{constant} is not JSON")


def partial_tag_length(text: str, tag: str) -> int:
    """How many of text's last characters begin tag: those may be completed by the next delta."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class ParserOptions:
    """The server's choice, as vLLM's flags: --reasoning-parser, --tool-call-parser and
    --enable-auto-tool-choice (without which a request's tools are refused unless its tool_choice
    is "none")."""
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False

    def __post_init__(self):
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser (--tool-call-parser hermes)")

    @property
    def auto_tool_choice(self) -> bool:
        return self.enable_auto_tool_choice and self.tool_call_parser is not None


@dataclass
class ToolCall:
    index: int              # its place among the completion's calls: streamed deltas are put together by it
    name: str
    arguments: str          # JSON text, as OpenAI's function.arguments
    id: str = field(default_factory=lambda: random_id("chatcmpl-tool"))
    continued: bool = False     # more of an earlier delta's call: its arguments go on, nothing else is said

    def to_json(self, streamed: bool = False) -> dict:
        if self.continued:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index} | out if streamed else out


@dataclass
class ParsedText:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


class ReasoningParser:
    """Qwen3's thinking: an output that starts with <think> (after whitespace) reasons until
    </think>, and everything after it is content. Where the prompt already opened the thought (the
    Thinking-2507 templates end it with <think>) the output starts in it (a <think> the model
    writes again is dropped, as vLLM drops it); where the prompt closed it (enable_thinking=False
    writes an empty <think></think>) the output is all content. Otherwise an output that does not
    start with <think> is all content, tags included: vLLM's non-streamed parser says the same
    unless a </think> comes later (its streamed one then calls the text before it reasoning, and
    a stream cannot wait to know). A thought cut short by max_tokens is reasoning."""

    def __init__(self, prompt: str):
        tail = prompt.rstrip()
        self.opened = tail.endswith(THINK_START)
        self.state = "content" if tail.endswith(THINK_END) else "start"
        self.held = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) of the text so far that is no longer held back."""
        text, self.held = self.held + text, ""
        if self.state == "start":
            rest = text.lstrip()
            if rest.startswith(THINK_START):
                self.state, text = "reasoning", rest[len(THINK_START):]
            elif not final and THINK_START.startswith(rest):      # whitespace, or a tag begun
                self.held = text
                return "", ""
            else:
                self.state = "reasoning" if self.opened else "content"
        if self.state == "content":
            return "", text
        end = text.find(THINK_END)
        if end >= 0:
            self.state = "content"
            return text[:end], text[end + len(THINK_END):]
        keep = 0 if final else partial_tag_length(text, THINK_END)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep], ""


class ToolCallParser:
    """Hermes-style tool calls in the content: each <tool_call>{"name": ..., "arguments": {...}}
    </tool_call> becomes an OpenAI tool call, its arguments as JSON text (as vLLM's hermes parser
    writes them). The text between calls stays content as written, except where it is only
    whitespace (the model's separators; vLLM keeps whitespace before the first call). A call whose
    body is not such JSON stays in the content as written, tags and all; an unclosed one at the
    end is read as if closed (max_tokens cut its tag off). Text after a <tool_call> is held until
    its end tag, or the output's end, says whether it was a call."""

    def __init__(self, parallel: bool = True):
        self.parallel = parallel    # False: calls after the first are read and dropped (parallel_tool_calls)
        self.held = ""              # text that may begin a tag
        self.blank = ""             # the text since the last call, held while it is only whitespace
        self.in_text = False        # that text has more than whitespace: it goes out as it comes
        self.call: list[str] | None = None      # the open call's body so far
        self.num_calls = 0

    def content(self, text: str) -> str:
        if self.in_text:
            return text
        self.blank += text
        if not self.blank.strip():
            return ""
        text, self.blank, self.in_text = self.blank, "", True
        return text

    def close_call(self, closed: bool = True) -> tuple[str, ToolCall | None]:
        """closed: the end tag came (else the output ended inside the call)."""
        body, self.call = "".join(self.call), None
        try:
            parsed = json.loads(body, parse_constant=not_json)
            name, arguments = parsed["name"], parsed.get("arguments", {})
            if not isinstance(name, str):
                raise TypeError(name)
        except (ValueError, TypeError, KeyError, AttributeError):
            return self.content(TOOL_CALL_START + body + (TOOL_CALL_END if closed else "")), None
        self.num_calls += 1
        self.blank, self.in_text = "", False            # whitespace before the call was a separator
        arguments = json.dumps(arguments, ensure_ascii=False)
        return "", ToolCall(self.num_calls - 1, name, arguments) if self.parallel or self.num_calls == 1 else None

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        text, self.held = self.held + text, ""
        content, calls = [], []
        while text:
            tag = TOOL_CALL_END if self.call is not None else TOOL_CALL_START
            at = text.find(tag)
            if at < 0:
                keep = 0 if final else partial_tag_length(text, tag)
                text, self.held = text[:len(text) - keep], text[len(text) - keep:]
                if self.call is not None:
                    self.call.append(text)
                else:
                    content.append(self.content(text))
                break
            if self.call is None:
                content.append(self.content(text[:at]))
                self.call = []
            else:
                self.call.append(text[:at])
                before, call = self.close_call()
                content.append(before)
                calls += [call] if call else []
            text = text[at + len(tag):]
        if final:
            if self.call is not None:
                before, call = self.close_call(closed=False)
                content.append(before)
                calls += [call] if call else []
            if not self.num_calls:          # whitespace alone is content, unless it is a call's separator
                content.append(self.blank)
            self.blank = ""
        return "".join(content), calls


class ForcedToolCallParser:
    """tool_choice "required" or a named function, which structured outputs hold the content to:
    for a named function the content is its arguments, a call that streams as it comes; for
    "required", a JSON array of {"name", "parameters"} (vLLM's schema), read whole at the end. An
    array cut short by max_tokens stays content, as written."""

    def __init__(self, function: str):
        self.function = function        # "": "required"
        self.text: list[str] = []
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        if self.function:
            if not text and (self.num_calls or not final):
                return "", []
            call = ToolCall(0, self.function, text, continued=self.num_calls > 0)
            self.num_calls = 1
            return "", [call]
        self.text.append(text)
        if not final:
            return "", []
        body = "".join(self.text)
        try:
            calls = [ToolCall(i, item["name"], json.dumps(item["parameters"], ensure_ascii=False))
                     for i, item in enumerate(json.loads(body, parse_constant=not_json))]
        except (ValueError, TypeError, KeyError):
            return body, []
        self.num_calls = len(calls)
        return "", calls


def auto_tool_call_parser(name: str, tools: list[dict] | None, parallel: bool):
    """The parser that --tool-call-parser names, for a request's tool_choice "auto"."""
    if name == "qwen3_coder":
        from mini_engine.server.qwen3_coder_tool_parser import Qwen3CoderToolParser   # it imports this module
        return Qwen3CoderToolParser(tools, parallel)
    return ToolCallParser(parallel)


class ChatOutputParser:
    """One completion's text through the reasoning parser (if on), then its content through the
    tool call parser: Hermes-style calls (or Qwen3-Coder's) where the request's tools are parsed
    (tool_calls), or the calls structured outputs forced (forced_tool: a function's name, or "" for
    "required")."""

    def __init__(self, prompt: str, reasoning: bool, tool_calls: bool, parallel_tool_calls: bool = True,
                 forced_tool: str | None = None, tool_call_parser: str = "hermes", tools: list[dict] | None = None):
        """tool_call_parser: --tool-call-parser's; tools: the request's, whose schemas type the
        arguments of qwen3_coder's calls (forced calls are JSON whatever the parser)."""
        self.reasoning = ReasoningParser(prompt) if reasoning else None
        self.tool_calls = auto_tool_call_parser(tool_call_parser, tools, parallel_tool_calls) if tool_calls else \
            ForcedToolCallParser(forced_tool) if forced_tool is not None else None
        self.named_tool = bool(forced_tool)

    @property
    def called_tools(self) -> bool:
        return self.tool_calls is not None and self.tool_calls.num_calls > 0

    def finish_reason(self, reason: str | None) -> str | None:
        """As OpenAI's: "tool_calls" once the model called a tool, except a function the request
        named (then the call was not the model's choice, and the engine's reason stands)."""
        return "tool_calls" if reason is not None and self.called_tools and not self.named_tool else reason

    def feed(self, text: str, final: bool = False) -> ParsedText:
        reasoning, content = self.reasoning.feed(text, final) if self.reasoning else ("", text)
        calls = []
        if self.tool_calls:
            content, calls = self.tool_calls.feed(content, final)
        return ParsedText(reasoning, content, calls)
