"""The checkpoint's chat template (tokenizer_config.json's `chat_template`), rendered with jinja2
the way transformers' apply_chat_template renders it: a sandboxed, immutable environment with
trim_blocks and lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` that
keeps non-ASCII text, and the special tokens (bos_token, eos_token, ...) as variables."""
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
