"""The experts of a Qwen3-MoE layer with fp8 weights (Qwen3-30B-A3B-FP8, or quantization="fp8"):
kernels/fused_moe.py's two grouped GEMMs over each expert's weights in float8_e4m3fn, one fp32 scale
a 128 x 128 block (kernels/fp8_linear.py's scheme), with activations quantized as they arrive, one
scale a row's group of 128 columns: how vLLM runs these checkpoints.

w13 [E, 2I, H] fp8 with w13_scale [E, 2I/128, ceil(H/128)], and w2 [E, H, I] fp8 with w2_scale
[E, ceil(H/128), I/128] (vLLM's w13_weight_scale_inv and w2_weight_scale_inv). I must be whole
blocks, so that no block holds both gate and up rows (layers/moe.py refuses other shapes).

Quantization is row by row, so quantizing each expert's gathered input rows is quantizing every
row once, before the gathers: the T hidden rows before the gate/up GEMM (each read by its K pairs)
and the T*K SwiGLU rows before the down GEMM. fp8_fused_moe: moe_align; quantize hidden; gate/up
GEMM; silu_and_mul; quantize; down GEMM, scaled by the routing weight; the sum over each token's K
rows (fused_moe.sum_pairs): seven launches, every size from T, K and E alone (CUDA-graph safe).
"""
import torch

from mini_engine.kernels.fused_moe import fused_moe_ref


def fp8_fused_moe_ref(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor,
                      residual: torch.Tensor | None = None) -> torch.Tensor:
    """fused_moe_ref over fp8 experts: each expert's input quantized by row groups of 128 and
    multiplied by its dequantized weight, as fp8_linear_ref multiplies. The CPU path."""
    return fused_moe_ref(hidden, w13, w2, topk_weights, topk_ids, residual, w13_scale, w2_scale)


# ---- Triton ----

from mini_engine.kernels.activation import silu_and_mul  # noqa: E402
from mini_engine.kernels.fp8_linear import BLOCK, FP8, quantize_fp8  # noqa: E402
from mini_engine.kernels.fused_moe import MoeAlignment, MoeConfig, moe_align, slot_block, sum_pairs  # noqa: E402
from mini_engine.kernels.triton_utils import pdl_enter, pdl_options, tl, triton  # noqa: E402


