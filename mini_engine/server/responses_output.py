"""A response's output items (OpenAI's Responses API), built from its parsed text as it comes, and
the stream events that say so. A thought becomes a "reasoning" item, the answer a "message"
item with one output_text part, each tool call a "function_call" item. One item is open at a
time: a change of kind (or a new call) closes it and opens the next, so the items are in the order
the model wrote them. A response that is not streamed is built the same way, its events dropped,
so that the two give the same items for the same text.

Each item's events, as OpenAI's (and vLLM's) streams send them:
  output_item.added, content_part.added, {output_text|reasoning_text}.delta..., {...}.done,
  content_part.done, output_item.done
and for a call: output_item.added, function_call_arguments.delta..., function_call_arguments.done,
output_item.done. Every event is numbered (sequence_number) in the order it is sent.
"""
import uuid
from dataclasses import dataclass, field

from mini_engine.server.output_parsers import ParsedText, ToolCall


def item_id(prefix: str) -> str:
    """OpenAI's ids: resp_..., msg_..., rs_..., fc_..., call_..."""
    return f"{prefix}_{uuid.uuid4().hex}"


def text_part(kind: str, text: str) -> dict:
    """A message's output_text part, or a reasoning item's reasoning_text."""
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": text}


@dataclass
class OpenItem:
    """The item being written: its JSON as output_item.added gave it, and its text so far (a
    message's, a thought's, or a call's arguments)."""
    output_index: int
    added: dict
    text: list[str] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return self.added["type"]

    @property
    def id(self) -> str:
        return self.added["id"]

    def done(self, status: str) -> dict:
        text = "".join(self.text)
        if self.kind == "function_call":
            return self.added | {"arguments": text, "status": status}
        return self.added | {"content": [text_part(self.kind, text)], "status": status}


class ResponseOutput:
    def __init__(self):
        self.items: list[dict] = []             # the closed items, in order
        self.open: OpenItem | None = None
        self.sequence_number = 0

    def event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event

    def feed(self, parsed: ParsedText) -> list[dict]:
        """The events of a piece of parsed text, in the order the model wrote them: the rest of a call
        already open (its text came first: nothing else is written inside a call), its thought, its
        answer, then its new calls."""
        calls = parsed.tool_calls
        ongoing = 0
        while ongoing < len(calls) and calls[ongoing].continued:
            ongoing += 1
        events = []
        for call in calls[:ongoing]:
            events += self.call(call)
        if parsed.reasoning:
            events += self.write("reasoning", parsed.reasoning)
        if parsed.content:
            events += self.write("message", parsed.content)
        for call in calls[ongoing:]:
            events += self.call(call)
        return events

    def finish(self, status: str) -> list[dict]:
        """Closes the last item: "incomplete" where the response is not "completed" (max_output_tokens
        cut it short)."""
        return self.close("completed" if status == "completed" else "incomplete")

    def write(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.open is None or self.open.kind != kind:
            events += self.close("completed")
            added = {"id": item_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                     "content": []} if kind == "message" else \
                {"id": item_id("rs"), "type": "reasoning", "summary": [], "status": "in_progress"}
            events += self.start(added)
            events.append(self.event("response.content_part.added", **self.place(), part=text_part(kind, "")))
        self.open.text.append(text)
        delta_type = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        return events + [self.event(delta_type, **self.place(), delta=text, **extra)]

    def call(self, call: ToolCall) -> list[dict]:
        """A tool call: a new item, or (a forced function's arguments streaming) more of the open one."""
        events = []
        if not (call.continued and self.open is not None and self.open.kind == "function_call"):
            events += self.close("completed")
            events += self.start({"id": item_id("fc"), "type": "function_call", "call_id": item_id("call"),
                                  "name": call.name, "arguments": "", "status": "in_progress"})
        if call.arguments:
            self.open.text.append(call.arguments)
            events.append(self.event("response.function_call_arguments.delta", item_id=self.open.id,
                                     output_index=self.open.output_index, delta=call.arguments))
        return events

    def start(self, added: dict) -> list[dict]:
        self.open = OpenItem(len(self.items), added)
        return [self.event("response.output_item.added", output_index=self.open.output_index, item=added)]

    def place(self) -> dict:
        """Where a text event goes: the open item, its one part."""
        return {"item_id": self.open.id, "output_index": self.open.output_index, "content_index": 0}

    def close(self, status: str) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        done = item.done(status)
        self.items.append(done)
        text = "".join(item.text)
        if item.kind == "function_call":
            events = [self.event("response.function_call_arguments.done", item_id=item.id,
                                 output_index=item.output_index, name=item.added["name"], arguments=text)]
        else:
            where = {"item_id": item.id, "output_index": item.output_index, "content_index": 0}
            done_type = "response.output_text.done" if item.kind == "message" else "response.reasoning_text.done"
            extra = {"logprobs": []} if item.kind == "message" else {}
            events = [self.event(done_type, **where, text=text, **extra),
                      self.event("response.content_part.done", **where, part=done["content"][0])]
        return events + [self.event("response.output_item.done", output_index=item.output_index, item=done)]


def count_reasoning_tokens(output_token_ids: list[int], think_start: int | None, think_end: int | None,
                           prompt_opened_thought: bool) -> int:
    """vLLM's count (its reasoning parsers' count_reasoning_tokens): the output tokens after
    <think> (or from the first, where the prompt opened the thought) and before </think> (or to
    the last, where it never closed). Where the tags are not tokens of their own, only a thought
    the prompt opened is counted."""
    if think_start in output_token_ids:
        start = output_token_ids.index(think_start) + 1
    elif prompt_opened_thought:
        start = 0
    else:
        return 0
    rest = output_token_ids[start:]
    return rest.index(think_end) if think_end in rest else len(rest)
