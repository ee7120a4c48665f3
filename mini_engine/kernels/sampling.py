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


# Noise bounds. tl.rand4x gives U in [0, 1 - 2**-24]; U == 0 would make the noise -inf and the
# column's key -inf, so that a row whose only finite logit drew U == 0 would fall back to a masked
# column. Clamping U into [2**-32, 1 - 2**-24] keeps -log2(U) in [8.6e-8, 32], so the noise is always
# finite: a -inf logit always gives a -inf key, a finite one never does, and no key is NaN.
_U_MIN, _U_MAX = 2.0 ** -32, 1.0 - 2.0 ** -24


@triton.jit
def _gumbel2(u, U_MIN: tl.constexpr, U_MAX: tl.constexpr):
    """-log2(-log2(U)): Gumbel noise in base-2 units."""
    u = tl.minimum(tl.maximum(u, U_MIN), U_MAX)
    return -tl.math.log2(-tl.math.log2(u))


@triton.jit
def _race(best_key, best_col, row_ptr, cols, vocab_size, scale, noise):
    key = tl.load(row_ptr + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32) * scale + noise
    better = key > best_key
    return tl.where(better, key, best_key), tl.where(better, cols, best_col)


@triton.jit
def _sample_chunk_kernel(logits_ptr, temperatures_ptr, seeds_ptr, partial_keys_ptr, partial_cols_ptr,
                         vocab_size, stride_logits, num_chunks, U_MIN: tl.constexpr, U_MAX: tl.constexpr,
                         CHUNK_V: tl.constexpr, BLOCK_V: tl.constexpr):
    """Program (row, chunk) races columns [chunk * CHUNK_V, (chunk + 1) * CHUNK_V) of one row and
    writes the winner's key and column to partial_*[row, chunk]. Splitting the vocabulary is what
    makes the kernel fast: one program per row leaves a B=1 step with one busy SM walking 152k
    columns, and the noise below is most of the work, so it has to be spread.

    The key: greedy rows (temperature 0) race on the logits themselves; the others on
    l * log2(e) / T - log2(-log2(U)) (a Gumbel race in base 2: it differs from l / T - log(E),
    E = -log(U) ~ Exp(1), by a positive factor and a constant, which keep the argmax). The noise is
    a pure function of (seed, column), made in registers and never stored, so the token does not
    depend on how the vocabulary is split: column 4i + j takes the j-th of the four uniforms of
    Philox(seed, counter i): one Philox call makes four numbers (on the H200, at 256 rows x 152k
    columns, 194 -> 148 us against one call a column).
    Each lane keeps the best key it has seen (strict >: its first column among ties, as
    torch.argmax); the lanes are reduced at the end to the smallest column holding the top key."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature = tl.load(temperatures_ptr + row)
    seed = tl.load(seeds_ptr + row)
    # Greedy rows keep scale 1: their keys are the logits, so ties stay ties and argmax is exact.
    scale = tl.where(temperature > 0.0, 1.4426950408889634 / tl.where(temperature > 0.0, temperature, 1.0), 1.0)
    best_key = tl.full([BLOCK_V // 4], float("-inf"), tl.float32)
    best_col = tl.zeros([BLOCK_V // 4], tl.int32)
    row_ptr = logits_ptr + row * stride_logits
    chunk_start = chunk * CHUNK_V
    for start in range(chunk_start, tl.minimum(chunk_start + CHUNK_V, vocab_size), BLOCK_V):
        counters = start // 4 + tl.arange(0, BLOCK_V // 4)
        if temperature > 0.0:
            u0, u1, u2, u3 = tl.rand4x(seed, counters)
            g0, g1 = _gumbel2(u0, U_MIN, U_MAX), _gumbel2(u1, U_MIN, U_MAX)
            g2, g3 = _gumbel2(u2, U_MIN, U_MAX), _gumbel2(u3, U_MIN, U_MAX)
        else:
            g0 = tl.zeros([BLOCK_V // 4], tl.float32)
            g1, g2, g3 = g0, g0, g0
        # Ascending columns within each lane, so strict > keeps a lane's first column among ties.
        best_key, best_col = _race(best_key, best_col, row_ptr, 4 * counters, vocab_size, scale, g0)
        best_key, best_col = _race(best_key, best_col, row_ptr, 4 * counters + 1, vocab_size, scale, g1)
        best_key, best_col = _race(best_key, best_col, row_ptr, 4 * counters + 2, vocab_size, scale, g2)
        best_key, best_col = _race(best_key, best_col, row_ptr, 4 * counters + 3, vocab_size, scale, g3)
    top = tl.max(best_key, axis=0)
    col = tl.min(tl.where(best_key == top, best_col, vocab_size), axis=0)     # all -inf: column 0
    tl.store(partial_keys_ptr + row * num_chunks + chunk, top)
    tl.store(partial_cols_ptr + row * num_chunks + chunk, col)


@triton.jit
def _sample_reduce_kernel(partial_keys_ptr, partial_cols_ptr, tokens_ptr, num_chunks,
                          BLOCK_CHUNKS: tl.constexpr):
    """One program per row: the token is the smallest column among the chunks holding the top key
    (each chunk's column is already its smallest among its ties), so ties go to the lowest column
    wherever the chunk boundaries fall."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_CHUNKS)
    mask = offs < num_chunks
    keys = tl.load(partial_keys_ptr + row * num_chunks + offs, mask=mask, other=float("-inf"))
    cols = tl.load(partial_cols_ptr + row * num_chunks + offs, mask=mask, other=2**31 - 1)
    top = tl.max(keys, axis=0)
    token = tl.min(tl.where(keys == top, cols, 2**31 - 1), axis=0)
    tl.store(tokens_ptr + row, token.to(tl.int64))


_BLOCK_V = 1024                 # columns per loop step: 8 per thread at 4 warps


# Columns per program. A constant, not a function of the batch: every CHUNK_V compiles its own
# kernel, and a step that met a new one mid-run paid ~0.6 s of compilation (measured on the
# H200). Qwen3's 152k vocabulary makes 75 programs for one row, 19,200 for 256.
SAMPLE_CHUNK_SIZE = 2 * _BLOCK_V


def sample(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
           chunk_size: int | None = None) -> torch.Tensor:
    """Fused sample_ref with in-kernel noise: logits [B, V] fp32, bf16 or fp16, temperatures [B]
    fp32 (0 = greedy), seeds [B] int64 (< 2**31; each row's random stream for this step) -> tokens
    [B] int64. The same (logits, temperature, seed) always gives the same token, whatever the
    chunking; a row of all -inf returns column 0. chunk_size (a power of two; tests use it to move
    the chunk boundaries) defaults to SAMPLE_CHUNK_SIZE. No host synchronisation and a grid from
    shapes alone, so it can be captured in a CUDA graph."""
    assert logits.stride(-1) == 1
    num_rows, vocab_size = logits.shape
    tokens = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return tokens
    chunk_v = chunk_size or SAMPLE_CHUNK_SIZE
    block_v = min(chunk_v, _BLOCK_V)
    assert chunk_v % block_v == 0 and block_v == triton.next_power_of_2(block_v)
    num_chunks = triton.cdiv(vocab_size, chunk_v)
    partial_keys = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=logits.device)
    partial_cols = torch.empty(num_rows, num_chunks, dtype=torch.int32, device=logits.device)
    _sample_chunk_kernel[(num_rows, num_chunks)](
        logits, temperatures, seeds, partial_keys, partial_cols, vocab_size, logits.stride(0), num_chunks,
        U_MIN=_U_MIN, U_MAX=_U_MAX, CHUNK_V=chunk_v, BLOCK_V=block_v, num_warps=4)
    _sample_reduce_kernel[(num_rows,)](partial_keys, partial_cols, tokens, num_chunks,
                                       BLOCK_CHUNKS=max(triton.next_power_of_2(num_chunks), 32), num_warps=1)
    return tokens
