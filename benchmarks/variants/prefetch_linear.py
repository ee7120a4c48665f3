"""Probe: a decode projection whose program loads its whole weight slice before the PDL wait, so the
weight streams in while the kernel ahead still runs; after the wait it reads x and does one dot."""
import torch
from mini_engine.kernels.linear import _sum_splits_kernel
from mini_engine.kernels.triton_utils import pdl_enter, pdl_options, tl, triton


@triton.jit
def _prefetch_linear_kernel(x_ptr, w_ptr, out_ptr, partial_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            SPLIT_K: tl.constexpr, ADD_OUT: tl.constexpr, DOT_IN_FP32: tl.constexpr,
                            USE_PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = split * BLOCK_K + tl.arange(0, BLOCK_K)
    col_ok = cols < N
    k_ok = ks < K
    w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :], mask=col_ok[:, None] & k_ok[None, :],
                other=0.0)
    pdl_enter(USE_PDL)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                other=0.0)
    if DOT_IN_FP32:
        x, w = x.to(tl.float32), w.to(tl.float32)
    acc = tl.dot(x, tl.trans(w))
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
        if ADD_OUT:
            acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
            acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(partial_ptr + (split * M + rows.to(tl.int64))[:, None] * N + cols[None, :], acc, mask=mask)


def prefetch_linear(x, weight, residual=None, block_n=16, max_block_k=1024, num_warps=4):
    (m, k), n = x.shape, weight.shape[0]
    assert m <= 64 and x.stride(-1) == 1 and weight.stride(-1) == 1
    out = residual if residual is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    split = triton.cdiv(k, max_block_k)
    block_k = triton.next_power_of_2(triton.cdiv(k, split))
    partial = out
    if split > 1:
        partial = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    pdl = pdl_options(x.device)
    _prefetch_linear_kernel[(triton.cdiv(n, block_n), split)](
        x, weight, out, partial, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
        ADD_OUT=residual is not None, DOT_IN_FP32=x.device.type == "cpu", num_warps=num_warps, **pdl)
    if split > 1:
        _sum_splits_kernel[(triton.cdiv(m * n, 1024),)](partial, out, m, n, out.stride(0), SPLIT_K=split, BLOCK=1024,
                                                        ADD_OUT=residual is not None, num_warps=4, **pdl)
    return out
