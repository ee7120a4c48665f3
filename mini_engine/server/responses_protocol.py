"""OpenAI's Responses API request (POST /v1/responses), and what it is to this server: a chat
request. Its `input` items become chat messages (as vLLM's responses/utils.py builds them), its
flat function tools and tool choice the chat API's, `text.format` the chat's `response_format`,
`max_output_tokens` its `max_tokens`, so that the chat endpoint's checks, template, sampling
defaults and output parsers serve both, and a response's text is the chat completion's.

As the other endpoints, unknown fields are refused, and the fields OpenAI defines that we do not
implement are accepted only at their neutral values: a 400 naming the field otherwise.
"""
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mini_engine.server.protocol import CacheSalt, ChatCompletionRequest, ProtocolError

INPUT_ROLES = ("user", "system", "developer", "assistant")
# What a message's content parts may be: OpenAI's input text, and the output text of an earlier
# response's message sent back.
TEXT_PARTS = ("input_text", "output_text")
# The chat request's names of the fields a ProtocolError may name, in the Responses API's words.
CHAT_TO_RESPONSES_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text",
                            "chat_template_kwargs": "reasoning"}


class ReasoningConfig(BaseModel):
    """OpenAI's `reasoning`. effort goes to the chat template as `reasoning_effort`, as vLLM passes it
    (Qwen3's template reads none: its thinking is on unless a template turns it off); a summary
    is never written, since the reasoning item holds the whole thought as its content."""
    model_config = ConfigDict(extra="forbid")
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None         # OpenAI's former name for summary


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None                    # as vLLM's: none is the served model
    input: str | list[dict[str, Any]]
    instructions: str | None = None             # a system message first; not carried to a next response
    max_output_tokens: int | None = None        # None: what max_model_len and the KV pool leave
    temperature: float | None = None            # None: generation_config.json's, as the chat endpoint
    top_p: float | None = None
    stream: bool = False
    # The Responses API's flat function tools: {"type": "function", "name", "description", "parameters"}.
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"  # "auto", "none", "required" or {"type": "function", "name"}
    parallel_tool_calls: bool = True
    reasoning: ReasoningConfig | None = None
    # {"format": {"type": "text"}}, {"format": {"type": "json_object"}} or {"format": {"type":
    # "json_schema", "name", "schema"}}: the last two held to by structured outputs.
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None      # echoed
    user: str | None = None                     # accepted and ignored, as OpenAI's own
    safety_identifier: str | None = None        # the same
    prompt_cache_key: str | None = None         # the same: the prefix cache needs no key
    # None: OpenAI's default, true, where the server stores responses (VLLM_ENABLE_RESPONSES_API_STORE).
    store: bool | None = None
    previous_response_id: str | None = None     # a stored response, whose input and output go first
    # Accepted only at their neutral values (unsupported()). "reasoning.encrypted_content" is
    # accepted too: no reasoning is encrypted here, and a reasoning item sent back carries its text.
    include: list[str] | None = None
    background: bool = False
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    truncation: str | None = None
    prompt: dict[str, Any] | None = None        # a stored prompt template of OpenAI's
    service_tier: str | None = None
    # vLLM's extensions of its ResponsesRequest.
    top_k: int | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    structured_outputs: dict[str, Any] | None = None
    priority: int = 0
    cache_salt: CacheSalt = None

    def unsupported(self) -> str | None:
        if any(item != "reasoning.encrypted_content" for item in self.include or ()):
            return "include"
        if self.background:
            return "background"
        if self.max_tool_calls is not None:
            return "max_tool_calls"
        if self.top_logprobs:
            return "top_logprobs"
        if self.truncation not in (None, "disabled"):
            return "truncation"
        if self.prompt is not None:
            return "prompt"
        if self.service_tier not in (None, "auto", "default"):
            return "service_tier"
        return None

    def chat_request(self, messages: list[dict]) -> ChatCompletionRequest:
        """The chat request this one is, for the messages that its input (after any earlier
        response's) makes."""
        effort = self.reasoning.effort if self.reasoning is not None else None
        try:
            return ChatCompletionRequest(
                model=self.model, messages=messages, max_tokens=self.max_output_tokens, temperature=self.temperature,
                top_p=self.top_p, top_k=self.top_k, repetition_penalty=self.repetition_penalty, seed=self.seed,
                stop=self.stop, ignore_eos=self.ignore_eos, include_stop_str_in_output=self.include_stop_str_in_output,
                logit_bias=self.logit_bias, structured_outputs=self.structured_outputs, priority=self.priority,
                stream=self.stream, response_format=self.response_format(), tools=self.chat_tools(),
                tool_choice=self.chat_tool_choice(), parallel_tool_calls=self.parallel_tool_calls,
                chat_template_kwargs=None if effort is None else {"reasoning_effort": effort},
                cache_salt=self.cache_salt)
        except ValidationError as e:
            first = e.errors()[0]
            raise ProtocolError(f"input: {first['msg']}", param="input") from None

    def response_format(self) -> dict | None:
        """text.format as the chat API's response_format."""
        text = self.text or {}
        if text.get("verbosity") not in (None, "medium"):        # OpenAI's default; we cannot make it terser
            raise ProtocolError(f"text.verbosity={text['verbosity']!r} is not supported by this server", param="text")
        if extra := set(text) - {"format", "verbosity"}:
            raise ProtocolError(f"text.{sorted(extra)[0]} is not a supported parameter", param="text")
        spec = text.get("format") or {"type": "text"}
        kind = spec.get("type") if isinstance(spec, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "json_object"}
        if kind == "json_schema" and isinstance(spec.get("schema"), dict):
            return {"type": "json_schema", "json_schema": {"name": spec.get("name"), "schema": spec["schema"]}}
        raise ProtocolError('text.format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
                            f'"name": ..., "schema": {{...}}}}, got {spec!r}', param="text")

    def chat_tools(self) -> list[dict] | None:
        """The flat function tools as the chat API's {"type": "function", "function": {...}} (every
        key but type, as vLLM's convert_tool_responses_to_completions_format)."""
        tools = []
        for i, tool in enumerate(self.tools):
            if tool.get("type") != "function":
                raise ProtocolError(f"tools[{i}]: only function tools are supported, got type {tool.get('type')!r}",
                                    param="tools")
            if not isinstance(tool.get("name"), str):
                raise ProtocolError(f"tools[{i}]: a function tool needs a name", param="tools")
            tools.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
        return tools or None

    def chat_tool_choice(self) -> str | dict | None:
        choice = self.tool_choice
        named = isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str)
        if not named and choice not in ("auto", "none", "required"):
            raise ProtocolError('tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}, '
                                f'got {choice!r}', param="tool_choice")
        if named:
            return {"type": "function", "function": {"name": choice["name"]}}
        # The default "auto" means nothing without tools (the chat API refuses a tool_choice there).
        return None if not self.tools and choice in ("auto", "none") else choice


