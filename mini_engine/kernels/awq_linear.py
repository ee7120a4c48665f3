"""Products with 4-bit AWQ weights: the format of Qwen3's own int4 checkpoints (Qwen3-*-AWQ,
written by AutoAWQ, "version": "gemm"), which vLLM runs with its awq kernels.

A projection's weight W [N, K] (nn.Linear's [out, in]) is stored transposed and in groups of
`group_size` input rows (128 in Qwen3-*-AWQ), each group with one fp16 scale and one 4-bit zero
point per output column:

    qweight [K, N / 8] int32    eight 4-bit values a word, along the output columns
    qzeros  [K / group, N / 8]  the zero points, packed the same way
    scales  [K / group, N]      fp16

    W^T[k, n] = (q[k, n] - z[k // group, n]) * s[k // group, n]

A word does not hold its eight columns in order: AutoAWQ packs columns 0, 2, 4, 6, 1, 3, 5, 7 into
its nibbles 0..7 (an order its CUDA dequantization unpacks cheaply), so column j of a word sits
in nibble AWQ_NIBBLE_OF_COLUMN[j].

A decode step's few rows read 4 bits a weight instead of 16, three ways (awq_linear):
- up to GEMV_ROWS rows, a product without tensor cores (_awq_gemv_kernel): each program unpacks a
  tile of words in registers and multiplies the rows' inputs into it with fp32 FMAs. The tensor
  cores' path must lay the dequantized tile out in shared memory for the MMA, and that round trip,
  not the 4-bit reads, set its speed (NOTES entry 60: 1.0-1.3x bf16's time even at one row).
  Neither reaches the 4-bit bytes' speed: at one row the FMA product runs at about bf16's time
  (NOTES entry 61; making the values floats by their bits instead of a conversion did not help);
- up to DEQUANTIZE_ROWS rows, a tensor-core product that dequantizes each tile of W as it loads
  it and feeds the MMA in the activations' dtype (_awq_gemm_kernel);
- from DEQUANTIZE_ROWS rows up, the whole weight dequantized once into the activations' dtype
  for cuBLAS (vLLM's rule, which draws the line at 256 rows).
"""
import torch
import torch.nn.functional as F

PACK = 8                        # 4-bit values an int32 holds
AWQ_BITS = 4
AWQ_MAX = (1 << AWQ_BITS) - 1
# AutoAWQ's packing order: nibble i of a word holds column AWQ_COLUMN_OF_NIBBLE[i] of its eight.
AWQ_COLUMN_OF_NIBBLE = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_NIBBLE_OF_COLUMN = tuple(AWQ_COLUMN_OF_NIBBLE.index(j) for j in range(PACK))    # (0, 4, 1, 5, 2, 6, 3, 7)
# Rows from which the product dequantizes the weight for cuBLAS instead of dequantizing tiles
# (benchmarks/awq_sweep.py: from 64 rows the pair wins on most of Qwen3's projections).
DEQUANTIZE_ROWS = 64
# Rows up to which the product runs on FMAs (_awq_gemv_kernel), without tensor cores: a row's
# FMAs a weight come on top of the unpacking's few operations, which a batch shares (session 61's
# sweep: faster than the tensor cores at one row, even at two, slower from four).
GEMV_ROWS = 1


