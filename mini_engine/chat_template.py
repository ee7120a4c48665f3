"""The checkpoint's chat template (tokenizer_config.json's `chat_template`), rendered with jinja2
the way transformers' apply_chat_template renders it: a sandboxed, immutable environment with
trim_blocks and lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` that
keeps non-ASCII text, and the special tokens (bos_token, eos_token, ...) as variables. LLM.chat and
the server's chat endpoint both render through it.

A template may also come from the user instead (the server's --chat-template, a request's
`chat_template`, LLM.chat's): it is code we did not write, so whatever fails in compiling or
rendering it is a ValueError naming the template, never another exception."""
import copy
import functools
import json
import os
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mini_engine.tokenizer import load_tokenizer_config, token_text

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


# Jinja's characters: a --chat-template value with one of them is a template, not a file's path.
JINJA_CHARS = "{}\n"


def load_chat_template(value: str) -> str:
    """vLLM's --chat-template (and LLM.chat's chat_template here): the text of the file at that
    path, else the value itself where it holds Jinja's characters. Raises ValueError for a value
    that names no readable file and cannot be a template, rather than render it as plain text."""
    if not isinstance(value, str):
        raise ValueError(f"a chat template is text (a Jinja template, or a file's path), got {type(value).__name__}")
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except (OSError, ValueError) as e:      # ValueError: a NUL in the value
        if not any(c in value for c in JINJA_CHARS):
            raise ValueError(f"the chat template {value!r} looks like a file path, but it cannot be opened: "
                             f"{e}") from None
        return value


def template_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


ENVIRONMENT = template_environment()


@functools.lru_cache(maxsize=32)
def compiled(source: str) -> jinja2.Template:
    """A template's compiled form, kept for the next request that sends the same text (a client
    sends its template with every request). Raises ValueError where it does not compile."""
    try:
        return ENVIRONMENT.from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"the chat template does not compile: {e}") from None


def checkpoint_template_source(path: str) -> str | None:
    """The checkpoint's own template: chat_template.jinja where transformers saved it apart (and
    where it reads it first), else tokenizer_config.json's chat_template (its "default" where that
    holds several named ones)."""
    file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(file):
        with open(file, encoding="utf-8") as f:
            return f.read()
    source = load_tokenizer_config(path).get("chat_template")
    if isinstance(source, list):        # named templates: [{"name": "default", "template": ...}, ...]
        source = {t.get("name"): t.get("template") for t in source}.get("default")
    return source or None


def checkpoint_special_tokens(path: str) -> dict[str, str]:
    """The special tokens (bos_token, eos_token, ...) tokenizer_config.json names, which a template
    reads as variables: the checkpoint's, or one the user gives in its place."""
    config = load_tokenizer_config(path)
    return {k: token_text(config[k]) for k in SPECIAL_TOKEN_KEYS if config.get(k) is not None}


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]):
        """Raises ValueError where source (a template's text) does not compile."""
        self.template = compiled(source)
        self.special_tokens = special_tokens

    @classmethod
    def from_pretrained(cls, path: str, source: str | None = None) -> "ChatTemplate | None":
        """The checkpoint's template, or source (a template's text) in its place; either with the
        checkpoint's special tokens. None where there is neither."""
        source = source if source is not None else checkpoint_template_source(path)
        return None if source is None else cls(source, checkpoint_special_tokens(path))

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Raises ValueError for messages the template rejects, and for whatever else fails in it."""
        try:
            context = {"tools": None, "documents": None, **self.special_tokens, **kwargs}
            return self.template.render(context, messages=messages, add_generation_prompt=add_generation_prompt)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template: {e}") from None
        except Exception as e:      # TypeError, ZeroDivisionError, RecursionError, ...: the template's own fault
            raise ValueError(f"chat template: {type(e).__name__}: {e}") from None