@triton.jit
def _fp8_grouped_gemm_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, topk_weights_ptr, sorted_pair_ids_ptr,
                             block_expert_ids_ptr, num_padded_ptr, num_pairs, N, K, num_groups, stride_we, stride_wn,
                             stride_se, stride_sn, stride_om, TOP_K: tl.constexpr, DOWN: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             USE_PDL: tl.constexpr):
    """fused_moe's _grouped_gemm_kernel on fp8 operands: program (slot block, column tile) sums, over
    K's 128-column groups g, (a_g . w_g^T) * a_scale[row, g] * w_scale[expert, col // 128, g], the
    dot on fp8 tiles (fp8_linear's _fp8_gemm_kernel's step), the sum in fp32. a is quantized hidden
    [T, H] (gate/up: a row per token, read by each of its K pairs) or the quantized SwiGLU output
    [T*K, I] (down: a row per pair, whose sum the routing weight scales before it is rounded); its
    scales [rows, num_groups]. Sentinel slots (pair id T*K) neither load nor store."""
    pdl_enter(USE_PDL)      # moe_align's layout and the quantized rows come from the launches ahead
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return      # past the used slots: the grid is sized for the worst routing
    pair_ids, row_ok, a_rows, expert, cols, col_ok = slot_block(sorted_pair_ids_ptr, block_expert_ids_ptr, block,
                                                                num_pairs, N, TOP_K, DOWN, BLOCK_M, BLOCK_N)
    a_row_ptrs = a_ptr + a_rows[:, None] * K
    a_scale_rows = a_scale_ptr + a_rows * num_groups
    w_row_ptrs = w_ptr + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn
    w_scale_rows = w_scale_ptr + expert * stride_se + (cols // BLOCK_K) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for g in range(0, num_groups):
        offs_k = g * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_row_ptrs + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_row_ptrs + offs_k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        a_scale = tl.load(a_scale_rows + g, mask=row_ok, other=0.0)
        w_scale = tl.load(w_scale_rows + g, mask=col_ok, other=0.0)
        acc += tl.dot(a, tl.trans(w)) * a_scale[:, None] * w_scale[None, :]
    if DOWN:
        weight = tl.load(topk_weights_ptr + pair_ids, mask=row_ok, other=0.0)
        acc = acc * weight.to(tl.float32)[:, None]
    tl.store(out_ptr + pair_ids[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


# Not yet measured on a GPU (benchmarks/moe_sweep.py's sweep, run over fp8 experts, would tune
# them): decode takes the bf16 experts' tiles (a few pairs an expert, bound by reading the
# weights, here half the bytes); prefill vLLM's default for block-quantized fp8 experts, 64 x 128
# tiles on 4 warps. K steps are one 128-column group: a step's scales are one a row and one a column.
FP8_DECODE_CONFIG = MoeConfig(block_m=16, block_n=64, block_k=BLOCK)
FP8_DECODE_WIDE_CONFIG = MoeConfig(block_m=32, block_n=64, block_k=BLOCK)
FP8_PREFILL_CONFIG = MoeConfig(block_m=64, block_n=128, block_k=BLOCK, num_warps=4, num_stages=3)


def fp8_moe_config(num_pairs: int, num_experts: int) -> MoeConfig:
    """Tiles by the mean number of pairs an expert gets, as fused_moe.moe_config picks them."""
    if num_pairs <= 8 * num_experts:
        return FP8_DECODE_CONFIG
    return FP8_DECODE_WIDE_CONFIG if num_pairs <= 16 * num_experts else FP8_PREFILL_CONFIG


def _fp8_grouped_gemm(q: torch.Tensor, q_scales: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                      out: torch.Tensor, topk_weights: torch.Tensor, align: MoeAlignment, top_k: int, down: bool,
                      cfg: MoeConfig) -> None:
    num_pairs, n, k = out.shape[0], w.shape[1], w.shape[2]
    grid = (align.block_expert_ids.numel(), triton.cdiv(n, cfg.block_n))
    _fp8_grouped_gemm_kernel[grid](q, q_scales, w, w_scale, out, topk_weights, align.sorted_pair_ids,
                                   align.block_expert_ids, align.num_padded, num_pairs, n, k, q_scales.shape[1],
                                   w.stride(0), w.stride(1), w_scale.stride(0), w_scale.stride(1), out.stride(0),
                                   TOP_K=top_k, DOWN=down, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=BLOCK,
                                   num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_options(q.device))


def fp8_fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor,
                  residual: torch.Tensor | None = None, config: MoeConfig | None = None) -> torch.Tensor:
    """fp8_fused_moe_ref's result (with residual, added into it), as two grouped GEMMs. As fused_moe,
    sums run in fp32 and the routing weight scales a pair's fp32 down sum before it is rounded; and
    the gate/up rows are rounded once, so that the SwiGLU values quantized for the down GEMM may
    round to a neighbouring e4m3 value where the reference's differ by an ulp. config overrides
    fp8_moe_config's tiles (its block_k is always 128: one group a step)."""
    assert hidden.is_contiguous() and topk_weights.is_contiguous()
    assert residual is None or (residual.shape == hidden.shape and residual.is_contiguous())
    assert w13.dtype == w2.dtype == FP8 and w13.stride(-1) == 1 and w2.stride(-1) == 1
    num_tokens, hidden_size = hidden.shape
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    assert w13.shape[2] == hidden_size and w2.shape[:2] == (num_experts, hidden_size)
    assert w2.shape[2] * 2 == w13.shape[1] and w2.shape[2] % BLOCK == 0 and topk_weights.shape == topk_ids.shape
    assert w13_scale.shape == (num_experts, w13.shape[1] // BLOCK, triton.cdiv(hidden_size, BLOCK))
    assert w2_scale.shape == (num_experts, triton.cdiv(hidden_size, BLOCK), w2.shape[2] // BLOCK)
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(hidden) if residual is None else residual
    cfg = config or fp8_moe_config(num_pairs, num_experts)
    align = moe_align(topk_ids, num_experts, cfg.block_m)
    q, q_scales = quantize_fp8(hidden)
    gate_up = torch.empty(num_pairs, w13.shape[1], dtype=hidden.dtype, device=hidden.device)
    _fp8_grouped_gemm(q, q_scales, w13, w13_scale, gate_up, topk_weights, align, top_k, False, cfg)
    act, act_scales = quantize_fp8(silu_and_mul(gate_up))
    out = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    _fp8_grouped_gemm(act, act_scales, w2, w2_scale, out, topk_weights, align, top_k, True, cfg)
    return sum_pairs(out, hidden, top_k, residual)
