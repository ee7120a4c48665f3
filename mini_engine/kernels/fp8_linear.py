"""Products with fp8 weights: the block scheme of DeepSeek-V3 that Qwen3's FP8 checkpoints
(Qwen3-*-FP8) use, and that vLLM runs them with.

A weight W [N, K] is stored in float8_e4m3fn with one fp32 scale for each 128 x 128 block,
`weight_scale_inv` [ceil(N/128), ceil(K/128)] (the checkpoint's name: W = W_fp8 * scale). The
activations are quantized as they arrive ("dynamic"): one scale for each row's group of 128
columns, the group's largest |value| over 448, e4m3's largest. Each 128-wide slice of the product
is then an fp8 x fp8 dot (the H200's fp8 tensor cores: half the bytes of bf16 and twice its rate),
scaled by the two scales and summed in fp32.
"""
import torch
import torch.nn.functional as F

from mini_engine.kernels.rms_norm import rms_norm_ref

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128             # a weight block's rows and columns, and an activation group's columns
# A group of zeros takes this as its largest |value| (vLLM's floor): its scale stays finite.
MIN_AMAX = 1e-10


def quantize_fp8_ref(x: torch.Tensor, norm_weight: torch.Tensor | None = None,
                     eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_fp8 [M, K], scales [M, ceil(K/128)] fp32), x ~ x_fp8 * scale, each row's
    group of 128 columns scaled so that its largest |value| becomes 448. With norm_weight, x is
    first RMSNormed as rms_norm_ref norms it: a layer norm that cannot be folded into fp8 weights
    (layers.linear.NormedPackedLinear)."""
    if norm_weight is not None:
        x = rms_norm_ref(x, norm_weight, eps)
    q, scales = quantize_blocks_ref(x.unsqueeze(1), 1)
    return q.squeeze(1), scales.squeeze(1)


def quantize_fp8_weight_ref(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (W_fp8 [N, K], weight_scale_inv [ceil(N/128), ceil(K/128)] fp32), one scale a
    128 x 128 block: how an FP8 checkpoint stores a weight, and quantization="fp8" a bf16 one's."""
    return quantize_blocks_ref(weight, BLOCK)


def quantize_blocks_ref(x: torch.Tensor, block_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., R, K] in blocks of block_rows x 128, each scaled so that its largest |value| is 448."""
    *lead, rows, cols = x.shape
    row_blocks, col_blocks = -(-rows // block_rows), -(-cols // BLOCK)
    padded = F.pad(x.float(), (0, col_blocks * BLOCK - cols, 0, row_blocks * block_rows - rows))
    blocks = padded.view(*lead, row_blocks, block_rows, col_blocks, BLOCK)
    amax = blocks.abs().amax(dim=(-3, -1)).clamp(min=MIN_AMAX)
    # A tensor divisor: CUDA torch divides by a Python number as a product with its reciprocal,
    # which can round the last bit otherwise than the division (and the kernel's div_rn) does.
    scales = amax / torch.full_like(amax, FP8_MAX)
    q = (blocks / scales[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(*lead, row_blocks * block_rows, col_blocks * BLOCK)[..., :rows, :cols], scales


def dequantize_fp8_ref(q: torch.Tensor, scales: torch.Tensor, block_rows: int) -> torch.Tensor:
    """The fp32 values that q [R, K] (fp8) and its scales stand for, in blocks of block_rows x 128."""
    rows, cols = q.shape
    expanded = scales.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return q.float() * expanded


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                   eps: float = 0.0, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ bias) in x's dtype, W given as fp8 blocks and their scales, x quantized to fp8 by
    row groups first (after its RMSNorm, with norm_weight); with residual, added into it, the
    product rounded first (kernels.linear.linear_ref's order)."""
    q, scales = quantize_fp8_ref(x, norm_weight, eps)
    out = F.linear(dequantize_fp8_ref(q, scales, 1), dequantize_fp8_ref(weight, weight_scale, BLOCK),
                   None if bias is None else bias.float()).to(x.dtype)
    return out if residual is None else residual.add_(out)


