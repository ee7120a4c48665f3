"""What a request may ask of an engine. Checked from the engine's fixed configuration alone, so
that the API server, in another process than the engine, rejects a bad request before sending it."""
from dataclasses import dataclass

import numpy as np

from mini_engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int             # the KV pool's size, known once the engine has measured memory
    has_tokenizer: bool
    max_logprobs: int = 20      # EngineConfig.max_logprobs
    eos_token_ids: tuple[int, ...] = ()

    def max_sequence_tokens(self) -> int:
        """The longest sequence (prompt and output) that max_model_len and the KV pool allow. Its
        last sampled token is never computed, so it holds one slot fewer than its tokens."""
        return min(self.max_model_len, self.num_blocks * self.block_size + 1)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError (TypeError for params that are not SamplingParams) for a request that
        could never run."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if params.stop and not self.has_tokenizer:
            raise ValueError("stop strings need the checkpoint's tokenizer.json, which it does not have")
        if params.bad_words and not self.has_tokenizer:
            raise ValueError("bad_words need the checkpoint's tokenizer.json, which it does not have")
        if params.structured_outputs is not None:
            if not self.has_tokenizer:
                raise ValueError("structured outputs need the checkpoint's tokenizer.json, which it does not have")
            params.structured_outputs.check()
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        # One numpy pass, not a Python test per token: a mix of ints and anything else (floats,
        # strings, None) makes a float or object array.
        ids = np.asarray(prompt_token_ids)
        if ids.ndim != 1 or ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= self.vocab_size:
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > min(self.max_logprobs, self.vocab_size):
                raise ValueError(f"{name}={value} asks for more top tokens than the engine's max_logprobs="
                                 f"{self.max_logprobs} (and the vocabulary's {self.vocab_size}) allow")
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise ValueError(f"logit_bias names token id {max(params.logit_bias)}, outside the vocabulary of "
                             f"{self.vocab_size}")
        if params.allowed_token_ids and max(params.allowed_token_ids) >= self.vocab_size:
            raise ValueError(f"allowed_token_ids names token id {max(params.allowed_token_ids)}, outside the "
                             f"vocabulary of {self.vocab_size}")
        if params.allowed_token_ids and params.min_tokens and \
                set(params.allowed_token_ids) <= set(params.stop_token_ids) | set(self.eos_token_ids):
            # min_tokens bans them all: no token would be left to sample (argmax of -inf is token 0).
            raise ValueError(f"allowed_token_ids {params.allowed_token_ids} holds only stop tokens and EOS, which "
                             f"min_tokens={params.min_tokens} bans: nothing is left to sample")
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt of {n} tokens plus max_tokens={params.max_tokens} exceeds "
                             f"max_model_len={self.max_model_len}")
        blocks = -(-(n + params.max_tokens - 1) // self.block_size)
        if blocks > self.num_blocks:          # i.e. n + max_tokens > max_sequence_tokens(), by the pool
            raise ValueError(f"request needs {blocks} KV blocks but the pool holds {self.num_blocks}; "
                             "it could never run")