def chat_messages(req: ResponsesRequest, history: list[dict]) -> list[dict]:
    """The chat messages of a request: its instructions as a system message, then an earlier
    response's conversation (history), then its input."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += history
    if isinstance(req.input, str):
        return messages + [{"role": "user", "content": req.input}]
    return append_items(messages, req.input, "input")


def append_items(messages: list[dict], items: list[dict], where: str) -> list[dict]:
    """messages with the chat messages of Responses items added: input items, or an earlier
    response's output items (which are input items too). An assistant turn can span items (its
    reasoning, its message, its function calls), which go into one assistant message."""
    for i, item in enumerate(items):
        try:
            message = item_message(item, messages[-1] if messages else None)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            detail = f"needs {e}" if isinstance(e, KeyError) else str(e)
            raise ProtocolError(f"{where}[{i}]: {detail}", param="input") from None
        if message is not None:
            messages.append(message)
    return messages


def item_message(item: dict, previous: dict | None) -> dict | None:
    """One item's chat message, or None where it went into the previous (assistant) message."""
    if not isinstance(item, dict):
        raise TypeError(f"an item is an object, got {item!r}")
    kind = item.get("type", "message")
    assistant = previous if previous is not None and previous.get("role") == "assistant" else None
    if kind == "message":
        role = item["role"]
        if role not in INPUT_ROLES:
            raise ValueError(f"role must be one of {INPUT_ROLES}, got {role!r}")
        content = message_content(item["content"])
        if role == "assistant" and assistant is not None and assistant.get("content") is None:
            assistant["content"] = content          # after its reasoning item
            return None
        return {"role": role, "content": content}
    if kind == "function_call":
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        if assistant is not None:
            assistant.setdefault("tool_calls", []).append(call)
            return None
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        output = item["output"]
        text = output if isinstance(output, str) else "\n".join(part["text"] for part in text_parts(output))
        return {"role": "tool", "tool_call_id": item["call_id"], "content": text}
    if kind == "reasoning":
        texts = [part.get("text") for part in item.get("content") or item.get("summary") or []]
        if item.get("encrypted_content") and not texts:
            raise ValueError("encrypted reasoning is not supported: send the reasoning item's content")
        reasoning = "\n".join(t for t in texts if isinstance(t, str))
        if assistant is not None and assistant.get("reasoning") is None:
            assistant["reasoning"] = reasoning
            return None
        return {"role": "assistant", "content": None, "reasoning": reasoning}
    raise ValueError(f"items of type {kind!r} are not supported (message, function_call, function_call_output "
                     "and reasoning are)")


def message_content(content) -> str | list[dict]:
    """A message's content as the chat API's: a text, or text parts (which the chat template
    gets joined, as the chat endpoint's)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise TypeError(f"content must be a string or a list of parts, got {content!r}")
    return [{"type": "text", "text": part["text"]} for part in text_parts(content)]


def text_parts(parts: list) -> list[dict]:
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ValueError(f"only text content parts ({', '.join(TEXT_PARTS)}) are supported, got {kind or part!r}")
    return parts


def in_responses_terms(e: ProtocolError) -> ProtocolError:
    """A chat request's error about one of its fields, naming the Responses request's field."""
    message = re.sub(r"\bmax_tokens\b", "max_output_tokens", str(e))
    message = re.sub(r"\bresponse_format\b", "text.format", message)
    return ProtocolError(message, e.status_code, CHAT_TO_RESPONSES_PARAMS.get(e.param, e.param), e.code)
