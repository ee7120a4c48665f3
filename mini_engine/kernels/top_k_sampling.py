"""Top-k (and top-p within it) sampling from a row's TOP_K_MAX best logits, with no sort of the
vocabulary and no host work: what lets a CUDA graph sample Qwen3's own defaults (top_k 20,
top_p 0.95, in its generation_config.json) at decode speed.

torch.topk takes 382 us for [256, 151,936] bf16 logits on the H200 (40 us for one row), more than
ten times the plain sampler (32 us), and sorting or searching every chunk for its own best
TOP_K_MAX was no faster (benchmarks/NOTES.md, entry 48). So the row's best are found by cutting
the vocabulary down to a few candidates first, in four kernels:

1. _group_max_kernel, one program per (row, chunk of CHUNK columns): the largest logit of each
   group of GROUP columns.
2. _threshold_kernel, one program (one warp) per row: L, the TOP_K_MAX-th largest group maximum.
   TOP_K_MAX distinct logits are >= L, so the row's best TOP_K_MAX all are; and they lie in the
   groups whose maximum is >= L. For logits without structure that leaves ~TOP_K_MAX + 20
   candidates of 151,936.
3. _gather_kernel, one program per (row, chunk): appends each candidate's key to its row's list
   (an atomic count gives it a slot).
4. _sample_candidates_kernel, one program per row: the best TOP_K_MAX of the list (sorted where it
   is short, by a binary search over the keys where it is long, and, where it overflowed
   LIST_SIZE, by a search over the whole row), then the row's top-k and nucleus among them and
   one draw.

A key packs a logit and its column into one int64, ordered as the reference's stable sort orders
them (the larger logit first, ties to the lower column), so keys are unique and "the best K" is
exact, ties included. -inf logits are never candidates: they weigh 0 in any draw, and a row of
them draws its column 0, as kernels/sampling.py does.

The draw: the row's first top_k candidates at temperature T, the nucleus cut where the mass
before a candidate reaches top_p of the top-k mass (the first candidate always stays), and the
first candidate whose cumulative weight passes u x total, with one uniform u from the row's seed,
as kernels/sampling.py draws it. Only rows with 1 <= top_k and T > 0 are drawn; the others keep
the token already in `out` (greedy rows' argmax does not depend on top-k or top-p)."""
import torch

from mini_engine.kernels.sampling import _uniform
from mini_engine.kernels.triton_utils import HAS_TRITON, tl, triton

# The largest top_k this sampler takes (and so a CUDA graph): Qwen3 asks for 20, Hugging Face's
# default is 50. A request with a larger top_k samples through apply_top_k_top_p, outside graphs.
TOP_K_MAX = 64
CHUNK = 4096          # columns a program of kernels 1 and 3 reads: 38 a row at Qwen3's vocabulary
GROUP = 1024          # columns a group: 149 groups a row at Qwen3's vocabulary
SHORT_LIST = 256      # a candidate list this long or shorter is sorted whole (~84 for Qwen3's)
LIST_SIZE = 4096      # the list's room; a row whose candidates overflow it is searched whole
MIN_KEY = -(2**63)    # below every key: padding
_MIN_KEY = tl.constexpr(MIN_KEY) if HAS_TRITON else MIN_KEY    # (a kernel reads only constexpr globals)
ORDERED_NEG_INF = -2139095041     # _ordered(-inf): the int32 below every finite logit's
_ORDERED_NEG_INF = tl.constexpr(ORDERED_NEG_INF) if HAS_TRITON else ORDERED_NEG_INF


