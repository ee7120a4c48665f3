"""Top-k (and top-p within it) sampling from a row's TOP_K_MAX best logits, with no sort of the
vocabulary and no host work: what lets a CUDA graph sample Qwen3's own defaults (top_k 20,
top_p 0.95, in its generation_config.json) at decode speed.

torch.topk takes 382 us for [256, 151,936] bf16 logits on the H200 (40 us for one row), more than
the whole sampler's budget; so the best TOP_K_MAX columns are found in two kernels, neither of
which sorts more than TOP_K_MAX keys:

- _chunk_candidates_kernel, one program per (row, chunk of CHUNK columns): the chunk's TOP_K_MAX
  best, in column order.
- _sample_candidates_kernel, one program per row: the best TOP_K_MAX of the chunks' lists, sorted,
  then the row's top-k and nucleus among them and one draw.

Both select from a block the same way (_take_top): a binary search over the logits' bit patterns
(mapped to integers in the same order) finds the TOP_K_MAX-th largest logit v in 32 counting
passes over the block, held in registers; the block keeps every logit above v and, of those equal
to v, the first in block order, which is column order in both kernels. So ties go to the lower
column, as in the reference's stable sort. A key packs a logit and its column into one int64
(the larger logit first, then the lower column) for the one sort at the end.

The draw: the row's first top_k candidates (fewer where the row has fewer columns) at temperature
T, the nucleus cut where the mass before a candidate reaches top_p of the top-k mass (the first
candidate always stays), and the first candidate whose cumulative weight passes u x total, with
one uniform u from the row's seed, as kernels/sampling.py draws it. Only rows with 1 <= top_k and
T > 0 are drawn; the others keep the token already in `out` (greedy rows' argmax does not depend
on top-k or top-p)."""
import torch

from mini_engine.kernels.sampling import _uniform
from mini_engine.kernels.triton_utils import HAS_TRITON, tl, triton

# The largest top_k this sampler takes (and so a CUDA graph): Qwen3 asks for 20, Hugging Face's
# default is 50. A request with a larger top_k samples through apply_top_k_top_p, outside graphs.
TOP_K_MAX = 64
CHUNK = 4096          # columns a first-stage program reads: 38 programs a row at Qwen3's vocabulary
CHUNK_WARPS = ROW_WARPS = 8      # the two kernels' warps a program
MIN_KEY = -(2**63)    # below every key: padding
_MIN_KEY = tl.constexpr(MIN_KEY) if HAS_TRITON else MIN_KEY    # (a kernel reads only constexpr globals)


def candidate_keys_ref(logits: torch.Tensor) -> torch.Tensor:
    """The keys of each row's TOP_K_MAX best logits, best first: [B, TOP_K_MAX] int64 (the reference
    for the kernels' lists; padding MIN_KEY where a row has fewer columns)."""
    values, cols = logits.float().sort(dim=-1, descending=True, stable=True)
    values, cols = values[:, :TOP_K_MAX], cols[:, :TOP_K_MAX]
    bits = torch.where(values == 0, 0.0, values).view(torch.int32)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64)
    keys = (ordered << 32) | (0x7FFFFFFF - cols)
    pad = TOP_K_MAX - keys.shape[1]
    return torch.nn.functional.pad(keys, (0, pad), value=MIN_KEY) if pad else keys


def sample_top_k_ref(logits: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     u: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """sample_top_k's draw in PyTorch, in float64, from each row's uniform u (kernels/sampling.py's
    `uniforms`): out with the drawn rows replaced."""
    out = out.clone()
    values, cols = logits.double().sort(dim=-1, descending=True, stable=True)
    for row in range(logits.shape[0]):
        k, temperature = int(top_k[row]), float(temperatures[row])
        if k <= 0 or temperature <= 0:
            continue
        v, c = values[row, :k], cols[row, :k]
        weight = torch.exp((v - v[0]) / temperature) if v[0] > float("-inf") else torch.zeros_like(v)
        nucleus = (weight.cumsum(0) - weight) < float(top_p[row]) * weight.sum()
        nucleus[0] = True
        prefix = torch.where(nucleus, weight, 0.0).cumsum(0)
        passed = torch.nonzero(prefix > float(u[row]) * prefix[-1])
        out[row] = c[passed[0, 0]] if len(passed) else c[0]
    return out


def decode_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits fp32, columns int64) of candidate keys (padding gives NaN and column 2**31 - 1)."""
    ordered = (keys >> 32).to(torch.int32)
    bits = torch.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF)
    return bits.view(torch.float32), 0x7FFFFFFF - (keys & 0xFFFFFFFF)


@triton.jit
def _ordered(x):
    """fp32 logits as int32 in the same order (-0.0 as 0.0, as a sort has them)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _key(ordered, cols):
    """int64 keys: ordered as (logit, -column)."""
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - cols).to(tl.int64)


@triton.jit
def _take_top(ordered, valid, K: tl.constexpr):
    """Of a block's valid entries (ordered: _ordered logits), the K largest, ties to the earliest in
    the block: a mask with min(K, valid entries) set. The K-th largest value is found by a binary
    search over int32 (each step counts the entries at or above its midpoint); then every entry
    above it is taken, and as many equal to it as K leaves, first in block order."""
    low = tl.full([], -(2**31), tl.int64)         # count(>= low) >= K, or low is the smallest int32
    high = tl.full([], 2**31 - 1, tl.int64)       # the K-th largest is <= high
    for _ in range(32):
        mid = (low + high + 1) >> 1
        enough = tl.sum((valid & (ordered >= mid)).to(tl.int32), axis=0) >= K
        low = tl.where(enough, mid, low)
        high = tl.where(enough, high, mid - 1)
    above = valid & (ordered > low)
    equal = valid & (ordered == low)
    rank = tl.cumsum(equal.to(tl.int32), axis=0)
    return above | (equal & (rank <= K - tl.sum(above.to(tl.int32), axis=0)))


