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