def candidate_keys_ref(logits: torch.Tensor) -> torch.Tensor:
    """The keys of each row's TOP_K_MAX best logits, best first: [B, TOP_K_MAX] int64 (the reference
    for the kernels' lists; MIN_KEY for a -inf logit, and for padding where a row has fewer columns)."""
    values, cols = logits.float().sort(dim=-1, descending=True, stable=True)
    values, cols = values[:, :TOP_K_MAX], cols[:, :TOP_K_MAX]
    bits = torch.where(values == 0, 0.0, values).view(torch.int32)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64)
    keys = torch.where(values > float("-inf"), (ordered << 32) | (0x7FFFFFFF - cols), MIN_KEY)
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
        finite_top = v[0] > float("-inf")
        weight = torch.exp(torch.where(v == v[0], 0.0, v - v[0]) / temperature) if finite_top else torch.zeros_like(v)
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
def _kth_largest(values, valid, K: tl.constexpr, BITS: tl.constexpr):
    """The K-th largest of a block's valid integer values (int32 or int64; BITS their width), by
    a binary search: each step counts the values at or above its midpoint. With fewer than K
    valid values: the smallest value of the type."""
    low = tl.full([], -(2**(BITS - 1)), values.dtype)         # count(>= low) >= K, or low is the type's least
    high = tl.full([], 2**(BITS - 1) - 1, values.dtype)       # the K-th largest is <= high
    for _step in range(BITS):
        mid = (low >> 1) + (high >> 1) + ((low & 1) | (high & 1))     # ceil((low + high) / 2), without overflow
        enough = tl.sum((valid & (values >= mid)).to(tl.int32), axis=0) >= K
        low = tl.where(enough, mid, low)
        high = tl.where(enough, high, mid - 1)
    return low


@triton.jit
def _drawn(top_k_ptr, temperatures_ptr, row):
    """Is the row this sampler's to draw: top_k >= 1 and a temperature above 0?"""
    return (tl.load(top_k_ptr + row) > 0) & (tl.load(temperatures_ptr + row) > 0.0)


@triton.jit
def _tile(row_ptr, start, vocab_size, CHUNK: tl.constexpr):
    """Columns [start, start + CHUNK) of a row, and their logits _ordered (-inf past the row's end)."""
    cols = start + tl.arange(0, CHUNK)
    return cols, _ordered(tl.load(row_ptr + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32))