def pack_awq_ref(values: torch.Tensor) -> torch.Tensor:
    """[R, C] integers in 0..15 -> [R, C / 8] int32 words in AutoAWQ's order."""
    rows, cols = values.shape
    nibbles = values.to(torch.int32).view(rows, cols // PACK, PACK)[..., list(AWQ_COLUMN_OF_NIBBLE)]
    shifts = torch.arange(PACK, dtype=torch.int32, device=values.device) * AWQ_BITS
    # The sum of disjoint nibbles is their OR; int32 wraps where nibble 7 sets the sign bit.
    return (nibbles << shifts).sum(-1, dtype=torch.int32)


def unpack_awq_ref(packed: torch.Tensor) -> torch.Tensor:
    """pack_awq_ref's inverse: [R, C / 8] int32 -> [R, C] int32 values in 0..15."""
    shifts = torch.tensor(AWQ_NIBBLE_OF_COLUMN, dtype=torch.int32, device=packed.device) * AWQ_BITS
    return ((packed.unsqueeze(-1) >> shifts) & AWQ_MAX).flatten(-2)


def quantize_awq_ref(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [N, K] -> (qweight [K, N/8], qzeros [K/group, N/8], scales [K/group, N] fp16), rounded to
    nearest with a zero point a group as AutoAWQ's pseudo-quantization does (without its search
    for activation-aware scales, which needs calibration data: the format is the same)."""
    n, k = weight.shape
    groups = weight.float().t().reshape(k // group_size, group_size, n)
    high, low = groups.amax(dim=1), groups.amin(dim=1)
    scales = ((high - low).clamp(min=1e-5) / AWQ_MAX).half()
    zeros = (-torch.round(low / scales.float())).clamp(0, AWQ_MAX)
    q = (torch.round(groups / scales.float()[:, None]) + zeros[:, None]).clamp(0, AWQ_MAX)
    return pack_awq_ref(q.reshape(k, n)), pack_awq_ref(zeros), scales


def dequantize_awq_ref(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """W^T [K, N] in fp32, exactly: (q - z) * s, each a small integer times an fp16 scale."""
    group_size = qweight.shape[0] // scales.shape[0]
    q = unpack_awq_ref(qweight).float()
    z = unpack_awq_ref(qzeros).float().repeat_interleave(group_size, 0)
    return (q - z) * scales.float().repeat_interleave(group_size, 0)


def awq_linear_ref(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   residual: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ bias) in x's dtype, W's values rounded to x's dtype first (what the tensor cores
    read); with residual, added into it, the product rounded first (kernels.linear.linear_ref's
    order)."""
    out = F.linear(x, dequantize_awq_ref(qweight, qzeros, scales).to(x.dtype).t(), bias)
    return out if residual is None else residual.add_(out)


# ---- Triton ----

import dataclasses  # noqa: E402
from dataclasses import dataclass  # noqa: E402

from mini_engine.kernels.linear import _sum_splits_kernel, product_output  # noqa: E402
from mini_engine.kernels.triton_utils import num_sms, pdl_enter, pdl_options, tl, triton  # noqa: E402


@triton.jit
def _awq_unpack(words, BLOCK_N: tl.constexpr):
    """words [R, BLOCK_N / 8] int32 -> their [R, BLOCK_N] 4-bit values in column order: column j
    of a word shifted down from nibble AWQ_NIBBLE_OF_COLUMN[j] = j // 2 + 4 (j % 2). The words
    load as one contiguous vector a row; the unpacking is register arithmetic."""
    j = tl.arange(0, 8)
    shifts = ((j // 2) + (j % 2) * 4) * 4
    values = (words[:, :, None] >> shifts[None, None, :]) & 0xF
    return tl.reshape(values, [words.shape[0], BLOCK_N])


@triton.jit
def _awq_gemv_kernel(x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, bias_ptr, out_ptr, partial_ptr, M, N, K,
                     k_per_split, stride_xm, stride_om, GROUP: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                     ADD_OUT: tl.constexpr, USE_PDL: tl.constexpr):
    """out[M, N] (+)= x[M, K] W^T for M <= ROWS, on FMAs. Program (word tile, split) holds BLOCK_W
    words of columns (8 BLOCK_W columns) as [BLOCK_W, 8] tiles, so the unpacking needs no reshape:
    column j of a word is nibble j // 2 + 4 (j % 2). It sums k_per_split inputs (whole K tiles,
    each inside one group) from split * k_per_split; with SPLIT, its fp32 partial goes to
    partial[split] for kernels.linear's _sum_splits_kernel (no bias then). W stays in fp32: the
    tensor-core paths round it to x's dtype first, this one need not."""
    pid_w, split = tl.program_id(0), tl.program_id(1)
    words = N // 8
    word = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    j = tl.arange(0, 8)
    shifts = ((j // 2) + (j % 2) * 4) * 4
    cols = word[:, None] * 8 + j[None, :]                                   # [BLOCK_W, 8]
    word_ok = word < words
    col_ok = word_ok[:, None] & (j < 8)[None, :]
    rows = tl.arange(0, ROWS)
    row_ok = rows < M
    ks = tl.arange(0, BLOCK_K)
    pdl_enter(USE_PDL)
    acc = tl.zeros([ROWS, BLOCK_W, 8], tl.float32)
    k_lo = split * k_per_split
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
        q = tl.load(qweight_ptr + (k0 + ks)[:, None].to(tl.int64) * words + word[None, :], mask=word_ok[None, :],
                    other=0)
        group = k0 // GROUP
        z = tl.load(qzeros_ptr + group * words + word, mask=word_ok, other=0)
        s = tl.load(scales_ptr + group * N + cols, mask=col_ok, other=0.0).to(tl.float32)
        zs = ((z[:, None] >> shifts[None, :]) & 0xF).to(tl.float32) * s                  # z * s
        w = ((q[:, :, None] >> shifts[None, None, :]) & 0xF).to(tl.float32) * s[None] - zs[None]  # [BLOCK_K, BLOCK_W, 8]
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + (k0 + ks)[None, :], mask=row_ok[:, None],
                    other=0.0).to(tl.float32)
        acc += tl.sum(x[:, :, None, None] * w[None], axis=1)
    mask = row_ok[:, None, None] & col_ok[None]
    if SPLIT:
        tl.store(partial_ptr + (split * M + rows.to(tl.int64))[:, None, None] * N + cols[None], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None]
        out_ptrs = out_ptr + rows[:, None, None].to(tl.int64) * stride_om + cols[None]
        if ADD_OUT:
            acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
            acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _awq_gemm_kernel(x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, bias_ptr, out_ptr, partial_ptr, M, N, K,
                     stride_xm, stride_om, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, ADD_OUT: tl.constexpr,
                     DOT_IN_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    """out[M, N] (+)= x[M, K] W^T, W's tiles dequantized as they load. BLOCK_K divides GROUP, so a
    K tile lies in one group: one row of zeros and scales a tile. N is whole words (8 | N), and
    a tile's columns whole words too (8 | BLOCK_N). Program (n tile, m tile, split) sums the
    split-th of SPLIT_K equal shares of K (SPLIT_K * BLOCK_K divides K); with more than one, its
    fp32 partial goes to partial[split] for kernels.linear's _sum_splits_kernel (no bias then)."""
    pid_n, pid_m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    word_cols = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    ks = tl.arange(0, BLOCK_K)
    row_ok, col_ok, word_ok = rows < M, cols < N, word_cols < N // 8
    words = N // 8
    pdl_enter(USE_PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_per_split = K // SPLIT_K
    for k0 in range(split * k_per_split, (split + 1) * k_per_split, BLOCK_K):
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + (k0 + ks)[None, :], mask=row_ok[:, None],
                    other=0.0)
        q = tl.load(qweight_ptr + (k0 + ks)[:, None].to(tl.int64) * words + word_cols[None, :],
                    mask=word_ok[None, :], other=0)
        group = k0 // GROUP
        z = tl.load(qzeros_ptr + group * words + word_cols, mask=word_ok, other=0)
        s = tl.load(scales_ptr + group * N + cols, mask=col_ok, other=0.0).to(tl.float32)
        zs = _awq_unpack(z[None, :], BLOCK_N).to(tl.float32) * s[None, :]          # z * s, a row a tile
        w = (_awq_unpack(q, BLOCK_N).to(tl.float32) * s[None, :] - zs).to(x.dtype)  # (q - z) * s
        if DOT_IN_FP32:         # the interpreter has no bf16 dot: W rounded to x's dtype all the same
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(x, w, input_precision=INPUT_PRECISION)
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K > 1:
        tl.store(partial_ptr + (split * M + rows.to(tl.int64))[:, None] * N + cols[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
        if ADD_OUT:
            acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
            acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _awq_dequantize_kernel(qweight_ptr, qzeros_ptr, scales_ptr, out_ptr, K, N, GROUP: tl.constexpr,
                           BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """out [K, N] = W^T in out's dtype."""
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    word_cols = tl.program_id(0) * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    words = N // 8
    word_mask = (ks < K)[:, None] & (word_cols < words)[None, :]
    groups = ks // GROUP
    q = tl.load(qweight_ptr + ks[:, None].to(tl.int64) * words + word_cols[None, :], mask=word_mask, other=0)
    z = tl.load(qzeros_ptr + groups[:, None] * words + word_cols[None, :], mask=word_mask, other=0)
    mask = (ks < K)[:, None] & (cols < N)[None, :]
    s = tl.load(scales_ptr + groups[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = (_awq_unpack(q, BLOCK_N).to(tl.float32) * s - _awq_unpack(z, BLOCK_N).to(tl.float32) * s)
    tl.store(out_ptr + ks[:, None].to(tl.int64) * N + cols[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class AwqTile:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1


def awq_tile(num_rows: int, out_features: int, in_features: int, group_size: int, num_sms: int) -> AwqTile:
    """The fused product's tile, from benchmarks/awq_sweep.py on the H200 (Qwen3-0.6B's and -8B's
    projections, weights read from HBM; NOTES entry 60): 16 rows a tile up to 16 rows (and to 32
    for narrow projections, N <= 2048), then 32 and 64; columns 32 a tile for narrow projections,
    128 for very wide ones (8B's gate/up), else 64; and K split until about three programs an SM
    (up to 8 splits at 16 rows a tile, 2 above), each split whole K tiles."""
    narrow = out_features <= 2048
    block_m = 16 if num_rows <= 16 or (narrow and num_rows <= 32) else 32 if num_rows <= 32 else 64
    block_n = 32 if narrow else 128 if out_features >= 16384 and block_m == 16 else 64
    block_k = 128 if block_m <= 32 else 64
    while group_size % block_k:
        block_k //= 2
    tiles = -(-num_rows // block_m) * -(-out_features // block_n)
    split_k, most = 1, 8 if block_m == 16 else 2
    while (split_k < most and tiles * split_k * 2 <= 3 * num_sms
           and in_features % (2 * split_k * block_k) == 0):
        split_k *= 2
    return AwqTile(block_m, block_n, block_k, split_k=split_k)


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """dequantize_awq_ref's W^T [K, N], in dtype, by one Triton launch."""
    k, n = qweight.shape[0], scales.shape[1]
    out = torch.empty(k, n, dtype=dtype, device=qweight.device)
    block_k, block_n = 32, 128
    _awq_dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        qweight, qzeros, scales, out, k, n, GROUP=k // scales.shape[0], BLOCK_K=block_k, BLOCK_N=block_n)
    return out


@dataclass(frozen=True)
class AwqGemvTile:
    block_w: int            # words of columns a program (8 columns each)
    block_k: int
    num_warps: int = 4
    split_k: int = 1


def awq_gemv_tile(out_features: int, in_features: int, group_size: int) -> AwqGemvTile:
    """The FMA product's tile; the same at every row count, so that a row's sums run in the same
    order whether a CUDA graph pads its batch or not. 16 words (128 columns) by 128 inputs, and
    K split in 8 where it divides so (session 61's sweep at one row: 8 splits the fastest on every
    projection of 0.6B and 8B, even where 2 would already fill the SMs)."""
    block_w, block_k = 16, 128
    while group_size % block_k:
        block_k //= 2
    split_k = 1
    while split_k < 8 and in_features % (2 * split_k * block_k) == 0:
        split_k *= 2
    return AwqGemvTile(block_w, block_k, split_k=split_k)


def awq_linear(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               residual: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """awq_linear_ref on Triton: x [M, K] with contiguous rows -> [M, N] in x's dtype (with
    residual: added into it). The grid depends on shapes only (CUDA-graph safe)."""
    assert x.stride(-1) == 1 and qweight.is_contiguous() and scales.is_contiguous()
    (m, k), n = x.shape, scales.shape[1]
    group_size = k // scales.shape[0]
    if m >= DEQUANTIZE_ROWS:
        weight_t = dequantize_awq(qweight, qzeros, scales, x.dtype)
        if residual is not None and bias is None:
            return residual.addmm_(x, weight_t)
        out = torch.matmul(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)
        return out if residual is None else residual.add_(out)
    out = product_output(x, n, residual)
    if m == 0:
        return out
    pdl = pdl_options(x.device)
    gemv = m <= GEMV_ROWS
    tile = (awq_gemv_tile(n, k, group_size) if gemv
            else awq_tile(m, n, k, group_size, num_sms(x.device)))
    if bias is not None and tile.split_k > 1:       # the splits' sum adds no bias
        tile = dataclasses.replace(tile, split_k=1)
    partial = out
    if tile.split_k > 1:
        partial = torch.empty(tile.split_k, m, n, dtype=torch.float32, device=x.device)
    bias_or_out = out if bias is None else bias
    if gemv:
        _awq_gemv_kernel[(triton.cdiv(n // 8, tile.block_w), tile.split_k)](
            x, qweight, qzeros, scales, bias_or_out, out, partial, m, n, k, k // tile.split_k, x.stride(0),
            out.stride(0), GROUP=group_size, ROWS=triton.next_power_of_2(m), BLOCK_W=tile.block_w,
            BLOCK_K=tile.block_k, SPLIT=tile.split_k > 1, HAS_BIAS=bias is not None, ADD_OUT=residual is not None,
            num_warps=tile.num_warps, **pdl)
    else:
        grid = (triton.cdiv(n, tile.block_n), triton.cdiv(m, tile.block_m), tile.split_k)
        _awq_gemm_kernel[grid](x, qweight, qzeros, scales, bias_or_out, out, partial, m, n, k,
                               x.stride(0), out.stride(0), GROUP=group_size, BLOCK_M=tile.block_m,
                               BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, SPLIT_K=tile.split_k,
                               HAS_BIAS=bias is not None, ADD_OUT=residual is not None,
                               DOT_IN_FP32=x.device.type == "cpu",
                               # fp32 activations get fp32 products, not TF32 (bf16/fp16 ignore this)
                               INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                               num_warps=tile.num_warps, num_stages=tile.num_stages, **pdl)
    if tile.split_k > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](partial, out, m, n, out.stride(0), SPLIT_K=tile.split_k,
                                                        BLOCK=block, ADD_OUT=residual is not None, num_warps=4, **pdl)
    return out
