"""Top-k (and top-p within it) sampling from a row's TOP_K_MAX best logits, with no sort of the
vocabulary and no host work: what lets a CUDA graph sample Qwen3's own defaults (top_k 20,
top_p 0.95, in its generation_config.json) at decode speed.

torch.topk takes 382 us for [256, 151,936] bf16 logits on the H200 (40 us for one row), more than
the step's sampling budget; so the best TOP_K_MAX columns are found in two kernels, each cutting
its block down before it sorts anything:

- _chunk_candidates_kernel, one program per (row, chunk of CHUNK columns): the chunk's TOP_K_MAX
  best, largest first.
- _sample_candidates_kernel, one program per row: the best TOP_K_MAX of the chunks' lists, then the
  row's top-k and nucleus among them and one draw.

Both cut a block of keys the same way (_write_top_keys). A key packs a logit and its column into one
int64, so that keys are unique and their order is the reference's stable sort (the larger logit
first, ties to the lower column). The block's keys in groups of GROUP give group maxima; the
K-th largest of those, L, has K distinct keys at or above it, so the block's best K are all >= L,
and they lie in the K groups whose maximum is >= L: at most K x GROUP candidates, ~74 of a chunk's
4,096 for logits without structure. Those are packed (a prefix sum of the mask gives each its
slot) and sorted. A block whose candidates exceed SMALL (many equal logits, e.g. a row of -inf
where logit_bias or allowed_token_ids masked it) is sorted whole instead: slower, same answer.

The draw: the row's first top_k candidates (fewer where the row has fewer columns) at temperature
T, the nucleus cut where the mass before a candidate reaches top_p of the top-k mass (the first
candidate always stays), and the first candidate whose cumulative weight passes u x total, with
one uniform u from the row's seed, as kernels/sampling.py draws it. Only rows with 1 <= top_k and
T > 0 are drawn; the others keep the token already in `out` (greedy rows' argmax does not depend
on top-k or top-p)."""
import torch

from mini_engine.kernels.sampling import _uniform
from mini_engine.kernels.triton_utils import tl, triton

# The largest top_k this sampler takes (and so a CUDA graph): Qwen3 asks for 20, Hugging Face's
# default is 50. A request with a larger top_k samples through apply_top_k_top_p, outside graphs.
TOP_K_MAX = 64
CHUNK = 4096          # columns a first-stage program reads: 38 programs a row at Qwen3's vocabulary
GROUP = 16            # keys a group; 256 groups a 4,096-key block
SMALL = 128           # candidates sorted on the fast path (a block of logits without structure: ~74)
MIN_KEY = -(2**63)    # below every key: padding
_MIN_KEY = tl.constexpr(MIN_KEY)


