"""What a request may ask of an engine. Checked from the engine's fixed configuration alone, so
that the API server, in another process than the engine, rejects a bad request before sending it."""
from dataclasses import dataclass

import numpy as np
import torch

from mini_engine.pooling_params import PoolingParams
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
    # An embedding engine's (runner "pooling"): its requests carry PoolingParams, whose dimensions
    # may cut a Matryoshka model's vector (to one of matryoshka_dimensions, where config.json lists them).
    pooling: bool = False
    hidden_size: int = 0
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    # With enable_prompt_embeds: the model's dtype, which prompt embeddings are cast to
    # (engine/prompt_embeds.py); None without.
    prompt_embeds_dtype: torch.dtype | None = None
    # EngineConfig.logits_processors' classes, whose validate_params checks each request.
    logits_processors: tuple[type, ...] = ()

    def max_sequence_tokens(self) -> int:
        """The longest sequence (prompt and output) that max_model_len and the KV pool allow. Its
        last sampled token is never computed, so it holds one slot fewer than its tokens."""
        return min(self.max_model_len, self.num_blocks * self.block_size + 1)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError (TypeError for params of the wrong kind: SamplingParams for a generating
        engine, PoolingParams for a pooling one) for a request that could never run."""
        if self.pooling:
            self.validate_pooling(prompt_token_ids, params)
            return
        if isinstance(params, PoolingParams):
            raise TypeError("an embedding request (PoolingParams) needs an engine started with runner='pooling'")
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
        for processor in self.logits_processors:
            try:
                processor.validate_params(params)
            except ValueError:
                raise
            except Exception as e:      # the user's code: still this request's error, not the server's
                raise ValueError(f"logits processor {processor.__name__}: {type(e).__name__}: {e}") from e
        n = len(prompt_token_ids)
        self.check_token_ids(prompt_token_ids)
        self.check_truncation(params.truncate_prompt_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > min(self.max_logprobs, self.vocab_size):
                raise ValueError(f"{name}={value} asks for more top tokens than the engine's max_logprobs="
                                 f"{self.max_logprobs} (and the vocabulary's {self.vocab_size}) allow")
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise ValueError(f"logit_bias names token id {max(params.logit_bias)}, outside the vocabulary of "
                             f"{self.vocab_size}")
        if params.stop_token_ids and max(params.stop_token_ids) >= self.vocab_size:
            # Never sampled, so never a stop; and min_tokens would ban an index past the logits.
            raise ValueError(f"stop_token_ids names token id {max(params.stop_token_ids)}, outside the vocabulary "
                             f"of {self.vocab_size}")
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
        # Its last sampled token is never computed: one slot fewer than its tokens, i.e. n + max_tokens
        # > max_sequence_tokens(), by the pool.
        self.check_pool_holds(n + params.max_tokens - 1)

    def check_pool_holds(self, num_slots: int) -> None:
        """A request whose KV needs num_slots slots at most, against the pool's whole size."""
        blocks = -(-num_slots // self.block_size)
        if blocks > self.num_blocks:
            raise ValueError(f"request needs {blocks} KV blocks but the pool holds {self.num_blocks}; "
                             "it could never run")

    def check_truncation(self, truncate_prompt_tokens: int | None) -> None:
        """As vLLM's: a cut longer than max_model_len (-1 is max_model_len itself) is refused, whatever
        the prompt's length, since it would not cut a prompt down to what the engine can run."""
        if truncate_prompt_tokens is not None and truncate_prompt_tokens > self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens={truncate_prompt_tokens} exceeds "
                             f"max_model_len={self.max_model_len}")

    def check_token_ids(self, prompt_token_ids: list[int]) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError("the prompt is empty")
        # One numpy pass, not a Python test per token: a mix of ints and anything else (floats,
        # strings, None) makes a float or object array.
        ids = np.asarray(prompt_token_ids)
        if ids.ndim != 1 or ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= self.vocab_size:
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")

    def validate_pooling(self, prompt_token_ids: list[int], params: PoolingParams) -> None:
        """An embedding request: its prompt (truncated already, where it asked) is computed whole,
        every token's k/v in the pool, and nothing is sampled after it."""
        if isinstance(params, SamplingParams):
            raise TypeError("this engine runs an embedding model (runner='pooling'): it takes PoolingParams "
                            "(LLM.embed, /v1/embeddings); generation needs runner='generate'")
        if not isinstance(params, PoolingParams):
            raise TypeError(f"pooling params must be PoolingParams, got {type(params).__name__}")
        self.check_token_ids(prompt_token_ids)
        n = len(prompt_token_ids)
        self.check_truncation(params.truncate_prompt_tokens)
        if n > self.max_model_len:
            raise ValueError(f"prompt of {n} tokens exceeds max_model_len={self.max_model_len} "
                             "(truncate_prompt_tokens keeps its last tokens)")
        self.check_pool_holds(n)                # every prompt token's k/v, nothing sampled after it
        d = params.dimensions
        if d is not None:
            if not self.is_matryoshka:
                raise ValueError("dimensions asks for a Matryoshka cut, and this model was not trained for one "
                                 "(config.json's is_matryoshka or matryoshka_dimensions; hf_overrides can set them)")
            if d > self.hidden_size or (self.matryoshka_dimensions and d not in self.matryoshka_dimensions):
                allowed = self.matryoshka_dimensions or f"1 to {self.hidden_size}"
                raise ValueError(f"dimensions={d} is not a cut this model allows: {allowed}")
