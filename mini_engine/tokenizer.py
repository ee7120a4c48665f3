"""The checkpoint's tokenizer (tokenizer.json through the `tokenizers` library), if it has one."""
import json
import os

from tokenizers import Tokenizer


def load_tokenizer(path: str) -> Tokenizer | None:
    file = os.path.join(path, "tokenizer.json")
    return Tokenizer.from_file(file) if os.path.isfile(file) else None


def load_tokenizer_config(path: str) -> dict:
    file = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(file):
        return {}
    with open(file) as f:
        return json.load(f)


def token_text(token) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    return token.get("content") if isinstance(token, dict) else token


def tokenizer_eos_id(path: str) -> int | None:
    """tokenizer_config.json's eos_token as the tokenizer numbers it; None where either file or the
    token is missing."""
    token = token_text(load_tokenizer_config(path).get("eos_token"))
    tokenizer = load_tokenizer(path) if isinstance(token, str) else None
    return None if tokenizer is None else tokenizer.token_to_id(token)


def encode_pair(tokenizer: Tokenizer | None, first: str | list[int], second: str | list[int]) -> list[int]:
    """A cross-encoder's prompt of two texts: as the tokenizer encodes a pair (its post-processor's
    pair template, where it has one; Qwen3-Reranker's has none), token ids one after the other."""
    if isinstance(first, str) and isinstance(second, str) and tokenizer is not None:
        return tokenizer.encode(first, second, add_special_tokens=True).ids
    return encode_prompt(tokenizer, first, True) + encode_prompt(tokenizer, second, True)


def encode_prompt(tokenizer: Tokenizer | None, prompt: str | list[int], add_special_tokens: bool = False) -> list[int]:
    """A prompt as token ids: text through the tokenizer, ids as given. add_special_tokens: the
    tokenizer's post-processor adds its tokens, as Qwen3-Embedding's appends the <|endoftext|>
    whose state the model pools (an embedding engine's prompts); Qwen3's own adds none."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer.json: pass prompts as token ids")
        return tokenizer.encode(prompt, add_special_tokens=add_special_tokens).ids
    if isinstance(prompt, (bytes, bytearray)):
        raise ValueError("a prompt is text (str) or token ids, not bytes")
    return list(prompt)


def load_transformers_tokenizer(path: str, has_tokenizer: bool, owner: str):
    """vLLM's get_tokenizer (LLM's, AsyncLLM's: `owner`): the checkpoint's tokenizer as transformers
    loads it (AutoTokenizer: encode, decode, apply_chat_template, ...), which its users build
    prompts with; transformers is needed here alone, the engine does not use it."""
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ImportError(f"{owner}.get_tokenizer returns transformers' tokenizer: pip install transformers "
                          f"({e}); {owner}.tokenizer is the engine's own (the tokenizers library's)") from None
    if not has_tokenizer:
        raise ValueError("this checkpoint has no tokenizer.json: it takes prompts as token ids")
    return AutoTokenizer.from_pretrained(path)