@triton.jit
def _group_max_kernel(logits_ptr, top_k_ptr, temperatures_ptr, group_max_ptr, vocab_size, stride_logits,
                      num_groups, CHUNK: tl.constexpr, GROUP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    if _drawn(top_k_ptr, temperatures_ptr, row):
        _, ordered = _tile(logits_ptr + row * stride_logits, chunk * CHUNK, vocab_size, CHUNK)
        groups = chunk * (CHUNK // GROUP) + tl.arange(0, CHUNK // GROUP)
        group_max = tl.max(tl.reshape(ordered, [CHUNK // GROUP, GROUP]), axis=1)
        tl.store(group_max_ptr + row * num_groups + groups, group_max, mask=groups < num_groups)


@triton.jit
def _threshold_kernel(group_max_ptr, top_k_ptr, temperatures_ptr, threshold_ptr, num_groups,
                      BLOCK_GROUPS: tl.constexpr, K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if _drawn(top_k_ptr, temperatures_ptr, row):
        groups = tl.arange(0, BLOCK_GROUPS)
        group_max = tl.load(group_max_ptr + row * num_groups + groups, mask=groups < num_groups,
                            other=_ORDERED_NEG_INF)
        # Groups of -inf alone hold no candidate. Fewer than K other groups: every finite logit is one.
        tl.store(threshold_ptr + row, _kth_largest(group_max, group_max > _ORDERED_NEG_INF, K, 32))


@triton.jit
def _gather_kernel(logits_ptr, top_k_ptr, temperatures_ptr, threshold_ptr, lists_ptr, counts_ptr, vocab_size,
                   stride_logits, CHUNK: tl.constexpr, LIST_SIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    if _drawn(top_k_ptr, temperatures_ptr, row):
        cols, ordered = _tile(logits_ptr + row * stride_logits, chunk * CHUNK, vocab_size, CHUNK)
        candidate = (ordered >= tl.load(threshold_ptr + row)) & (ordered > _ORDERED_NEG_INF)
        slot = tl.atomic_add(counts_ptr + row + tl.zeros([CHUNK], tl.int64), 1, mask=candidate)
        tl.store(lists_ptr + row * LIST_SIZE + slot, _key(ordered, cols), mask=candidate & (slot < LIST_SIZE))


@triton.jit
def _best_of_row(logits_ptr, vocab_size, out, CHUNK: tl.constexpr, K: tl.constexpr):
    """Writes the row's K best keys (finite logits only) to out[0:K], in column order, padding
    after: a binary search for the K-th largest logit over the whole row, then a pass that takes
    every logit above it and, of those equal to it, the first in column order. For rows whose
    candidates overflowed their list (a row of many equal logits): slow, and rare."""
    low = tl.full([], -(2**31), tl.int32)
    high = tl.full([], 2**31 - 1, tl.int32)
    for _step in range(32):
        mid = (low >> 1) + (high >> 1) + ((low & 1) | (high & 1))
        count = tl.full([], 0, tl.int32)
        for start in range(0, vocab_size, CHUNK):
            _, ordered = _tile(logits_ptr, start, vocab_size, CHUNK)
            count += tl.sum(((ordered > _ORDERED_NEG_INF) & (ordered >= mid)).to(tl.int32), axis=0)
        low = tl.where(count >= K, mid, low)
        high = tl.where(count >= K, high, mid - 1)
    above = tl.full([], 0, tl.int32)
    for start in range(0, vocab_size, CHUNK):
        _, ordered = _tile(logits_ptr, start, vocab_size, CHUNK)
        above += tl.sum(((ordered > _ORDERED_NEG_INF) & (ordered > low)).to(tl.int32), axis=0)
    taken = tl.full([], 0, tl.int32)
    equal_taken = tl.full([], 0, tl.int32)
    for start in range(0, vocab_size, CHUNK):
        cols, ordered = _tile(logits_ptr, start, vocab_size, CHUNK)
        finite = ordered > _ORDERED_NEG_INF
        equal = finite & (ordered == low)
        equal_rank = equal_taken + tl.cumsum(equal.to(tl.int32), axis=0)
        take = (finite & (ordered > low)) | (equal & (equal_rank <= K - above))
        tl.store(out + taken + tl.cumsum(take.to(tl.int32), axis=0) - 1, _key(ordered, cols), mask=take)
        taken += tl.sum(take.to(tl.int32), axis=0)
        equal_taken += tl.sum(equal.to(tl.int32), axis=0)
    slots = tl.arange(0, K)
    tl.store(out + slots, tl.full([K], _MIN_KEY, tl.int64), mask=slots >= taken)


@triton.jit
def _sample_candidates_kernel(lists_ptr, counts_ptr, best_ptr, logits_ptr, top_k_ptr, top_p_ptr, temperatures_ptr,
                              seeds_ptr, tokens_ptr, vocab_size, stride_logits, CHUNK: tl.constexpr, K: tl.constexpr,
                              SHORT_LIST: tl.constexpr, LIST_SIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if _drawn(top_k_ptr, temperatures_ptr, row):
        top_k = tl.load(top_k_ptr + row)
        temperature = tl.load(temperatures_ptr + row)
        count = tl.load(counts_ptr + row)
        out = best_ptr + row * K
        rank = tl.arange(0, K)
        if count <= SHORT_LIST:
            entries = tl.arange(0, SHORT_LIST)
            short = tl.sort(tl.load(lists_ptr + row * LIST_SIZE + entries, mask=entries < count, other=_MIN_KEY),
                            descending=True)
            tl.store(out + entries, short, mask=entries < K)
        elif count <= LIST_SIZE:
            entries = tl.arange(0, LIST_SIZE)
            keys = tl.load(lists_ptr + row * LIST_SIZE + entries, mask=entries < count, other=_MIN_KEY)
            valid = keys != _MIN_KEY
            take = valid & (keys >= _kth_largest(keys, valid, K, 64))          # keys are unique: exactly K
            tl.store(out + tl.cumsum(take.to(tl.int32), axis=0) - 1, keys, mask=take)
        else:
            _best_of_row(logits_ptr + row * stride_logits, vocab_size, out, CHUNK, K)
        tl.debug_barrier()                     # every thread's stores land before any thread reads them
        best = tl.sort(tl.load(out + rank), descending=True)
        tl.debug_barrier()
        tl.store(out + rank, best)             # best first, for tests
        ordered = (best >> 32).to(tl.int32)
        x = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
        cols = 0x7FFFFFFF - (best & 0xFFFFFFFF)
        kept = (rank < top_k) & (best != _MIN_KEY)
        # A row of -inf logits has no candidates: every weight 0, and the draw takes column 0. The
        # best logit's own weight is 1 even where it is +inf (inf - inf would be NaN).
        top = tl.max(tl.where(rank == 0, x, float("-inf")), axis=0)
        weight = tl.where(kept, tl.exp2(tl.where(x == top, 0.0, x - top) * (1.4426950408889634 / temperature)), 0.0)
        mass_before = tl.cumsum(weight, axis=0) - weight
        nucleus = kept & ((mass_before < tl.load(top_p_ptr + row) * tl.sum(weight, axis=0)) | (rank == 0))
        prefix = tl.cumsum(tl.where(nucleus, weight, 0.0), axis=0)
        chosen = tl.min(tl.where(prefix > _uniform(tl.load(seeds_ptr + row)) * tl.max(prefix, axis=0), rank, K),
                        axis=0)
        token = tl.sum(tl.where(rank == chosen, cols, 0), axis=0)
        tl.store(tokens_ptr + row, tl.where(chosen < K, token, 0))


def sample_top_k(logits: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 seeds: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Draws, into out [B] int64, the token of every row with top_k >= 1 and temperature > 0 from
    its top-k and nucleus (top_p) sets; other rows of out are left as they are. logits [B, V]
    fp32, bf16 or fp16; temperatures [B] fp32; top_k [B] int32 (0: not this sampler's row; a
    top_k above TOP_K_MAX draws from the best TOP_K_MAX, so callers pass candidate_top_k's);
    top_p [B] fp32; seeds [B] int64. NaN logits give no defined draw. Returns, for tests, the
    rows' TOP_K_MAX best keys ([B, TOP_K_MAX], best first, MIN_KEY past the row's finite logits)
    and their candidates' counts ([B]); rows not drawn have none written. No host
    synchronisation and a grid from shapes alone: capturable in a CUDA graph."""
    assert logits.stride(-1) == 1 and CHUNK % GROUP == 0
    num_rows, vocab_size = logits.shape
    num_chunks, num_groups = triton.cdiv(vocab_size, CHUNK), triton.cdiv(vocab_size, GROUP)
    device = logits.device
    group_max = torch.empty(num_rows, num_groups, dtype=torch.int32, device=device)
    threshold = torch.empty(num_rows, dtype=torch.int32, device=device)
    lists = torch.empty(num_rows, LIST_SIZE, dtype=torch.int64, device=device)
    counts = torch.zeros(num_rows, dtype=torch.int32, device=device)
    best = torch.empty(num_rows, TOP_K_MAX, dtype=torch.int64, device=device)
    if num_rows == 0:
        return best, counts
    drawn = (top_k, temperatures)
    _group_max_kernel[(num_rows, num_chunks)](logits, *drawn, group_max, vocab_size, logits.stride(0), num_groups,
                                              CHUNK=CHUNK, GROUP=GROUP, num_warps=8)
    _threshold_kernel[(num_rows,)](group_max, *drawn, threshold, num_groups,
                                   BLOCK_GROUPS=triton.next_power_of_2(num_groups), K=TOP_K_MAX, num_warps=1)
    _gather_kernel[(num_rows, num_chunks)](logits, *drawn, threshold, lists, counts, vocab_size, logits.stride(0),
                                           CHUNK=CHUNK, LIST_SIZE=LIST_SIZE, num_warps=8)
    _sample_candidates_kernel[(num_rows,)](
        lists, counts, best, logits, top_k, top_p, temperatures, seeds, out, vocab_size, logits.stride(0),
        CHUNK=CHUNK, K=TOP_K_MAX, SHORT_LIST=SHORT_LIST, LIST_SIZE=LIST_SIZE, num_warps=4)
    return best, counts
