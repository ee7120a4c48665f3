"""The server under test: a tiny random Qwen3 with a small byte-level BPE tokenizer (trained here,
so multi-byte UTF-8 is exercised) and a ChatML template, served by `python -m mini_engine.serve`
on a free loopback port in a subprocess."""
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from bench_serving import wait_healthy
from mini_engine.model.random_checkpoint import write_random_checkpoint
from mini_engine.tokenizer import load_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL_NAME = "tiny-qwen3"
MAX_MODEL_LEN = 512
NUM_KV_BLOCKS = 1024
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "Größe, Straße, café, naïve, déjà vu: accents take two bytes in UTF-8.",
    "你好，世界。今天天气很好。我们一起去公园散步吧。",
    "Emoji take four bytes: 😀 🚀 🎉 👍 and so do some rare CJK characters like 𠜎.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
] * 20


def train_tokenizer(vocab_size: int = 512) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TRAINING_TEXT, trainer)
    return tok


def write_tiny_model(path: str, chat_template: str = CHATML_TEMPLATE, added_tokens: tuple[str, ...] = ()) -> str:
    """added_tokens: texts that become one (not special) token each, so that a test can make the
    model write one by allowing it alone (allowed_token_ids)."""
    tok = train_tokenizer()
    tok.add_tokens([AddedToken(text, special=False, normalized=False) for text in added_tokens])
    tok.save(os.path.join(path, "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
        "vocab_size": tok.get_vocab_size(), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": MAX_MODEL_LEN,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True, "attention_bias": False,
        "bos_token_id": tok.token_to_id("<|endoftext|>"), "eos_token_id": eos,
    }
    # A larger std than the default, so that greedy outputs vary instead of repeating one token.
    write_random_checkpoint(path, config, dtype=torch.float32, std=0.3)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": chat_template, "eos_token": "<|im_end|>", "bos_token": None,
                   "pad_token": "<|endoftext|>"}, f)
    return path


def forcing_bias(model: str, texts) -> dict[str, dict[str, int]]:
    """For each text the tiny tokenizer holds as one token: the logit_bias that makes the random
    model write it (tests force whole outputs, a thought or a tool call, this way)."""
    tokenizer = load_tokenizer(model)
    return {text: {str(tokenizer.token_to_id(text)): 100} for text in texts}


def engine_processes(server_pid: int) -> list[int]:
    """The server's children that run an engine (multiprocessing's spawned ones, not its resource tracker)."""
    children = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if parent == server_pid and b"spawn_main" in cmdline:
            children.append(int(pid))
    return children


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return write_tiny_model(str(tmp_path_factory.mktemp("tiny-qwen3-served")))


class ServerHandle:
    def __init__(self, base_url: str, process: subprocess.Popen, log_path):
        self.base_url = base_url
        self.process = process
        self.log_path = log_path

    def openai_client(self, timeout: float = 60, api_key: str = "unused"):
        """OpenAI's client for this server's /v1 (a context manager), without retries: a failed
        request fails the test at once. api_key: for a server started with --api-key."""
        import openai
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=api_key, max_retries=0, timeout=timeout)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, keyed by name (and finish reason), summed over the engines
        (a server with --data-parallel-size has a series for each)."""
        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        values = {}
        for line in text.splitlines():
            m = re.match(r'^(mini_engine:[a-z0-9_]+)\{([^}]*)\} ([0-9.e+-]+|NaN)$', line)
            if m:
                reason = re.search(r'finished_reason="(\w+)"', m.group(2))
                bucket = re.search(r'le="([^"]+)"', m.group(2))
                key = m.group(1) + (f":{reason.group(1)}" if reason else "") + (f":le={bucket.group(1)}" if bucket else "")
                values[key] = values.get(key, 0.0) + float(m.group(3))
        return values

    def wait_idle(self, timeout: float = 20.0) -> dict[str, float]:
        """Waits until no request holds a KV block; returns the metrics then."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m["mini_engine:kv_cache_blocks_used"] == 0 and m["mini_engine:num_requests_running"] == 0
                    and m["mini_engine:num_requests_waiting"] == 0):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"KV blocks still in use after {timeout} s: {m}")
            time.sleep(0.05)

    @contextlib.contextmanager
    def checked_client(self):
        """openai_client() for one test, and check_idle_and_alive() after it."""
        with self.openai_client() as client:
            yield client
        self.check_idle_and_alive()

    def check_idle_and_alive(self) -> None:
        """After a test: every KV block free again, and the server still running."""
        self.wait_idle()
        assert self.process.poll() is None, "the server died"


@contextlib.contextmanager
def launched_server(model: str, log_dir, num_kv_blocks: int = NUM_KV_BLOCKS, options: tuple[str, ...] = (),
                    env: dict[str, str] | None = None):
    """`python -m mini_engine.serve` on a free loopback port, healthy, stopped on exit. Blocks of 16
    slots on any device, so that the pool holds what the tests reckon. options: more flags; env:
    environment variables for the server process alone (set in the tests' own environment, they
    would reach every server started after it too)."""
    port = free_port()
    cmd = [sys.executable, "-m", "mini_engine.serve", "--model", model, "--served-model-name", MODEL_NAME,
           "--host", "127.0.0.1", "--port", str(port), "--num-kv-blocks", str(num_kv_blocks), "--block-size", "16",
           "--max-num-seqs", "128", "--log-level", "warning", *options]
    log_path = log_dir / "server.log"
    log = open(log_path, "w")      # a file, not a pipe: nobody reads a pipe while tests run
    process = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True,
                               env=None if env is None else os.environ | env)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url, process, str(log_path), timeout=90)
    except SystemExit as e:          # bench_serving's helper exits; a fixture should raise
        process.kill()
        raise RuntimeError(str(e)) from None
    try:
        yield ServerHandle(base_url, process, log_path)
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)
        log.close()


@pytest.fixture(scope="session")
def server(tiny_model, tmp_path_factory):
    with launched_server(tiny_model, tmp_path_factory.mktemp("server-log"),
                         options=("--enable-prompt-embeds",)) as handle:
        yield handle


@pytest.fixture(scope="module")
def client(server):
    """OpenAI's client for the session's server (a test file with a server of its own has its own)."""
    with server.openai_client() as c:
        yield c


@pytest.fixture(scope="module")
def llm(tiny_model):
    """The offline engine on the served checkpoint: what the server's outputs are compared with."""
    from mini_engine import LLM
    return LLM(tiny_model, num_kv_blocks=NUM_KV_BLOCKS)


@pytest.fixture
def served(server):
    """The server, checked after the test: every KV block free, and still alive."""
    yield server
    server.check_idle_and_alive()
