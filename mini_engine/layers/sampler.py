from dataclasses import dataclass

import torch
from torch import nn

from mini_engine.kernels.sampling import apply_top_k_top_p, exponential_noise_ref, sample_ref
from mini_engine.layers.penalties import (PenaltyTensors, apply_logit_bias, apply_min_p, apply_penalties, ban_tokens,
                                         keep_allowed_tokens)


@dataclass
class SamplingTensors:
    """Per-row sampling parameters for one step, on the device."""

    temperatures: torch.Tensor        # [B] fp32, 0 = greedy
    top_k: torch.Tensor | None        # [B] int64, or None when no row restricts top-k
    top_p: torch.Tensor | None        # [B] fp32, or None when no row restricts top-p
    seeds: torch.Tensor               # [B] int64: per-row random stream for this step
    row_seeds: list[int | None]       # host copy; None where the request gave no seed
    all_greedy: bool
    row_top_k: list[int] | None = None    # top_k's host copy (0: none), where top_k is given
    penalties: PenaltyTensors | None = None   # where a row has presence/frequency/repetition penalties;
                                              # the runner records the sampled tokens in their counts
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None   # (rows, tokens, biases)
    banned: tuple[torch.Tensor, torch.Tensor] | None = None    # (rows, tokens) that min_tokens holds back
    min_p: torch.Tensor | None = None         # [B] fp32, where a row sets min_p
    allowed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None   # (rows, pair rows, tokens) of allowed_token_ids


@dataclass(slots=True)
class SampleLogprobs:
    """A sampled token's log-probability and its row's most likely tokens, best first."""
    logprob: float
    top: list[tuple[int, float]]


def logprob_tensors(tokens: torch.Tensor, logits: torch.Tensor, rows: torch.Tensor, k: int) -> list[torch.Tensor]:
    """Log-softmax of the raw logits of the sampling rows `rows` (before penalties and
    temperature, as vLLM reports them), on the device: each row's sampled token's, and its k
    best (values, then token ids)."""
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
    sampled = logprobs.gather(-1, tokens[rows][:, None]).squeeze(-1)
    top_values, top_ids = logprobs.topk(k, dim=-1)          # k may be 0: the sampled token alone
    return [sampled, top_values, top_ids]


def sample_logprobs(num_rows: int, rows: list[int], num_top: list[int], sampled: list[float],
                    top_values: list[list[float]], top_ids: list[list[int]]) -> list[SampleLogprobs | None]:
    """logprob_tensors' results on the host, as one SampleLogprobs per sampling row that asked
    (num_top[j] best for row rows[j]) and None for the others."""
    out: list[SampleLogprobs | None] = [None] * num_rows
    for j, (row, n) in enumerate(zip(rows, num_top)):
        out[row] = SampleLogprobs(sampled[j], list(zip(top_ids[j][:n], top_values[j][:n])))
    return out


class Sampler(nn.Module):
    def __init__(self, use_triton: bool = False):
        super().__init__()
        self.use_triton = use_triton

    def forward(self, logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
        if any(x is not None for x in (params.allowed, params.logit_bias, params.banned, params.penalties,
                                       params.min_p)):
            # One fp32 copy, changed in place from here on (the raw logits stay, for logprobs), in
            # vLLM's order: allowed_token_ids, then logit_bias and min_tokens' ban, then penalties
            # (greedy rows too), then min_p at the row's temperature, then top-k and top-p.
            logits = logits.float() if logits.dtype != torch.float32 else logits.clone()
            if params.allowed is not None:
                keep_allowed_tokens(logits, params.allowed)
            if params.logit_bias is not None:
                apply_logit_bias(logits, params.logit_bias)
            if params.banned is not None:
                ban_tokens(logits, params.banned)
            if params.penalties is not None:
                apply_penalties(logits, params.penalties, self.use_triton)
            if params.min_p is not None:
                apply_min_p(logits, params.min_p, params.temperatures)
        if self.use_triton and params.top_k is None and params.top_p is None:
            # No fp32 copy of the logits: the kernel converts bf16 as it loads, and argmax is exact
            # in any float dtype (bf16 -> fp32 is exact and keeps the order).
            from mini_engine.kernels.sampling import sample
            return logits.argmax(-1) if params.all_greedy else sample(logits, params.temperatures, params.seeds)
        if params.all_greedy:
            return logits.argmax(-1)
        if params.top_k is not None or params.top_p is not None:
            # Temperature first, as vLLM does, so top-p's nucleus is that of the scaled distribution.
            t = params.temperatures
            logits = apply_top_k_top_p(logits, params.top_k, params.top_p, params.row_top_k, t)
            temperatures = torch.where(t > 0, 1.0, 0.0)
        else:
            logits, temperatures = logits.float(), params.temperatures
        if self.use_triton:
            from mini_engine.kernels.sampling import sample
            return sample(logits, temperatures, params.seeds)
        noise = exponential_noise_ref(logits.shape[0], logits.shape[1], params.row_seeds, logits.device)
        return sample_ref(logits, temperatures, noise)
