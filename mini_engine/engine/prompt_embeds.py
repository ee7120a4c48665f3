"""Prompts given as their embeddings (vLLM's enable_prompt_embeds, {"prompt_embeds": tensor}): a
soft prompt, or an encoder's output projected into the model's embedding space, goes in where the
embedding table's rows would.

Such a prompt has no token ids. The engine gives it placeholder ids (PLACEHOLDER_TOKEN, one a
position), so that everything that counts tokens (the scheduler's budget, block tables, max_model_len)
works unchanged, and each step's rows of it carry their embeddings (BatchRow.prompt_embeds), which
the model writes over the placeholders' (Qwen3ForCausalLM.forward). What would read the placeholders
as tokens is refused or kept away from them: prompt_logprobs and repetition_penalty (they read the
prompt's tokens), speculative decoding (its drafts follow the prompt's tokens), and the prefix cache's
hashes, whose keys hold each block's digest of its embeddings beside its placeholder ids
(BlockDigests, Sequence.block_extra), as vLLM's do: two such prompts share the blocks of their common
start, and none of a token prompt's. With a reasoning_parser, whether such a prompt opened a thought
cannot be read from it: the engine takes it as a prompt that did not.

The embeddings are copied, cast to the model's dtype (what the model reads; and half an fp32
caller's bytes for a bf16 model) and checked finite in that dtype. Between the server's processes
they travel as bytes (as_message), not as tensors, which torch would share through a file
descriptor each for as long as the request lives."""
import base64
import binascii
import hashlib
import io
from dataclasses import dataclass, field

import torch

from mini_engine.pooling_params import truncate_prompt
from mini_engine.sampling_params import SamplingParams

PLACEHOLDER_TOKEN = 0


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def conflicting_field(params) -> str | None:
    """The request field that reads the prompt's tokens, which a prompt given as embeddings has not
    (None: none does); conflict_message says why."""
    if params.prompt_logprobs is not None:
        return "prompt_logprobs"
    if params.repetition_penalty != 1.0:
        return "repetition_penalty"
    return None


def conflict_message(name: str) -> str:
    advice = ": use presence_penalty or frequency_penalty (the output's alone)" if name == "repetition_penalty" else ""
    return f"{name} reads the prompt's tokens, which a prompt given as embeddings has not{advice}"


def check_prompt_embeds(prompt_embeds, params, hidden_size: int, max_model_len: int,
                        dtype: torch.dtype | None) -> torch.Tensor:
    """The prompt's embeddings as the engine keeps them: a copy, [n, hidden] on the host in dtype (the
    model's; RequestLimits.prompt_embeds_dtype, None for an engine started without
    enable_prompt_embeds), cut to the request's truncate_prompt_tokens. ValueError (TypeError for
    what is not a tensor) for a prompt or request that cannot run."""
    if dtype is None:
        raise ValueError("prompt_embeds needs an engine started with enable_prompt_embeds=True (vLLM's option)")
    if not isinstance(prompt_embeds, torch.Tensor):
        raise TypeError(f"prompt_embeds must be a torch.Tensor of [num_tokens, hidden_size], got "
                        f"{type(prompt_embeds).__name__}")
    if prompt_embeds.layout != torch.strided or prompt_embeds.dtype not in FLOAT_DTYPES:
        raise ValueError(f"prompt_embeds must be a dense tensor of {[str(d) for d in FLOAT_DTYPES]}, got "
                         f"{prompt_embeds.dtype} ({prompt_embeds.layout})")
    if prompt_embeds.dim() == 3 and prompt_embeds.shape[0] == 1:
        prompt_embeds = prompt_embeds[0]            # a batch of one, as a model's inputs_embeds are shaped
    if prompt_embeds.dim() != 2 or prompt_embeds.shape[1] != hidden_size or prompt_embeds.shape[0] == 0:
        raise ValueError(f"prompt_embeds must be [num_tokens >= 1, hidden_size={hidden_size}], got "
                         f"{list(prompt_embeds.shape)}")
    if not isinstance(params, SamplingParams):
        raise ValueError("prompt_embeds are a generating engine's prompts (SamplingParams)")
    if (name := conflicting_field(params)) is not None:
        raise ValueError(conflict_message(name))
    kept = truncate_prompt(prompt_embeds, params, max_model_len).detach()
    # A copy: the caller's tensor may change after the request is added, under the digest taken now.
    embeds = kept.to("cpu", dtype=dtype, copy=True).contiguous()
    if not torch.isfinite(embeds).all():
        raise ValueError(f"prompt_embeds hold a value that is not finite in the model's dtype ({dtype})")
    return embeds


def as_message(embeds: torch.Tensor) -> tuple[bytes, str, tuple[int, ...]]:
    """Embeddings as plain bytes, for a queue between processes (from_message takes them back)."""
    return embeds.view(torch.uint8).numpy().tobytes(), str(embeds.dtype).removeprefix("torch."), tuple(embeds.shape)


def from_message(message: tuple[bytes, str, tuple[int, ...]]) -> torch.Tensor:
    data, dtype, shape = message
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)


def prompt_embeds_digest(embeds: torch.Tensor) -> str:
    return hashlib.sha256(str(embeds.dtype).encode() + embeds.view(torch.uint8).numpy().tobytes()).hexdigest()


@dataclass
class BlockDigests:
    """Block i's digest of a prompt's embeddings (rows i * block_size on, within the prompt; None
    past it): what, beside its placeholder ids, the block's K and V depend on, and so what its
    prefix-cache key holds (block_manager.chained_blocks). Each computed once, when first asked."""
    embeds: torch.Tensor
    block_size: int
    digests: dict[int, str | None] = field(default_factory=dict)

    def __call__(self, i: int) -> str | None:
        if i not in self.digests:
            rows = self.embeds[i * self.block_size:(i + 1) * self.block_size]
            self.digests[i] = prompt_embeds_digest(rows.contiguous()) if len(rows) else None
        return self.digests[i]


def decode_prompt_embeds(value: str) -> torch.Tensor:
    """The server's prompt_embeds field, as vLLM's: base64 of torch.save(tensor), loaded with
    weights_only (a pickle of anything else is refused, not run)."""
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise ValueError("prompt_embeds must be base64 (of torch.save(tensor))") from None
    try:
        embeds = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:      # any unpickling failure: the client's bytes, not the server's fault
        raise ValueError(f"prompt_embeds do not hold a torch.save'd tensor ({type(e).__name__})") from None
    if not isinstance(embeds, torch.Tensor):
        raise ValueError(f"prompt_embeds must hold one tensor, got {type(embeds).__name__}")
    return embeds
