"""Probe: the gate/up projection with SwiGLU (and the folded norm's 1/rms) in its epilogue."""
import torch
from mini_engine.kernels.triton_utils import tl, triton
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _gate_up_silu_kernel(x_desc, w_desc, out_ptr, M, I, K, stride_om, eps,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, W_ON_M: tl.constexpr,
                         DOT_IN_FP32: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    if W_ON_M:
        acc_g = tl.zeros([BN, BM], tl.float32)
        acc_u = tl.zeros([BN, BM], tl.float32)
    else:
        acc_g = tl.zeros([BM, BN], tl.float32)
        acc_u = tl.zeros([BM, BN], tl.float32)
    sq = tl.zeros([BM], tl.float32)
    for k in range(0, K, BK):
        x = x_desc.load([pid_m * BM, k])
        wg = w_desc.load([pid_n * BN, k])
        wu = w_desc.load([I + pid_n * BN, k])
        xf = x.to(tl.float32)
        sq += tl.sum(xf * xf, axis=1)
        if DOT_IN_FP32:
            x, wg, wu = xf, wg.to(tl.float32), wu.to(tl.float32)
        if W_ON_M:
            acc_g = tl.dot(wg, x.T, acc_g)
            acc_u = tl.dot(wu, x.T, acc_u)
        else:
            acc_g = tl.dot(x, wg.T, acc_g)
            acc_u = tl.dot(x, wu.T, acc_u)
    if W_ON_M:
        acc_g = acc_g.T
        acc_u = acc_u.T
    inv_rms = tl.rsqrt(sq / K + eps)[:, None]
    dtype = out_ptr.dtype.element_ty
    g = (acc_g.to(dtype).to(tl.float32) * inv_rms).to(dtype).to(tl.float32)
    u = (acc_u.to(dtype).to(tl.float32) * inv_rms).to(dtype).to(tl.float32)
    act = (g * tl.sigmoid(g)).to(dtype).to(tl.float32)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    mask = (rows < M)[:, None] & (cols < I)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], (act * u).to(dtype), mask=mask)


class GateUpSilu:
    def __init__(self, x, w, eps, bm, bn, bk, w_on_m, num_warps=4, num_stages=3):
        (m, k), n2 = x.shape, w.shape[0]
        self.m, self.i, self.k, self.eps = m, n2 // 2, k, eps
        self.x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
        self.w_desc = TensorDescriptor.from_tensor(w, [bn, bk])
        self.out = torch.empty(m, self.i, dtype=x.dtype, device=x.device)
        self.cfg = dict(BM=bm, BN=bn, BK=bk, W_ON_M=w_on_m, DOT_IN_FP32=x.device.type == "cpu",
                        num_warps=num_warps, num_stages=num_stages)
        self.grid = (triton.cdiv(self.i, bn), triton.cdiv(m, bm))

    def __call__(self):
        _gate_up_silu_kernel[self.grid](self.x_desc, self.w_desc, self.out, self.m, self.i, self.k,
                                        self.out.stride(0), self.eps, **self.cfg)
        return self.out
