"""Variant: y = x W^T through TMA tiles, in two orientations: 'xw' (x rows on the dot's M side) and
'wx' (weight rows on the M side, so that a batch of 64-256 rows is the N side of wgmma), with an
optional split of K whose fp32 partials a second kernel adds."""
import torch

from mini_engine.kernels.triton_utils import tl, triton
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _tma_gemm_kernel(x_desc, w_desc, out_ptr, partial_ptr, M, N, K, stride_om,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
                     W_ON_M: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    k_per_split = K // SPLIT_K
    k_lo = split * k_per_split
    if W_ON_M:
        acc = tl.zeros([BN, BM], tl.float32)
    else:
        acc = tl.zeros([BM, BN], tl.float32)
    for k in range(k_lo, k_lo + k_per_split, BK):
        w = w_desc.load([pid_n * BN, k])
        x = x_desc.load([pid_m * BM, k])
        if W_ON_M:
            acc = tl.dot(w, x.T, acc)
        else:
            acc = tl.dot(x, w.T, acc)
    if W_ON_M:
        acc = acc.T
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mask)
    else:
        tl.store(partial_ptr + (split * M + rows.to(tl.int64))[:, None] * N + cols[None, :], acc, mask=mask)


@triton.jit
def _sum_kernel(partial_ptr, out_ptr, MN, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(partial_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


class TmaLinear:
    """Holds the descriptors and buffers for one (x, w) pair so that a graph can replay it."""

    def __init__(self, x, w, bm, bn, bk, split_k=1, w_on_m=True, num_warps=4, num_stages=4):
        (m, k), n = x.shape, w.shape[0]
        assert k % (bk * split_k) == 0
        self.args = (m, n, k)
        self.cfg = dict(BM=bm, BN=bn, BK=bk, SPLIT_K=split_k, W_ON_M=w_on_m, num_warps=num_warps,
                        num_stages=num_stages)
        self.x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
        self.w_desc = TensorDescriptor.from_tensor(w, [bn, bk])
        self.out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        self.partial = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else self.out
        self.grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split_k)

    def __call__(self):
        m, n, k = self.args
        _tma_gemm_kernel[self.grid](self.x_desc, self.w_desc, self.out, self.partial, m, n, k, self.out.stride(0),
                                    **self.cfg)
        if self.cfg["SPLIT_K"] > 1:
            _sum_kernel[(triton.cdiv(m * n, 1024),)](self.partial, self.out, m * n, SPLIT_K=self.cfg["SPLIT_K"],
                                                     BLOCK=1024, num_warps=4)
        return self.out
