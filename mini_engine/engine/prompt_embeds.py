"""Prompts given as their embeddings (vLLM's enable_prompt_embeds, {"prompt_embeds": tensor}): a
soft prompt, or an encoder's output projected into the model's embedding space, goes in where the
embedding table's rows would.

Such a prompt has no token ids. The engine gives it placeholder ids (PLACEHOLDER_TOKEN, one a
position), so that everything that counts tokens (the scheduler's budget, block tables, max_model_len)
works unchanged, and each step's rows of it carry their embeddings (BatchRow.prompt_embeds), which
the model writes over the placeholders' (Qwen3ForCausalLM.forward). What would read the placeholders
as tokens is refused or kept away from them: prompt_logprobs and repetition_penalty (they read the
prompt's tokens), speculative decoding (its drafts follow the prompt's tokens), and the prefix cache's
hashes, which a digest of the embeddings roots (Sequence.cache_root), so that two prompts share
blocks only where their embeddings are the same."""
import base64
import binascii
import hashlib
import io

import torch

from mini_engine.pooling_params import truncate_prompt
from mini_engine.sampling_params import SamplingParams

PLACEHOLDER_TOKEN = 0


def check_prompt_embeds(prompt_embeds, params, hidden_size: int, max_model_len: int, enabled: bool) -> torch.Tensor:
    """The prompt's embeddings as the engine keeps them: [n, hidden] on the host, contiguous, cut to
    the request's truncate_prompt_tokens. ValueError (TypeError for what is not a tensor) for a
    prompt or request that cannot run."""
    if not enabled:
        raise ValueError("prompt_embeds needs an engine started with enable_prompt_embeds=True (vLLM's option)")
    if not isinstance(prompt_embeds, torch.Tensor):
        raise TypeError(f"prompt_embeds must be a torch.Tensor of [num_tokens, hidden_size], got "
                        f"{type(prompt_embeds).__name__}")
    if prompt_embeds.dim() == 3 and prompt_embeds.shape[0] == 1:
        prompt_embeds = prompt_embeds[0]            # a batch of one, as a model's inputs_embeds are shaped
    if prompt_embeds.dim() != 2 or prompt_embeds.shape[1] != hidden_size or prompt_embeds.shape[0] == 0:
        raise ValueError(f"prompt_embeds must be [num_tokens >= 1, hidden_size={hidden_size}], got "
                         f"{list(prompt_embeds.shape)}")
    if not prompt_embeds.is_floating_point():
        raise ValueError(f"prompt_embeds must be floating point, got {prompt_embeds.dtype}")
    if not isinstance(params, SamplingParams):
        raise ValueError("prompt_embeds are a generating engine's prompts (SamplingParams)")
    if params.prompt_logprobs is not None:
        raise ValueError("prompt_logprobs need the prompt's token ids, which a prompt given as embeddings has not")
    if params.repetition_penalty != 1.0:
        raise ValueError("repetition_penalty counts the prompt's tokens, which a prompt given as embeddings has "
                         "not: use presence_penalty or frequency_penalty (the output's alone)")
    embeds = truncate_prompt(prompt_embeds, params, max_model_len).detach().to("cpu").contiguous()
    if not torch.isfinite(embeds).all():
        raise ValueError("prompt_embeds hold a value that is not finite")
    return embeds


def prompt_embeds_digest(embeds: torch.Tensor) -> str:
    """What the prefix cache's hashes of a prompt of these embeddings chain from."""
    return hashlib.sha256(str(embeds.dtype).encode() + embeds.view(torch.uint8).numpy().tobytes()).hexdigest()


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