# ---- Triton ----

import functools  # noqa: E402
import os  # noqa: E402
from dataclasses import dataclass  # noqa: E402

from mini_engine.kernels.fp8_rounding import to_fp8  # noqa: E402
from mini_engine.kernels.linear import product_output  # noqa: E402
from mini_engine.kernels.triton_utils import num_sms, pdl_enter, pdl_options, tl, triton  # noqa: E402

# Triton's interpreter (the CPU tests) converts to fp8 with other rounding than the GPU's.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _quantize_fp8_kernel(x_ptr, norm_ptr, q_ptr, scale_ptr, K, num_groups, stride_xm, stride_sm, stride_sg, eps,
                         GROUPS: tl.constexpr, BLOCK_K: tl.constexpr, MIN_AMAX: tl.constexpr,
                         HAS_NORM: tl.constexpr, HAND_ROUNDING: tl.constexpr, USE_PDL: tl.constexpr):
    """One program a row: the whole row as a [GROUPS, BLOCK_K] tile, so the norm's sum of squares
    and every group's largest |value| come from one read. Rounds as quantize_fp8_ref: the normed
    row to x's dtype, then the weight's product to it, then IEEE divisions (div_rn: Triton's `/` is
    approximate on the GPU) and round-to-nearest-even into e4m3: the GPU's own conversion, or by
    hand under the interpreter (HAND_ROUNDING), whose conversion rounds otherwise."""
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    groups = tl.arange(0, GROUPS)
    cols = groups[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
    mask = cols < K
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    if HAS_NORM:
        inv_rms = tl.rsqrt(tl.sum(tl.sum(x * x, axis=1), axis=0) / K + eps)
        weight = tl.load(norm_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        x = ((x * inv_rms).to(dtype).to(tl.float32) * weight).to(dtype).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), MIN_AMAX)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    scaled = tl.math.div_rn(x, scale[:, None])        # |scaled| <= 448, up to the division's rounding
    if HAND_ROUNDING:
        q = to_fp8(scaled, q_ptr.dtype.element_ty)
    else:
        q = scaled.to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + row * K + cols, q, mask=mask)
    tl.store(scale_ptr + row * stride_sm + groups * stride_sg, scale, mask=groups < num_groups)


