"""Token sampling: argmax at temperature 0, otherwise the exponential race.

argmax_i p_i / E_i with E_i ~ Exp(1) draws i with probability p_i (the smallest of independent
exponentials E_i / p_i is the one with index i with probability p_i / sum p). It needs no
cumulative sum and no host synchronisation, and since p = softmax(l / T), it equals
argmax_i (l_i / T - log E_i): the softmax's normaliser never has to be computed.
"""
import torch


def exponential_noise_ref(num_rows: int, vocab_size: int, seeds: list[int | None],
                          device: torch.device) -> torch.Tensor:
    """Exp(1) noise, [num_rows, vocab_size]. A row with a seed draws from its own generator, so its
    sample depends on nothing but its logits and its seed; the others share the global generator."""
    noise = torch.empty(num_rows, vocab_size, device=device, dtype=torch.float32).exponential_()
    for row, seed in enumerate(seeds):
        if seed is not None:
            gen = torch.Generator(device=device).manual_seed(seed)
            noise[row].exponential_(generator=gen)
    return noise


def apply_top_k_top_p_ref(logits: torch.Tensor, top_k: torch.Tensor | None,
                          top_p: torch.Tensor | None) -> torch.Tensor:
    """Sets to -inf every logit outside each row's top-k and nucleus (top-p) sets.
    top_k <= 0 and top_p >= 1 leave a row unrestricted."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k <= 0, vocab, top_k).clamp(max=vocab)
        remove |= torch.arange(vocab, device=logits.device)[None, :] >= k[:, None]
    if top_p is not None:
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        remove |= mass_before >= top_p[:, None]     # the top token always survives: its mass_before is 0
    mask = torch.zeros_like(remove).scatter_(-1, sorted_idx, remove)
    return logits.masked_fill(mask, float("-inf"))


def sample_ref(logits: torch.Tensor, temperatures: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """logits [B, V] fp32 (already restricted by top-k/top-p), temperatures [B], noise Exp(1) [B, V]."""
    greedy = logits.argmax(-1)
    safe_t = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
    probs = (logits / safe_t[:, None]).softmax(-1)
    raced = (probs / noise).argmax(-1)
    return torch.where(temperatures > 0, raced, greedy)


# ---- Triton ----

from mini_engine.kernels.triton_utils import tl, triton  # noqa: E402


@triton.jit
def _sample_kernel(logits_ptr, temperatures_ptr, seeds_ptr, tokens_ptr, vocab_size, stride_logits,
                   BLOCK_V: tl.constexpr):
    """One program per row, one pass over the vocabulary in BLOCK_V chunks. Each lane keeps the best
    key it has seen and its column (strict > keeps the first, as torch.argmax does); the lanes are
    reduced once at the end. Greedy rows (temperature 0) race on the logits themselves; the others
    on l / T + Gumbel noise, -log(E) with E = -log(U) ~ Exp(1), where U = tl.rand(seed, column):
    the noise is a pure function of (seed, column), made in registers and never stored. -inf logits
    stay -inf, so masked tokens never win."""
    row = tl.program_id(0).to(tl.int64)
    temperature = tl.load(temperatures_ptr + row)
    seed = tl.load(seeds_ptr + row)
    inv_temperature = 1.0 / tl.where(temperature > 0.0, temperature, 1.0)
    best_key = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_col = tl.zeros([BLOCK_V], tl.int32)
    for start in range(0, vocab_size, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < vocab_size
        key = tl.load(logits_ptr + row * stride_logits + cols, mask=mask, other=float("-inf"))
        if temperature > 0.0:
            exp_noise = -tl.log(tl.rand(seed, cols))         # Exp(1); inf when U == 0: key -inf
            key = key * inv_temperature - tl.log(exp_noise)
        better = key > best_key
        best_key = tl.where(better, key, best_key)
        best_col = tl.where(better, cols, best_col)
    top = tl.max(best_key, axis=0)
    token = tl.min(tl.where(best_key == top, best_col, vocab_size), axis=0)   # first column among ties
    tl.store(tokens_ptr + row, token.to(tl.int64))


def sample(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """Fused sample_ref with in-kernel noise: logits [B, V] fp32, temperatures [B] fp32 (0 = greedy),
    seeds [B] int64 (< 2**31; each row's random stream for this step) -> tokens [B] int64. The same
    (logits, temperature, seed) always gives the same token. A row of all -inf returns column 0."""
    assert logits.stride(-1) == 1
    num_rows, vocab_size = logits.shape
    tokens = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows:
        block_v = min(triton.next_power_of_2(vocab_size), 4096)
        _sample_kernel[(num_rows,)](logits, temperatures, seeds, tokens, vocab_size, logits.stride(0),
                                    BLOCK_V=block_v, num_warps=8)
    return tokens
