"""Decode-step projections: y = x W^T when x has only a few rows.

A decode step multiplies every weight matrix by one row per running sequence. At a few rows the
work is reading W once, and cuBLAS's kernels for some of these shapes reach a fraction of the
bandwidth (measured on the H200 at one row: the 2048 -> 1024 o_proj in 10.6 us, 0.4 TB/s). The
Triton kernel below gives every program a thin slice of W's rows and streams it through shared
memory, deep enough to keep the memory system busy; large batches stay with cuBLAS.
"""
import torch
import torch.nn.functional as F


def linear_ref(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T; with residual, residual + x W^T written into residual's storage (the decoder's
    residual add). The product is rounded to the model dtype before the add, as transformers
    rounds it, and as cuBLAS's beta = 1 epilogue does (on the H200 its sums equal the skinny
    kernel's bit for bit at 8-40 rows: benchmarks/residual_add_paths.py), so a row's bits do not
    depend on which of the two its batch size takes."""
    if residual is None:
        return F.linear(x, weight)
    return residual.add_(F.linear(x, weight))


# ---- Triton ----

from dataclasses import dataclass  # noqa: E402

from mini_engine.kernels.triton_utils import pdl_enter, pdl_options, tl, triton  # noqa: E402


@triton.jit
def _skinny_linear_kernel(x_ptr, w_ptr, out_ptr, partial_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_IN_FP32: tl.constexpr,
                          INPUT_PRECISION: tl.constexpr, ADD_OUT: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (n_block, m_block, k_split): out[m_block, n_block] over the k_split-th of SPLIT_K
    equal shares of K, accumulated in fp32. With one share the result is rounded and stored (added
    to what out holds, with ADD_OUT); with more, the fp32 partial goes to partial[k_split] and
    _sum_splits_kernel adds the shares. BLOCK_M covers the whole batch at few rows, so each weight
    tile is read from memory once."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    k_per_split = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_lo = split * k_per_split
    pdl_enter(USE_PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    for k in range(k_lo, tl.minimum(k_lo + k_per_split, K), BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(x_rows + offs_k[None, :], mask=row_ok[:, None], other=0.0)
            w = tl.load(w_rows + offs_k[None, :], mask=col_ok[:, None], other=0.0)
        else:
            k_ok = offs_k < K
            x = tl.load(x_rows + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_rows + offs_k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT_IN_FP32:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=INPUT_PRECISION)
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
        if ADD_OUT:     # the product rounded first, as linear_ref rounds it
            acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
            acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(partial_ptr + (split * M + rows.to(tl.int64))[:, None] * N + cols[None, :], acc, mask=mask)


@triton.jit
def _sum_splits_kernel(partial_ptr, out_ptr, M, N, stride_om, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
                       ADD_OUT: tl.constexpr, USE_PDL: tl.constexpr):
    """out[m, n] = sum over s of partial[s, m, n], rounded to out's dtype; with ADD_OUT, that
    rounded sum is added to what out holds (the order linear_ref rounds in)."""
    pdl_enter(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    out_ptrs = out_ptr + (offs // N).to(tl.int64) * stride_om + offs % N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(partial_ptr + s * M * N + offs, mask=mask, other=0.0)
    if ADD_OUT:
        acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32) + tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int = 16
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    block_m: int | None = None      # None: the whole batch (up to SKINNY_MAX_ROWS) in one tile


# The most rows the skinny kernel is ever asked to take; bigger batches go to cuBLAS.
SKINNY_MAX_ROWS = 64


def skinny_config(num_rows: int, out_features: int, in_features: int) -> SkinnyConfig | None:
    """The skinny kernel's configuration for an [num_rows, in_features] x [out_features,
    in_features]^T product, or None where cuBLAS is as fast. From benchmarks/decode_sweep.py on
    the H200 (Qwen3-0.6B's projections, weights read from HBM, CUDA-graph replay): the kernel wins
    on the narrow projections (1024 outputs: o_proj and down_proj) at few rows, by 10.6 -> 5.8 us
    for o_proj at one row and 7.8 -> 6.7 us for down_proj; cuBLAS matches it on the wide ones (qkv,
    gate/up) and on o_proj from 32 rows."""
    if num_rows > SKINNY_MAX_ROWS or out_features > 2048:
        return None
    if in_features >= 3072:                       # a long K: split it to put more programs to work
        return SkinnyConfig(split_k=4 if num_rows <= 32 else 2)
    return SkinnyConfig() if num_rows <= 16 else None


def product_output(x: torch.Tensor, n: int, residual: torch.Tensor | None) -> torch.Tensor:
    """Where a kernel stores x [M, K] times an [N, K] weight: into residual (adding to it), which
    must be [M, N] with contiguous rows, or a new [M, N] tensor in x's dtype."""
    if residual is None:
        return torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    assert residual.shape == (x.shape[0], n) and residual.stride(-1) == 1
    return residual


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, config: SkinnyConfig | None = None,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """linear_ref(x, weight, residual) for x [M, K] with M small, weight [N, K] row-major -> [M, N]
    in x's dtype (with residual: into residual, [M, N] with contiguous rows). The grid depends on
    shapes only (CUDA-graph safe)."""
    assert x.stride(-1) == 1 and weight.stride(-1) == 1 and x.shape[-1] == weight.shape[1]
    (m, k), n = x.shape, weight.shape[0]
    out = product_output(x, n, residual)
    if m == 0:
        return out
    cfg = config or skinny_config(m, n, k) or SkinnyConfig()
    block_m = cfg.block_m or max(16, triton.next_power_of_2(min(m, SKINNY_MAX_ROWS)))
    # The configs were tuned as bf16 tiles; fp32 tiles of the same width need twice the shared
    # memory (64 rows x 256 columns x 4 stages did not fit on the H200), so halve their K.
    block_k = max(16, cfg.block_k * 2 // x.element_size())
    partial = out
    if cfg.split_k > 1:
        partial = torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, block_m), cfg.split_k)
    pdl = pdl_options(x.device)
    _skinny_linear_kernel[grid](x, weight, out, partial, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
                                BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, SPLIT_K=cfg.split_k,
                                EVEN_K=k % (block_k * cfg.split_k) == 0, DOT_IN_FP32=x.device.type == "cpu",
                                # fp32 weights get fp32 products, not TF32 (bf16/fp16 ignore this)
                                INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                                ADD_OUT=residual is not None,
                                num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl)
    if cfg.split_k > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](partial, out, m, n, out.stride(0), SPLIT_K=cfg.split_k,
                                                        BLOCK=block, ADD_OUT=residual is not None, num_warps=4,
                                                        **pdl)
    return out
