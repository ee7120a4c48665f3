from dataclasses import dataclass, replace

import torch
from torch import nn

from mini_engine.kernels.sampling import apply_top_k_top_p, exponential_noise_ref, sample_ref
from mini_engine.kernels.top_k_sampling import TOP_K_MAX, sample_top_k
from mini_engine.layers.penalties import (PenaltyTensors, apply_grammar_bitmask, apply_logit_bias, apply_min_p,
                                         apply_penalties, ban_tokens, keep_allowed_tokens)


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
    banned: tuple[torch.Tensor, torch.Tensor] | None = None    # (rows, tokens) that min_tokens or bad words hold back
    min_p: torch.Tensor | None = None         # [B] fp32, where a row sets min_p
    allowed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None   # (rows, pair rows, tokens) of allowed_token_ids
    grammar: tuple[torch.Tensor, torch.Tensor] | None = None    # (rows, their bitmasks) of structured outputs
    # The Triton sampler's rows with 1 <= top_k <= TOP_K_MAX (candidate_top_k; 0 elsewhere), drawn
    # by sample_top_k with their top_p after the others. top_k and top_p above hold theirs only
    # where another row needs a restriction (ModelRunner.sampling_tensors).
    candidate_top_k: torch.Tensor | None = None   # [B] int32
    candidate_top_p: torch.Tensor | None = None   # [B] fp32
    # Custom logits processors (mini_engine/logits_processors.py), their batch updated for this step.
    processors: object | None = None


def candidate_top_k(params) -> int:
    """A sampling row's top_k where the Triton sampler draws it from its best TOP_K_MAX logits
    (kernels/top_k_sampling.py), in CUDA graphs too; 0 where it does not (greedy, no top-k, or a
    top-k above TOP_K_MAX, which apply_top_k_top_p takes)."""
    return params.top_k if params.temperature > 0 and 1 <= params.top_k <= TOP_K_MAX else 0


def needs_top_k_top_p(params, candidates: bool = True) -> bool:
    """Does a row need apply_top_k_top_p: a sampling row with a top-k or a top-p that the Triton
    sampler does not draw from its best logits (candidates: that sampler is on)? Greedy rows never
    do: the argmax is the same."""
    return params.temperature > 0 and (params.top_k > 0 or params.top_p < 1.0) and \
        not (candidates and candidate_top_k(params))


@dataclass(slots=True)
class SampleLogprobs:
    """A token's log-probability and its row's most likely tokens, best first (and, for a prompt
    token, its rank in the row: 1 is the likeliest)."""
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None


# Prompt positions whose logits are made at once for prompt_logprobs: [256, 151,936] fp32 is no
# larger than what the sampler's warm-up allocates (ModelRunner.warmup_batches), which the KV
# pool was sized around.
PROMPT_LOGPROB_ROWS = 256


def prompt_logprob_tensors(compute_logits, hidden: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor,
                           k: int) -> list[torch.Tensor]:
    """Log-softmax of the logits at the step's token positions `positions` (flat indices into
    hidden), in groups of PROMPT_LOGPROB_ROWS: each one's target token's log-probability and rank,
    and its k best (values, then ids), on the device."""
    parts = []
    for start in range(0, positions.shape[0], PROMPT_LOGPROB_ROWS):
        rows = slice(start, start + PROMPT_LOGPROB_ROWS)
        logprobs = torch.log_softmax(compute_logits(hidden[positions[rows]]).float(), dim=-1)
        target = logprobs.gather(-1, targets[rows][:, None])
        rank = (logprobs > target).sum(-1) + 1
        parts.append([target.squeeze(-1), rank, *logprobs.topk(k, dim=-1)])
    return [torch.cat(column) for column in zip(*parts)]


def prompt_logprobs_by_row(counts: list[int], num_top: list[int], target: list[float], rank: list[int],
                           top_values: list[list[float]], top_ids: list[list[int]]) -> list[list[SampleLogprobs]]:
    """prompt_logprob_tensors' results on the host, split into rows of counts[j] positions, each
    with num_top[j] best."""
    out, start = [], 0
    for count, n in zip(counts, num_top):
        out.append([SampleLogprobs(target[i], list(zip(top_ids[i][:n], top_values[i][:n])), rank[i])
                    for i in range(start, start + count)])
        start += count
    return out


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


def apply_after_temperature(logits: torch.Tensor, params: SamplingTensors) -> tuple[torch.Tensor, SamplingTensors]:
    """The argmax-invariant custom processors, on the logits divided by each sampled row's
    temperature (a greedy row's are left as they are, and so is its argmax), as vLLM runs them;
    the rows are then drawn at temperature 1 (0 for greedy ones), the division done."""
    t = params.temperatures
    logits = logits / torch.where(t > 0, t, 1.0).unsqueeze(1)
    logits = params.processors.apply(params.processors.argmax_invariant, logits)
    return logits, replace(params, temperatures=(t > 0).to(t.dtype))


class Sampler(nn.Module):
    def __init__(self, use_triton: bool = False, generator: torch.Generator | None = None):
        super().__init__()
        self.use_triton = use_triton
        self.generator = generator      # unseeded rows' noise (the PyTorch path); None: torch's global one

    def forward(self, logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
        if any(x is not None for x in (params.grammar, params.allowed, params.logit_bias, params.banned,
                                       params.penalties, params.min_p, params.processors)):
            # One fp32 copy, changed in place from here on (the raw logits stay, for logprobs), in
            # vLLM's order: a grammar's mask, allowed_token_ids, then logit_bias and the bans of
            # min_tokens and bad words, then custom processors that may change an argmax, then
            # penalties (greedy rows too), then min_p at the row's temperature, then the other
            # custom processors on the logits divided by temperature, then top-k and top-p.
            logits = logits.float() if logits.dtype != torch.float32 else logits.clone()
            if params.grammar is not None:
                apply_grammar_bitmask(logits, params.grammar)
            if params.allowed is not None:
                keep_allowed_tokens(logits, params.allowed)
            if params.logit_bias is not None:
                apply_logit_bias(logits, params.logit_bias)
            if params.banned is not None:
                ban_tokens(logits, params.banned)
            if params.processors is not None:
                logits = params.processors.apply(params.processors.others, logits)
            if params.penalties is not None:
                apply_penalties(logits, params.penalties, self.use_triton)
                # A repetition penalty as small as vLLM allows (any above 0) can divide a logit past
                # fp32's range, and +inf would give a row NaN weights (inf - inf) in every sampler.
                logits.clamp_(max=torch.finfo(torch.float32).max)
            if params.min_p is not None:
                apply_min_p(logits, params.min_p, params.temperatures)
            if params.processors is not None and params.processors.argmax_invariant:
                logits, params = apply_after_temperature(logits, params)
        if self.use_triton and params.candidate_top_k is not None:
            # The other rows first, then the top-k rows redrawn from the same (modified) logits.
            tokens = self.draw(logits, params)
            sample_top_k(logits, params.temperatures, params.candidate_top_k, params.candidate_top_p, params.seeds,
                         out=tokens)
            return tokens
        return self.draw(logits, params)

    def draw(self, logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
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
        noise = exponential_noise_ref(logits.shape[0], logits.shape[1], params.row_seeds, logits.device,
                                      self.generator)
        return sample_ref(logits, temperatures, noise)
