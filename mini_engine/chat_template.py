"""The checkpoint's chat template (tokenizer_config.json's `chat_template`), rendered with jinja2
the way transformers' apply_chat_template renders it: a sandboxed, immutable environment with
trim_blocks and lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` that
keeps non-ASCII text, and the special tokens (bos_token, eos_token, ...) as variables. LLM.chat and
the server's chat endpoint both render through it."""
import copy
import json
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mini_engine.tokenizer import load_tokenizer_config

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def template_message(message: dict) -> dict:
    """An OpenAI message as chat templates read it (as vLLM's entrypoints/chat_utils.py gives it
    them): text parts joined, a tool call's JSON arguments as an object (Qwen3's template writes
    them back with tojson), and the reasoning of an earlier turn also as `reasoning_content`, the
    name Qwen3's template reads. Raises ValueError for content parts other than text."""
    out = copy.deepcopy(message)
    if isinstance(out.get("content"), list):
        if any(not isinstance(part, dict) or part.get("type") != "text" for part in out["content"]):
            raise ValueError("only text content parts are supported")
        # The parts' texts on lines of their own, a part without text left out.
        out["content"] = "\n".join(part["text"] for part in out["content"] if part.get("text") is not None)
    for call in out.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except ValueError:
                pass                # not JSON: the template gets the string
    if "reasoning" in out and "reasoning_content" not in out:
        out["reasoning_content"] = out["reasoning"]
    return out


def continue_final_message(text: str, messages: list[dict]) -> str:
    """The rendered chat cut right after its final message's content, as transformers'
    apply_chat_template and vLLM's continue_final_message cut it: that message is left open (no
    end of turn after it) for the model to continue. Raises ValueError where the final message has
    no text, or the template did not write it (tried as it is, then stripped, as some templates
    strip a message's content)."""
    content = messages[-1].get("content") if messages else None
    if not isinstance(content, str) or not content.strip():
        raise ValueError("continue_final_message needs a final message with text content")
    for written in (content, content.strip()):
        end = text.rfind(written)
        if end >= 0:
            return text[:end + len(written)]
    raise ValueError("continue_final_message: the chat template did not write the final message's content")


def token_text(token) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    return token.get("content") if isinstance(token, dict) else token


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        self.template = env.from_string(source)
        self.special_tokens = special_tokens

    @classmethod
    def from_pretrained(cls, path: str) -> "ChatTemplate | None":
        config = load_tokenizer_config(path)
        source = config.get("chat_template")
        if isinstance(source, list):        # named templates: [{"name": "default", "template": ...}, ...]
            source = {t.get("name"): t.get("template") for t in source}.get("default")
        if not source:
            return None
        special = {k: token_text(config[k]) for k in SPECIAL_TOKEN_KEYS if config.get(k) is not None}
        return cls(source, special)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Raises ValueError for messages the template rejects."""
        try:
            context = {"tools": None, "documents": None, **self.special_tokens, **kwargs}
            return self.template.render(context, messages=messages, add_generation_prompt=add_generation_prompt)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template: {e}") from None