@triton.jit
def _chunk_candidates_kernel(logits_ptr, top_k_ptr, temperatures_ptr, candidates_ptr, vocab_size, stride_logits,
                             num_chunks, CHUNK: tl.constexpr, K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    if (tl.load(top_k_ptr + row) > 0) & (tl.load(temperatures_ptr + row) > 0.0):
        cols = chunk * CHUNK + tl.arange(0, CHUNK)
        in_row = cols < vocab_size
        ordered = _ordered(tl.load(logits_ptr + row * stride_logits + cols, mask=in_row, other=0.0).to(tl.float32))
        take = _take_top(ordered, in_row, K)
        out = candidates_ptr + (row * num_chunks + chunk) * K
        slot = tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(out + slot, _key(ordered, cols), mask=take)
        slots = tl.arange(0, K)
        tl.store(out + slots, tl.full([K], _MIN_KEY, tl.int64), mask=slots >= tl.sum(take.to(tl.int32), axis=0))


@triton.jit
def _sample_candidates_kernel(candidates_ptr, best_ptr, top_k_ptr, top_p_ptr, temperatures_ptr, seeds_ptr,
                              tokens_ptr, num_chunks, BLOCK_CHUNKS: tl.constexpr, K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    top_k = tl.load(top_k_ptr + row)
    temperature = tl.load(temperatures_ptr + row)
    if (top_k > 0) & (temperature > 0.0):
        # The chunks' lists one after another: column order, each list's padding at its end.
        lists = tl.arange(0, BLOCK_CHUNKS * K)
        keys = tl.load(candidates_ptr + row * num_chunks * K + lists, mask=lists < num_chunks * K, other=_MIN_KEY)
        take = _take_top((keys >> 32).to(tl.int32), keys != _MIN_KEY, K)
        out = best_ptr + row * K
        tl.store(out + tl.cumsum(take.to(tl.int32), axis=0) - 1, keys, mask=take)
        rank = tl.arange(0, K)
        tl.store(out + rank, tl.full([K], _MIN_KEY, tl.int64), mask=rank >= tl.sum(take.to(tl.int32), axis=0))
        tl.debug_barrier()                     # every thread's stores land before any thread reads them
        best = tl.sort(tl.load(out + rank), descending=True)
        tl.debug_barrier()
        tl.store(out + rank, best)             # best first, for tests
        ordered = (best >> 32).to(tl.int32)
        x = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
        cols = 0x7FFFFFFF - (best & 0xFFFFFFFF)
        kept = (rank < top_k) & (best != _MIN_KEY)
        top = tl.max(tl.where(rank == 0, x, float("-inf")), axis=0)
        # A row of -inf logits: every weight 0, and the draw falls back to the first candidate.
        shift = tl.where(top == float("-inf"), 0.0, top)
        weight = tl.where(kept, tl.exp2((x - shift) * (1.4426950408889634 / temperature)), 0.0)
        mass_before = tl.cumsum(weight, axis=0) - weight
        nucleus = kept & ((mass_before < tl.load(top_p_ptr + row) * tl.sum(weight, axis=0)) | (rank == 0))
        prefix = tl.cumsum(tl.where(nucleus, weight, 0.0), axis=0)
        chosen = tl.min(tl.where(prefix > _uniform(tl.load(seeds_ptr + row)) * tl.max(prefix, axis=0), rank, K),
                        axis=0)
        chosen = tl.where(chosen < K, chosen, 0)
        tl.store(tokens_ptr + row, tl.sum(tl.where(rank == chosen, cols, 0), axis=0))


def sample_top_k(logits: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 seeds: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Draws, into out [B] int64, the token of every row with 1 <= top_k <= TOP_K_MAX and
    temperature > 0 from its top-k and nucleus (top_p) sets; other rows of out are left as they
    are. logits [B, V] fp32, bf16 or fp16; temperatures [B] fp32; top_k [B] int32 (0: not this
    sampler's row); top_p [B] fp32; seeds [B] int64. Returns the rows' TOP_K_MAX best keys ([B,
    TOP_K_MAX], best first, for tests; rows not drawn are unwritten). No host synchronisation and
    a grid from shapes alone: capturable in a CUDA graph."""
    assert logits.stride(-1) == 1
    num_rows, vocab_size = logits.shape
    num_chunks = triton.cdiv(vocab_size, CHUNK)
    candidates = torch.empty(num_rows, num_chunks, TOP_K_MAX, dtype=torch.int64, device=logits.device)
    best = torch.empty(num_rows, TOP_K_MAX, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return best
    _chunk_candidates_kernel[(num_rows, num_chunks)](
        logits, top_k, temperatures, candidates, vocab_size, logits.stride(0), num_chunks, CHUNK=CHUNK, K=TOP_K_MAX,
        num_warps=CHUNK_WARPS)
    _sample_candidates_kernel[(num_rows,)](
        candidates, best, top_k, top_p, temperatures, seeds, out, num_chunks,
        BLOCK_CHUNKS=triton.next_power_of_2(num_chunks), K=TOP_K_MAX, num_warps=ROW_WARPS)
    return best