def candidate_keys_ref(logits: torch.Tensor) -> torch.Tensor:
    """The keys of each row's TOP_K_MAX best logits, best first: [B, TOP_K_MAX] int64 (the reference
    for the kernels' lists; padding _MIN_KEY where a row has fewer columns)."""
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
def _keys(x, cols):
    """int64 keys of fp32 logits x at columns cols: ordered as (logit, -column). -0.0 counts as 0.0,
    as in a sort."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - cols).to(tl.int64)


@triton.jit
def _write_top_keys(keys, scratch_ptr, out_ptr, N: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr,
                    SMALL: tl.constexpr):
    """Writes the K largest of keys ([N] int64, unique but for _MIN_KEY padding), largest first, to
    out_ptr[0:K]. scratch_ptr: SMALL int64 of this program's own."""
    group_max = tl.max(tl.reshape(keys, [N // GROUP, GROUP]), axis=1)
    ranked = tl.sort(group_max, descending=True)
    # Fewer than K groups: the threshold is the padding, and every real key is a candidate.
    threshold = tl.max(tl.where(tl.arange(0, N // GROUP) == K - 1, ranked, _MIN_KEY), axis=0)
    candidate = (keys >= threshold) & (keys != _MIN_KEY)
    count = tl.sum(candidate.to(tl.int32), axis=0)
    if count <= SMALL:
        slot = tl.cumsum(candidate.to(tl.int32), axis=0) - 1
        tl.store(scratch_ptr + slot, keys, mask=candidate)
        tl.debug_barrier()                      # every thread's candidates stored before any reads them
        slots = tl.arange(0, SMALL)
        packed = tl.sort(tl.load(scratch_ptr + slots, mask=slots < count, other=_MIN_KEY), descending=True)
        tl.store(out_ptr + slots, packed, mask=slots < K)
    else:
        ranked_keys = tl.sort(tl.where(candidate, keys, _MIN_KEY), descending=True)
        tl.store(out_ptr + tl.arange(0, N), ranked_keys, mask=tl.arange(0, N) < K)


@triton.jit
def _chunk_candidates_kernel(logits_ptr, top_k_ptr, temperatures_ptr, candidates_ptr, scratch_ptr, vocab_size,
                             stride_logits, num_chunks, CHUNK: tl.constexpr, GROUP: tl.constexpr,
                             K: tl.constexpr, SMALL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    if (tl.load(top_k_ptr + row) > 0) & (tl.load(temperatures_ptr + row) > 0.0):
        cols = chunk * CHUNK + tl.arange(0, CHUNK)
        in_row = cols < vocab_size
        x = tl.load(logits_ptr + row * stride_logits + cols, mask=in_row, other=0.0).to(tl.float32)
        keys = tl.where(in_row, _keys(x, cols), _MIN_KEY)
        out = row * num_chunks + chunk
        _write_top_keys(keys, scratch_ptr + out * SMALL, candidates_ptr + out * K, CHUNK, GROUP, K, SMALL)


@triton.jit
def _sample_candidates_kernel(candidates_ptr, scratch_ptr, best_ptr, top_k_ptr, top_p_ptr, temperatures_ptr,
                              seeds_ptr, tokens_ptr, num_chunks, BLOCK_CHUNKS: tl.constexpr, GROUP: tl.constexpr,
                              K: tl.constexpr, SMALL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    top_k = tl.load(top_k_ptr + row)
    temperature = tl.load(temperatures_ptr + row)
    if (top_k > 0) & (temperature > 0.0):
        lists = tl.arange(0, BLOCK_CHUNKS * K)
        keys = tl.load(candidates_ptr + row * num_chunks * K + lists, mask=lists < num_chunks * K, other=_MIN_KEY)
        _write_top_keys(keys, scratch_ptr + row * SMALL, best_ptr + row * K, BLOCK_CHUNKS * K, GROUP, K, SMALL)
        tl.debug_barrier()
        rank = tl.arange(0, K)
        best = tl.load(best_ptr + row * K + rank)
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
    TOP_K_MAX], for tests; rows not drawn are unwritten). No host synchronisation and a grid from
    shapes alone: capturable in a CUDA graph."""
    assert logits.stride(-1) == 1
    num_rows, vocab_size = logits.shape
    num_chunks = triton.cdiv(vocab_size, CHUNK)
    candidates = torch.empty(num_rows, num_chunks, TOP_K_MAX, dtype=torch.int64, device=logits.device)
    chunk_scratch = torch.empty(num_rows, num_chunks, SMALL, dtype=torch.int64, device=logits.device)
    best = torch.empty(num_rows, TOP_K_MAX, dtype=torch.int64, device=logits.device)
    row_scratch = torch.empty(num_rows, SMALL, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return best
    _chunk_candidates_kernel[(num_rows, num_chunks)](
        logits, top_k, temperatures, candidates, chunk_scratch, vocab_size, logits.stride(0), num_chunks,
        CHUNK=CHUNK, GROUP=GROUP, K=TOP_K_MAX, SMALL=SMALL, num_warps=8)
    _sample_candidates_kernel[(num_rows,)](
        candidates, row_scratch, best, top_k, top_p, temperatures, seeds, out, num_chunks,
        BLOCK_CHUNKS=triton.next_power_of_2(num_chunks), GROUP=GROUP, K=TOP_K_MAX, SMALL=SMALL, num_warps=8)
    return best
