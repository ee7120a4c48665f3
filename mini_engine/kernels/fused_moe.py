"""The experts of a Qwen3-MoE layer (transformers' Qwen3MoeExperts) as two grouped GEMMs.

Each token t picks K of the E experts, and its output is the routing-weighted sum of those K
experts' SwiGLU MLPs. Looping over experts would launch a pair of small GEMMs per expert, with a
host sync to learn which tokens went where. Instead, moe_align lays the T*K (token, k) pairs out
sorted by expert and pads each expert's group up to a multiple of BLOCK_M slots with a sentinel,
so that every block of BLOCK_M slots belongs to a single expert. One launch then covers every
expert: a program takes one block of slots and one tile of output columns, reads its block's
expert id, gathers its rows of activations by pair id and multiplies them by that expert's
weights. The padding costs at most BLOCK_M - 1 idle rows per expert hit, and every size depends
on T, K, E and BLOCK_M only, never on the routing, so the layer can be captured in a CUDA graph.
vLLM's fused_moe works the same way (its moe_align_block_size).

fused_moe: moe_align; gate/up GEMM into [T*K, 2I]; silu_and_mul; down GEMM, scaled by the
routing weight, into [T*K, H]; the sum over each token's K rows, added to the residual stream:
five launches (moe_align's one at decode).
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mini_engine.kernels.activation import silu_and_mul_ref
from mini_engine.kernels.fp8_linear import fp8_linear_ref


def fused_moe_ref(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, residual: torch.Tensor | None = None, w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """hidden [T, H], w13 [E, 2I, H] (each expert's gate rows, then its up rows), w2 [E, H, I],
    topk_weights and topk_ids [T, K] -> [T, H]. transformers' loop over the experts hit, with its
    rounding: each expert's down output is rounded to the model dtype, multiplied by the routing
    weight in that dtype, and added into a model-dtype sum, in the same order (expert by expert;
    within an expert, by k, then by token). With residual, the sum is added into it (the decoder's
    residual add) and residual returned. The CPU path of the engine.

    With w13_scale and w2_scale, w13 and w2 are fp8 experts (kernels/fp8_fused_moe.py) and each of
    an expert's two products is fp8_linear_ref's: its input quantized by row groups of 128, its
    weight's 128 x 128 blocks dequantized, the product rounded to the model dtype."""
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros_like(hidden)
    # Pair q = k * T + t is transformers' order within an expert (torch.where over a [K, T] mask).
    experts = topk_ids.t().reshape(-1)
    order = torch.argsort(experts, stable=True)
    counts = torch.bincount(experts, minlength=w13.shape[0]).tolist()    # a host sync: fine on the CPU path
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        k, tokens = pairs // num_tokens, pairs % num_tokens
        act = silu_and_mul_ref(expert_linear_ref(hidden[tokens], w13, w13_scale, expert))
        out.index_add_(0, tokens, expert_linear_ref(act, w2, w2_scale, expert) * topk_weights[tokens, k, None])
    return out if residual is None else residual.add_(out)


def expert_linear_ref(x: torch.Tensor, weights: torch.Tensor, scales: torch.Tensor | None, expert: int) -> torch.Tensor:
    """x times expert `expert`'s weight (of the stacked `weights`), transposed; with fp8 weights, their scales given, as
    fp8_linear_ref multiplies."""
    if scales is None:
        return F.linear(x, weights[expert])
    return fp8_linear_ref(x, weights[expert], scales[expert])


@dataclass(frozen=True)
class MoeAlignment:
    """The pairs p = t * K + k laid out by expert (see the module's docstring). Sizes are static:
    sorted_pair_ids has max_padded slots, of which the first num_padded are in use."""
    sorted_pair_ids: torch.Tensor   # int32 [max_padded]: pair ids, each expert's group padded with T*K
    block_expert_ids: torch.Tensor  # int32 [max_padded // block_m]: the expert of each block of slots
    num_padded: torch.Tensor        # int32 [1]: slots in use, a multiple of block_m
    block_m: int


def max_padded_slots(num_pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the slots moe_align uses, from shapes alone: every expert that gets a pair
    pads its group by at most block_m - 1, and at most min(E, T*K) experts get one (the tighter
    bound matters at decode: 8 pairs over 128 experts need 8 blocks, not 128)."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-bound // block_m) * block_m


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """Sort the pairs by expert (stable, so pairs of one expert keep their order) and pad each
    expert's group to a multiple of block_m. Device ops only, no host sync (no .item(), nonzero or
    bincount, whose output size is data-dependent), so that it can be captured in a CUDA graph:
    about twenty small launches, which a decode step pays in every sparse layer (moe_align takes
    one Triton launch there instead)."""
    device = topk_ids.device
    experts = topk_ids.reshape(-1).long()
    num_pairs = experts.numel()
    max_padded = max_padded_slots(num_pairs, num_experts, block_m)

    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, experts, torch.ones_like(experts))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded

    sorted_experts, pair_ids = torch.sort(experts, stable=True)
    # A pair's slot: its expert's padded start, plus its rank among that expert's pairs (its place
    # in the sorted list less the number of pairs of the experts before).
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    slots = padded_start[sorted_experts] + rank
    sorted_pair_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids.scatter_(0, slots, pair_ids.int())

    # A block's expert is the first whose padded group ends past the block's first slot. Blocks
    # past num_padded would get E; clamped to a real expert, though the kernel skips them anyway.
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    block_expert_ids = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return MoeAlignment(sorted_pair_ids, block_expert_ids.int(), padded_end[-1:].int(), block_m)


# ---- Triton ----

from mini_engine.kernels.activation import silu_and_mul  # noqa: E402
from mini_engine.kernels.triton_utils import pdl_enter, pdl_options, tl, triton  # noqa: E402


@triton.jit
def _moe_align_kernel(topk_ids_ptr, sorted_pair_ids_ptr, block_expert_ids_ptr, num_padded_ptr, num_pairs,
                      max_padded, NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
                      CHUNK: tl.constexpr, USE_PDL: tl.constexpr):
    """moe_align_ref's layout, program c filling slots [c CHUNK, (c+1) CHUNK) and placing pairs
    [c CHUNK, (c+1) CHUNK). Each program counts every pair's expert for itself (a [CHUNK, E]
    comparison a step: a few thousand pairs at decode), and the pairs of each expert before its
    own chunk; a pair's slot is then its expert's start, plus the pairs of that expert before it.
    Padding slots get the sentinel and pair slots a pair id, so no slot is written twice."""
    pdl_enter(USE_PDL)
    chunk = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], tl.int32)
    before = tl.zeros([BLOCK_E], tl.int32)          # this expert's pairs in the chunks before this one
    for start in range(0, num_pairs, CHUNK):
        pairs = start + tl.arange(0, CHUNK)
        # a masked pair's id matches no expert's column
        ids = tl.load(topk_ids_ptr + pairs, mask=pairs < num_pairs, other=BLOCK_E).to(tl.int32)
        hits = tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
        counts += hits
        before += tl.where(start < chunk * CHUNK, hits, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    if chunk == 0:
        tl.store(num_padded_ptr, tl.sum(padded, axis=0))

    # This chunk's slots: each slot's expert is the number of groups that end at or before it.
    slots = chunk * CHUNK + tl.arange(0, CHUNK)
    slot_expert = tl.sum((ends[None, :] <= slots[:, None]).to(tl.int32), axis=1)
    mine = experts[None, :] == slot_expert[:, None]
    padding = slots - tl.sum(tl.where(mine, starts[None, :], 0), axis=1) >= tl.sum(tl.where(mine, counts[None, :], 0),
                                                                                 axis=1)
    in_range = slots < max_padded
    tl.store(sorted_pair_ids_ptr + slots, tl.full([CHUNK], 0, tl.int32) + num_pairs, mask=in_range & padding)
    tl.store(block_expert_ids_ptr + slots // BLOCK_M, tl.minimum(slot_expert, NUM_EXPERTS - 1),
             mask=in_range & (slots % BLOCK_M == 0))

    # This chunk's pairs: slot = expert's start + its pairs before this chunk + before it in the chunk.
    pairs = chunk * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(topk_ids_ptr + pairs, mask=pairs < num_pairs, other=BLOCK_E).to(tl.int32)
    onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
    rank = tl.cumsum(onehot, axis=0) - onehot + before[None, :] + starts[None, :]
    tl.store(sorted_pair_ids_ptr + tl.sum(onehot * rank, axis=1), pairs, mask=pairs < num_pairs)


# The most pairs moe_align lays out with its Triton kernel: each program counts every pair, so the
# work grows with the square of the pairs; decode steps have at most max_num_seqs x K (2,048 for
# Qwen3-30B-A3B at 256 sequences). Prefill steps' tens of thousands take moe_align_ref's sort.
ALIGN_KERNEL_MAX_PAIRS = 4096
ALIGN_CHUNK = 128


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """moe_align_ref's layout; in one Triton launch where there are at most ALIGN_KERNEL_MAX_PAIRS pairs."""
    num_pairs = topk_ids.numel()
    if not 0 < num_pairs <= ALIGN_KERNEL_MAX_PAIRS:
        return moe_align_ref(topk_ids, num_experts, block_m)
    max_padded = max_padded_slots(num_pairs, num_experts, block_m)
    sorted_pair_ids = torch.empty(max_padded, dtype=torch.int32, device=topk_ids.device)
    block_expert_ids = torch.empty(max_padded // block_m, dtype=torch.int32, device=topk_ids.device)
    num_padded = torch.empty(1, dtype=torch.int32, device=topk_ids.device)
    _moe_align_kernel[(triton.cdiv(max_padded, ALIGN_CHUNK),)](
        topk_ids.contiguous(), sorted_pair_ids, block_expert_ids, num_padded, num_pairs, max_padded,
        NUM_EXPERTS=num_experts, BLOCK_E=max(16, triton.next_power_of_2(num_experts)), BLOCK_M=block_m,
        CHUNK=ALIGN_CHUNK, num_warps=4, **pdl_options(topk_ids.device))
    return MoeAlignment(sorted_pair_ids, block_expert_ids, num_padded, block_m)


@triton.jit
def slot_block(sorted_pair_ids_ptr, block_expert_ids_ptr, block, num_pairs, N, TOP_K: tl.constexpr,
               DOWN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A grouped GEMM program's rows and columns: its block's pair ids (int64) and which are real
    (not sentinels), the activation rows they read (a token's for gate/up, the pair's own for
    down), the block's expert, and its tile of output columns with their mask."""
    pair_ids = tl.load(sorted_pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    if DOWN:
        a_rows = pair_ids
    else:
        a_rows = pair_ids // TOP_K
    expert = tl.load(block_expert_ids_ptr + block).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return pair_ids, pair_ids < num_pairs, a_rows, expert, cols, cols < N


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, out_ptr, topk_weights_ptr, sorted_pair_ids_ptr, block_expert_ids_ptr,
                         num_padded_ptr, num_pairs, N, K, stride_am, stride_we, stride_wn, stride_om,
                         TOP_K: tl.constexpr, DOWN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_IN_FP32: tl.constexpr,
                         INPUT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (slot block, column tile): out[p, cols] = a[row(p)] @ w[expert, cols]^T for the
    pairs p in the block's slots, accumulated in fp32. Gate/up (DOWN false): a is hidden [T, H],
    one row per token, read by each of its K pairs. Down (DOWN true): a is the SwiGLU output
    [T*K, I], a row per pair, and the sum is scaled by the pair's routing weight before it is
    rounded. Either way out has a row per pair; sentinel slots (pair id T*K) neither load nor
    store."""
    # moe_align's outputs come from the kernels ahead: everything here is read after the wait.
    pdl_enter(USE_PDL)
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return      # past the used slots: the grid is sized for the worst routing
    pair_ids, row_ok, a_rows, expert, cols, col_ok = slot_block(sorted_pair_ids_ptr, block_expert_ids_ptr, block,
                                                                num_pairs, N, TOP_K, DOWN, BLOCK_M, BLOCK_N)
    # int64 row offsets: T*K rows of 2I columns pass 2^31 elements at long prefills.
    a_row_ptrs = a_ptr + a_rows[:, None] * stride_am
    w_row_ptrs = w_ptr + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        if EVEN_K:
            a = tl.load(a_row_ptrs + offs_k[None, :], mask=row_ok[:, None], other=0.0)
            w = tl.load(w_row_ptrs + offs_k[None, :], mask=col_ok[:, None], other=0.0)
        else:
            k_ok = offs_k < K
            a = tl.load(a_row_ptrs + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_row_ptrs + offs_k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT_IN_FP32:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=INPUT_PRECISION)
    if DOWN:
        weight = tl.load(topk_weights_ptr + pair_ids, mask=row_ok, other=0.0)
        acc = acc * weight.to(tl.float32)[:, None]
    tl.store(out_ptr + pair_ids[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_pairs_kernel(pairs_ptr, out_ptr, hidden_size, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
                      ADD_OUT: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (token, column block): out = the sum of the token's K pair rows, in fp32, rounded;
    with ADD_OUT that rounded sum is added to what out holds (the residual stream), as
    fused_moe_ref rounds it. K rows in a fixed order: a token's bits do not depend on its batch."""
    pdl_enter(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden_size
    acc = tl.zeros([BLOCK_H], tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(pairs_ptr + (token * TOP_K + k) * hidden_size + cols, mask=mask, other=0.0).to(tl.float32)
    out = acc.to(out_ptr.dtype.element_ty)
    if ADD_OUT:
        out = (out.to(tl.float32) + tl.load(out_ptr + token * hidden_size + cols, mask=mask).to(tl.float32))
    tl.store(out_ptr + token * hidden_size + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class MoeConfig:
    block_m: int        # slots per program, and the padding unit of moe_align
    block_n: int
    block_k: int        # for bf16/fp16; fp32 tiles take half (see fused_moe)
    num_warps: int = 4
    num_stages: int = 3


# From benchmarks/moe_sweep.py on the H200 (Qwen3-30B-A3B's experts, one layer, weights from HBM,
# uniform routing; benchmarks/NOTES.md, entry 55). Decode is bound by reading the experts: at 1-128
# tokens a 16-row block, 64 columns and 128 of K a step came within 0.5% of the best of 21
# configurations (38 us at one token, where the 8 experts' bytes take 18 at copy bandwidth; 306
# against 283 us at 128 tokens). At 256 tokens (16 pairs an expert) a 32-row block reads each
# expert's weights once more rarely: 326 against 347 us. Prefill is bound by the tensor cores:
# 128 x 256 tiles on 8 warps, 2.87 against 3.54 ms at 16,384 tokens (431 against 349 TFLOP/s).
DECODE_CONFIG = MoeConfig(block_m=16, block_n=64, block_k=128)
DECODE_WIDE_CONFIG = MoeConfig(block_m=32, block_n=64, block_k=128)
PREFILL_CONFIG = MoeConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3)


def moe_config(num_pairs: int, num_experts: int) -> MoeConfig:
    """Tiles by the mean number of pairs an expert gets: up to 8 (Qwen3-30B-A3B: 128 tokens), a
    16-row block; up to 16 (256 tokens), 32 rows; past that, prefill's tiles."""
    if num_pairs <= 8 * num_experts:
        return DECODE_CONFIG
    return DECODE_WIDE_CONFIG if num_pairs <= 16 * num_experts else PREFILL_CONFIG


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, topk_weights: torch.Tensor,
                  align: MoeAlignment, top_k: int, down: bool, cfg: MoeConfig) -> None:
    num_pairs, n, k = out.shape[0], w.shape[1], w.shape[2]
    # fp32 tiles of the same width need twice the shared memory (as in linear.py): halve their K.
    block_k = max(16, cfg.block_k * 2 // a.element_size())
    grid = (align.block_expert_ids.numel(), triton.cdiv(n, cfg.block_n))
    _grouped_gemm_kernel[grid](a, w, out, topk_weights, align.sorted_pair_ids, align.block_expert_ids,
                               align.num_padded, num_pairs, n, k, a.stride(0), w.stride(0), w.stride(1),
                               out.stride(0), TOP_K=top_k, DOWN=down, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                               BLOCK_K=block_k, EVEN_K=k % block_k == 0, DOT_IN_FP32=a.device.type == "cpu",
                               # fp32 weights get fp32 products, not TF32 (bf16/fp16 ignore this)
                               INPUT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
                               num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_options(a.device))


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: MoeConfig | None = None,
              residual: torch.Tensor | None = None) -> torch.Tensor:
    """fused_moe_ref's result (shapes there; with residual, added into it), as two grouped GEMMs.
    Sums run in fp32 and the routing weight scales a pair's fp32 down sum before it is rounded, so
    in bf16 the result differs from the reference's (rounded at every step) by a few ulps. config
    overrides moe_config's choice. Static shapes, no host sync: CUDA-graph safe."""
    assert hidden.is_contiguous() and topk_weights.is_contiguous()
    assert residual is None or (residual.shape == hidden.shape and residual.is_contiguous())
    assert w13.stride(-1) == 1 and w2.stride(-1) == 1
    num_tokens, hidden_size = hidden.shape
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    assert w13.shape[2] == hidden_size and w2.shape[:2] == (num_experts, hidden_size)
    assert w2.shape[2] * 2 == w13.shape[1] and topk_weights.shape == topk_ids.shape
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(hidden) if residual is None else residual
    cfg = config or moe_config(num_pairs, num_experts)
    align = moe_align(topk_ids, num_experts, cfg.block_m)
    gate_up = torch.empty(num_pairs, w13.shape[1], dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(hidden, w13, gate_up, topk_weights, align, top_k, False, cfg)
    act = silu_and_mul(gate_up)
    out = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(act, w2, out, topk_weights, align, top_k, True, cfg)
    return sum_pairs(out, hidden, top_k, residual)


def sum_pairs(pairs: torch.Tensor, hidden: torch.Tensor, top_k: int, residual: torch.Tensor | None) -> torch.Tensor:
    """The experts' last launch: each token's K rows of pairs [T*K, H] summed, into a new tensor
    shaped as hidden [T, H], or added into residual."""
    num_tokens, hidden_size = hidden.shape
    total = torch.empty_like(hidden) if residual is None else residual
    block_h = min(1024, triton.next_power_of_2(hidden_size))
    _sum_pairs_kernel[(num_tokens, triton.cdiv(hidden_size, block_h))](
        pairs, total, hidden_size, TOP_K=top_k, BLOCK_H=block_h, ADD_OUT=residual is not None, num_warps=4,
        **pdl_options(hidden.device))
    return total