@triton.jit
def _fp8_gemm_epilogue(acc, rows, cols, N, mask, bias_ptr, out_ptr, stride_om,
                       HAS_BIAS: tl.constexpr, ADD_OUT: tl.constexpr):
    """The tile's sums, with the bias, into out (or added into it) in out's dtype."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    if ADD_OUT:         # the product rounded first, as fp8_linear_ref rounds it
        acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_gemm_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr,
                     M, N, K, num_groups, stride_wn, stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, ADD_OUT: tl.constexpr,
                     USE_PDL: tl.constexpr):
    """Program (n_block, m_block, split): the sum over its share of K's 128-column groups g of
    (a_g . w_g^T) * a_scale[:, g] * w_scale[n // 128, g], the dot on fp8 operands, the sum in fp32.
    A product of a few rows (decode) reads the weight once: BLOCK_M covers the batch.

    With SPLIT_K > 1 a tile's groups are shared by SPLIT_K programs, so that a product with few
    output tiles (o_proj and down_proj at decode: 1024 columns, 2048 or 3072 deep) still streams
    its weight on every SM. Each leaves its partial sums in `partial_ptr` [SPLIT_K, M, N] and
    counts itself in the tile's counter; the one that counts last adds the partials in split
    order (the same sum whichever finishes last), writes the output and resets the counter."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    a_rows = a_ptr + rows.to(tl.int64)[:, None] * K
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    w_scale_rows = w_scale_ptr + (cols // BLOCK_K) * num_groups
    groups_per_split = tl.cdiv(num_groups, SPLIT_K)
    first_group = pid_k * groups_per_split
    last_group = tl.minimum(first_group + groups_per_split, num_groups)
    pdl_enter(USE_PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for g in range(first_group, last_group):
        offs_k = g * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_rows + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + offs_k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        a_scale = tl.load(a_scale_ptr + rows * num_groups + g, mask=row_ok, other=0.0)
        w_scale = tl.load(w_scale_rows + g, mask=col_ok, other=0.0)
        acc += tl.dot(a, tl.trans(w)) * a_scale[:, None] * w_scale[None, :]
    if SPLIT_K == 1:
        _fp8_gemm_epilogue(acc, rows, cols, N, mask, bias_ptr, out_ptr, stride_om, HAS_BIAS, ADD_OUT)
    else:
        partials = partial_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(partials + pid_k * M * N, acc, mask=mask)
        # Every thread's partial is written before the count (which releases it to the others);
        # the last program's reads of the others' come after its count acquired theirs.
        tl.debug_barrier()
        counter = counter_ptr + pid_m * tl.num_programs(0) + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for split in range(SPLIT_K):
                acc += tl.load(partials + split * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(counter, 0)
            _fp8_gemm_epilogue(acc, rows, cols, N, mask, bias_ptr, out_ptr, stride_om, HAS_BIAS, ADD_OUT)


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1


# One counter a tile, for the split-K launches; a split launch has at most two tiles an SM, and no
# GPU has 512 SMs. Allocated once a device and never replaced: CUDA graphs keep its address.
MAX_SPLIT_TILES = 1024
_split_counters: dict[torch.device, torch.Tensor] = {}


def split_counters(device: torch.device) -> torch.Tensor:
    if device not in _split_counters:
        _split_counters[device] = torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)
    return _split_counters[device]


def fp8_gemm_config(num_rows: int, n: int, k: int, sms: int) -> Fp8GemmConfig:
    """A tile by the product's rows: at a decode step's few rows, one tile covers them all and
    narrow columns give many programs to stream the weight; above, 64-row tiles. Where that makes
    fewer than 4 programs an SM, K is split over up to 4 programs a tile, each keeping 8 or more
    of K's groups: on the H200 (benchmarks/fp8_sweep.py) splitting K = 1024's 8 groups cost more
    than it gained, and splitting 0.6B's down_proj (24 groups) took it from 23 to 15 us at 128 rows."""
    if num_rows <= 32:
        block_m, block_n, stages = 16, 32, 4
    elif num_rows <= 512:
        block_m, block_n, stages = 64, 64, 3
    else:
        block_m, block_n, stages = 64, 128, 3
    tiles = triton.cdiv(num_rows, block_m) * triton.cdiv(n, block_n)
    split = 1
    while split < 4 and tiles * split * 2 <= 4 * sms and triton.cdiv(k, BLOCK) >= 16 * split:
        split *= 2
    return Fp8GemmConfig(block_m, block_n, num_stages=stages, split_k=split)


def quantize_fp8(x: torch.Tensor, norm_weight: torch.Tensor | None = None,
                 eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_fp8_ref in one launch. x: [M, K] with contiguous rows."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    scales = torch.empty(m, triton.cdiv(k, BLOCK), dtype=torch.float32, device=x.device)
    quantize_fp8_into(x, norm_weight, eps, q, scales)
    return q, scales


def quantize_fp8_into(x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, q: torch.Tensor,
                      scales: torch.Tensor) -> None:
    """quantize_fp8 into given storage: q's first M rows (contiguous), and scales [M, groups] of
    any strides (cuBLAS takes them column-major)."""
    assert x.stride(-1) == 1 and q.is_contiguous()
    m, k = x.shape
    if m:
        groups = triton.next_power_of_2(scales.shape[1])
        _quantize_fp8_kernel[(m,)](x, x if norm_weight is None else norm_weight, q, scales, k, scales.shape[1],
                                   x.stride(0), scales.stride(0), scales.stride(1), eps, GROUPS=groups,
                                   BLOCK_K=BLOCK, MIN_AMAX=MIN_AMAX, HAS_NORM=norm_weight is not None,
                                   HAND_ROUNDING=INTERPRETED, num_warps=min(max(groups // 2, 1), 8),
                                   **pdl_options(x.device))


# A product this large (2 M N K flops, from 128 rows) runs on cuBLAS's block-scaled fp8 GEMM where
# torch has one (torch.nn.functional.scaled_mm, 1x128 and 128x128 scales; Hopper). Measured on the
# H200, the quantize launch included (benchmarks/NOTES.md, entry 57): 8B's gate_up_proj at 2048
# rows 343 us against the Triton kernel's 755 (bf16: 522); at 256 rows 8B's qkv_proj 25 against
# 42, but 0.6B's 16 against 11 (1.1 Gflop): the Triton kernel keeps the small products.
CUBLAS_MIN_FLOP = 8e9
CUBLAS_MIN_ROWS = 128


@functools.lru_cache
def cublas_block_scaled(device: torch.device) -> bool:
    scaling = getattr(F, "ScalingType", None)
    return (device.type == "cuda" and scaling is not None and "BlockWise128x128" in scaling.__members__
            and torch.cuda.get_device_capability(device) == (9, 0))


def takes_cublas(m: int, n: int, k: int, dtype: torch.dtype, has_bias: bool, device: torch.device) -> bool:
    """Whether fp8_linear runs an [m, k] x [n, k]^T product on cuBLAS: a large one, of whole
    blocks, into bf16 and without a bias, where torch has the block-scaled GEMM."""
    return (m >= CUBLAS_MIN_ROWS and 2 * m * n * k >= CUBLAS_MIN_FLOP and not has_bias and dtype == torch.bfloat16
            and k % BLOCK == 0 and n % BLOCK == 0 and cublas_block_scaled(device))


def cublas_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      residual: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """fp8_linear's product on cuBLAS: the quantize launch writes the scales column-major, as
    cuBLAS reads them, for rows padded to 16 (the padding rows' products are computed and dropped)."""
    m, k = x.shape
    padded = triton.cdiv(m, 16) * 16
    q = torch.empty(padded, k, dtype=FP8, device=x.device)
    scales = torch.empty(k // BLOCK, padded, dtype=torch.float32, device=x.device).t()
    quantize_fp8_into(x, norm_weight, eps, q, scales[:m])
    out = F.scaled_mm(q, weight.t(), scales, F.ScalingType.BlockWise1x128, weight_scale.t(),
                      F.ScalingType.BlockWise128x128, output_dtype=x.dtype)[:m]
    return out if residual is None else residual.add_(out)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
               eps: float = 0.0, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp8_linear_ref in two launches: the activations' quantization (with the norm), then the
    block-scaled GEMM, Triton's or, for many rows of whole blocks in bf16, cuBLAS's. The grids
    depend on shapes only (CUDA-graph safe)."""
    assert weight.dtype == FP8 and weight.stride(-1) == 1 and x.shape[-1] == weight.shape[1]
    (m, k), n = x.shape, weight.shape[0]
    if takes_cublas(m, n, k, x.dtype, bias is not None, x.device):
        return cublas_fp8_linear(x, weight, weight_scale, residual, norm_weight, eps)
    q, scales = quantize_fp8(x, norm_weight, eps)
    out = product_output(x, n, residual)
    if m == 0:
        return out
    cfg = fp8_gemm_config(m, n, k, sms=num_sms(x.device))
    tiles = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))
    partials, counters = out, out           # unused unless split
    if cfg.split_k > 1:
        assert tiles[0] * tiles[1] <= MAX_SPLIT_TILES
        partials = torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=x.device)
        counters = split_counters(x.device)
    _fp8_gemm_kernel[tiles + (cfg.split_k,)](
        q, scales, weight, weight_scale, out if bias is None else bias, out, partials, counters, m, n, k,
        scales.shape[1], weight.stride(0), out.stride(0), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=BLOCK,
        SPLIT_K=cfg.split_k, HAS_BIAS=bias is not None, ADD_OUT=residual is not None, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_options(x.device))
    return out
