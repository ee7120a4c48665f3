"""The engine tests' checkpoint with a tokenizer: tests/server/conftest.py's tiny random Qwen3 with
a trained byte-level BPE tokenizer and a ChatML template, written once for the session."""
import pytest

from tests.server.conftest import write_tiny_model


@pytest.fixture(scope="session")
def tokenized_model(tmp_path_factory) -> str:
    return write_tiny_model(str(tmp_path_factory.mktemp("tiny-qwen3-tokenized")))
