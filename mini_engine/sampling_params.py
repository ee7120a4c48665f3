"""Per-request sampling parameters, validated when they are made."""
import dataclasses
import math
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from mini_engine.structured_outputs import StructuredOutputsParams

# Temperatures below this sample greedily, as in vLLM (its _SAMPLING_EPS): dividing the logits by
# one overflows them to inf, and the softmax of those is NaN.
GREEDY_TEMPERATURE = 1e-5

# The most completions one request may ask for: vLLM's default VLLM_MAX_N_SEQUENCES.
MAX_N = 16384


class RequestOutputKind(Enum):
    """vLLM's: what each RequestOutput of a streamed request (AsyncLLM.generate) holds: all of the
    output so far, only what is new since the last one, or (one output) the finished request.
    LLM.generate, which returns finished requests, ignores it, as vLLM's does."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0      # 0 (or below GREEDY_TEMPERATURE) means greedy (argmax)
    top_k: int = -1               # -1 or 0: no top-k restriction
    top_p: float = 1.0            # 1.0: no nucleus restriction
    max_tokens: int = 16
    min_tokens: int = 0           # no EOS (even ignored), stop token or stop string ends fewer tokens
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = field(default_factory=list)   # None: none
    stop: str | list[str] | None = field(default_factory=list)   # strings that end the output (not included)
    include_stop_str_in_output: bool = False   # vLLM's: keep the stop string (or stop token) in the text
    seed: int | None = None       # reproducible sampling for this request alone
    logprobs: int | None = None   # return the sampled token's log-probability and this many top ones
    # vLLM's: each prompt token's log-probability (given the tokens before it) and this many top
    # ones. The request's prompt is then computed whole, never taken from the prefix cache.
    prompt_logprobs: int | None = None
    # vLLM's (and OpenAI's) penalties, applied to the logits before temperature. presence and
    # frequency subtract from the logit of each token the output holds, once and once a time it
    # appears; repetition divides a positive logit (multiplies a negative one) of each token the
    # prompt or the output holds (transformers' repetition_penalty).
    presence_penalty: float = 0.0     # in [-2, 2]
    frequency_penalty: float = 0.0    # in [-2, 2]
    repetition_penalty: float = 1.0   # > 0; 1 is off
    min_p: float = 0.0                # in [0, 1]: drop tokens less likely than min_p x the likeliest
    # Added to the logits of these token ids before anything else (OpenAI's logit_bias: -100
    # bans a token, +100 all but forces it).
    logit_bias: dict[int, float] | None = None
    # logit_bias as two arrays (token ids, biases), made once: a step concatenates its rows' arrays
    # instead of walking their dicts (a whole-vocabulary bias took 256 ms a step).
    logit_bias_arrays: tuple[np.ndarray, np.ndarray] | None = field(default=None, init=False, repr=False,
                                                                    compare=False)
    # vLLM's: the only token ids the request may sample (all others -inf, before the bias), and
    # them as a sorted array, made once.
    allowed_token_ids: list[int] | None = None
    allowed_token_ids_array: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    # Completions of the prompt to return (vLLM's parallel sampling): n sequences, whose prompt
    # the prefix cache computes once; with a seed, completion i draws from seed + i.
    n: int = 1
    # vLLM's: the output held to a JSON schema, a regex, a choice of strings or a grammar (a
    # StructuredOutputsParams, or a dict of its fields).
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's: words the output may not contain (as the tokenizer writes them, alone or after a
    # space: engine/bad_words.py).
    bad_words: list[str] | None = None
    # vLLM's text options. detokenize=False: no text at all (empty strings, token ids only), and
    # so no stop strings, which are matched on the text.
    detokenize: bool = True
    # The tokenizer's special tokens (added tokens marked special: <|im_end|>, <|endoftext|>) left
    # out of the text. Qwen3's <think> and </think> are added tokens but not special: they stay.
    skip_special_tokens: bool = True
    # Accepted as vLLM's, and changes nothing with a tokenizer.json tokenizer (detokenizer.py says why).
    spaces_between_special_tokens: bool = True
    # vLLM's: only the prompt's last k tokens (-1: the last max_model_len) are generated from, and
    # are the output's prompt_token_ids; None keeps the prompt whole.
    truncate_prompt_tokens: int | None = None
    # vLLM's: arguments for custom code, which the engine itself never reads: custom logits
    # processors (mini_engine/logits_processors.py) decide from them whether and how to change
    # the request's logits. The server's requests give them as vllm_xargs.
    extra_args: dict | None = None
    # vLLM's field, which its V1 engine refuses for a request, and so does this one: callables on
    # each step's logits, which would take every row off the device (and out of the CUDA graph).
    # What takes their place is the engine's logits_processors (AdapterLogitsProcessor wraps such
    # per-request callables).
    logits_processors: list | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self):
        if not is_number(self.temperature) or not 0 <= _as_float32(self.temperature) < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or not -1 <= self.top_k < 2**31:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or a positive integer below 2**31, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or \
                not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer or None, got {self.seed!r}")
        self.stop_token_ids = _as_list(self.stop_token_ids, "stop_token_ids")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        self.stop = [self.stop] if isinstance(self.stop, str) else _as_list(self.stop, "stop")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(f"include_stop_str_in_output must be a bool, got {self.include_stop_str_in_output!r}")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _as_list(self.allowed_token_ids, "allowed_token_ids")
            if not self.allowed_token_ids or any(not isinstance(t, int) or isinstance(t, bool) or t < 0
                                                 for t in self.allowed_token_ids):
                raise ValueError("allowed_token_ids must be a non-empty list of token ids or None, "
                                 f"got {self.allowed_token_ids!r}")
            self.allowed_token_ids_array = np.unique(np.array(self.allowed_token_ids, dtype=np.int64))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"{name} must be a non-negative integer or None, got {value!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not is_number(self.repetition_penalty) or not 0.0 < _as_float32(self.repetition_penalty) < math.inf:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        if not is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or any(
                    not isinstance(t, int) or isinstance(t, bool) or t < 0 or not is_number(v) or not -100 <= v <= 100
                    for t, v in self.logit_bias.items()):
                raise ValueError(f"logit_bias must map token ids to numbers in [-100, 100], got {self.logit_bias!r}")
            self.logit_bias = dict(self.logit_bias) or None
        if self.logit_bias:
            self.logit_bias_arrays = (np.array(list(self.logit_bias.keys()), dtype=np.int64),
                                      np.array(list(self.logit_bias.values()), dtype=np.float32))
        if self.bad_words is not None:
            self.bad_words = [self.bad_words] if isinstance(self.bad_words, str) else _as_list(self.bad_words,
                                                                                                "bad_words")
            if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
                raise ValueError(f"bad_words must be words (strings with more than whitespace), got {self.bad_words!r}")
            self.bad_words = self.bad_words or None
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams (or a dict of its fields) or None, "
                             f"got {self.structured_outputs!r}")
        for name in ("detokenize", "skip_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are matched on the text, which detokenize=False leaves out: set "
                             "detokenize=True to use stop")
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict or None, got {self.extra_args!r}")
        if self.logits_processors:
            raise ValueError("logits_processors are not supported per request (nor by vLLM's V1 engine): "
                             "allowed_token_ids, logit_bias, bad_words and structured_outputs change the logits")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.n > 1 and self.temperature == 0:
            raise ValueError(f"n must be 1 when sampling greedily (temperature 0), got {self.n}: the "
                             "completions would all be the same")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def completion(self, index: int) -> "SamplingParams":
        """The parameters of completion `index` of n: one sequence, its own seed where there is
        one (as vLLM's ParentRequest gives its children). The first alone computes the prompt's
        log-probabilities: the others may then take the prompt from the prefix cache."""
        return dataclasses.replace(self, n=1, seed=None if self.seed is None else self.seed + index,
                                   prompt_logprobs=self.prompt_logprobs if index == 0 else None)

    @property
    def penalized(self) -> bool:
        """Does a penalty change this request's logits (so the sampler needs its tokens so far)?"""
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1.0


def check_truncate_prompt_tokens(k) -> None:
    """A ValueError unless k is None, -1 (max_model_len) or an integer >= 1 (vLLM's range); whether
    it exceeds max_model_len is the engine's to say (RequestLimits)."""
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or (k < 1 and k != -1)):
        raise ValueError(f"truncate_prompt_tokens must be an integer >= 1, or -1 (max_model_len), got {k!r}")


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_float32(value: int | float) -> float:
    """The value as the device holds it: a number that rounds to 0 or overflows float32 there
    (1e-46, 1e39, 10**400) reads as 0 or inf here, so that it is refused, not sampled with."""
    try:
        with np.errstate(over="ignore"):
            return float(np.float32(value))
    except OverflowError:
        return math.inf


def _as_list(value, name: str) -> list:
    """None means none, as in vLLM, whose default it is. Copied before the caller checks the items,
    so that checking does not use up a generator."""
    if value is None:
        return []
    try:
        return list(value)
    except TypeError:
        raise ValueError(f"{name} must be a list or None, got {value!r}") from None
