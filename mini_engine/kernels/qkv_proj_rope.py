"""The QKV projection with everything that follows it before attention, in one launch: a decode
step's y = x W_qkv^T, Qwen3's per-head RMSNorm and rotary embedding on q and k, and the KV-cache
write. Apart, these are a cuBLAS GEMM and a small kernel that reads its output back (2-3 us and a
launch a layer at decode batch sizes); here each program owns whole heads, so the norm and the
rotation run on the product while it is still in registers.
"""
import torch

from mini_engine.kernels.linear import linear_ref
from mini_engine.kernels.rotary_kv import qk_norm_rope_kv_write_ref


def qkv_proj_rope_ref(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                      q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor, eps: float,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """x: [T, hidden]; weight: [(Hq + 2 Hkv) D, hidden]. Returns the rotated, normed q as [T, Hq, D]."""
    return qk_norm_rope_kv_write_ref(linear_ref(x, weight), positions, cos_sin_cache, q_norm_weight, k_norm_weight,
                                     eps, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, head_dim)


# ---- Triton ----

from dataclasses import dataclass  # noqa: E402

from mini_engine.kernels.rotary_kv import _rms_norm_rope  # noqa: E402
from mini_engine.kernels.triton_utils import tl, triton  # noqa: E402


@triton.jit
def _qkv_proj_rope_kernel(
        x_ptr, w_ptr, positions_ptr, cos_sin_ptr, q_norm_ptr, k_norm_ptr, q_out_ptr,
        k_cache_ptr, v_cache_ptr, slot_mapping_ptr, eps, M, K,
        stride_xm, stride_wn, stride_cos_sin, stride_cache_block, stride_cache_offset, stride_cache_head,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, W_ON_M: tl.constexpr, EVEN_K: tl.constexpr,
        DOT_IN_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Program (head, row block): one head of the packed output (q heads, then k, then v) for
    BLOCK_M rows. The head's two halves (the operands of the neox rotation) are two products of
    HEAD_DIM/2 weight rows each, accumulated in fp32 and rounded to the model dtype as cuBLAS's
    output would be; q and k heads are then normed and rotated (_rms_norm_rope, the rotary
    kernel's own arithmetic), q is stored, k and v go to the paged cache (slot -1: nowhere).
    W_ON_M puts the weight rows on the dot's M side, so that a few rows of x are its N side."""
    HALF: tl.constexpr = HEAD_DIM // 2
    head = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    half = tl.arange(0, HALF)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_lo = w_ptr + (head * HEAD_DIM + half).to(tl.int64)[:, None] * stride_wn
    w_hi = w_lo + HALF * stride_wn
    if W_ON_M:
        acc_lo = tl.zeros([HALF, BLOCK_M], tl.float32)
        acc_hi = tl.zeros([HALF, BLOCK_M], tl.float32)
    else:
        acc_lo = tl.zeros([BLOCK_M, HALF], tl.float32)
        acc_hi = tl.zeros([BLOCK_M, HALF], tl.float32)
    for k in range(0, K, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(x_rows + offs_k[None, :], mask=row_ok[:, None], other=0.0)
            w1 = tl.load(w_lo + offs_k[None, :])
            w2 = tl.load(w_hi + offs_k[None, :])
        else:
            k_ok = (offs_k < K)[None, :]
            x = tl.load(x_rows + offs_k[None, :], mask=row_ok[:, None] & k_ok, other=0.0)
            w1 = tl.load(w_lo + offs_k[None, :], mask=k_ok, other=0.0)
            w2 = tl.load(w_hi + offs_k[None, :], mask=k_ok, other=0.0)
        if DOT_IN_FP32:
            x, w1, w2 = x.to(tl.float32), w1.to(tl.float32), w2.to(tl.float32)
        if W_ON_M:
            acc_lo = tl.dot(w1, tl.trans(x), acc_lo, input_precision=INPUT_PRECISION)
            acc_hi = tl.dot(w2, tl.trans(x), acc_hi, input_precision=INPUT_PRECISION)
        else:
            acc_lo = tl.dot(x, tl.trans(w1), acc_lo, input_precision=INPUT_PRECISION)
            acc_hi = tl.dot(x, tl.trans(w2), acc_hi, input_precision=INPUT_PRECISION)
    dtype = q_out_ptr.dtype.element_ty
    if W_ON_M:
        x1, x2 = tl.trans(acc_lo).to(dtype), tl.trans(acc_hi).to(dtype)     # [BLOCK_M, HALF]
    else:
        x1, x2 = acc_lo.to(dtype), acc_hi.to(dtype)

    if head < NUM_HEADS + NUM_KV_HEADS:          # q or k: per-head RMSNorm, then the rotation
        norm_ptr = q_norm_ptr
        if head >= NUM_HEADS:
            norm_ptr = k_norm_ptr
        pos = tl.load(positions_ptr + rows, mask=row_ok, other=0)
        cos_sin = cos_sin_ptr + pos.to(tl.int64)[:, None] * stride_cos_sin + half[None, :]
        cos, sin = tl.load(cos_sin), tl.load(cos_sin + HALF)
        w_norm1 = tl.load(norm_ptr + half)[None, :]
        w_norm2 = tl.load(norm_ptr + HALF + half)[None, :]
        x1, x2 = _rms_norm_rope(x1, x2, w_norm1, w_norm2, cos, sin, eps, HEAD_DIM)

    if head < NUM_HEADS:
        q_out = q_out_ptr + rows.to(tl.int64)[:, None] * (NUM_HEADS * HEAD_DIM) + head * HEAD_DIM + half[None, :]
        tl.store(q_out, x1, mask=row_ok[:, None])
        tl.store(q_out + HALF, x2, mask=row_ok[:, None])
    else:
        cache_ptr = k_cache_ptr
        kv_head = head - NUM_HEADS
        if kv_head >= NUM_KV_HEADS:
            cache_ptr = v_cache_ptr
            kv_head -= NUM_KV_HEADS
        slot = tl.load(slot_mapping_ptr + rows, mask=row_ok, other=-1)
        ok = (slot >= 0)[:, None]
        slot = tl.maximum(slot, 0)          # keeps the masked-off address in range
        cache = (cache_ptr + ((slot // BLOCK_SIZE) * stride_cache_block
                              + (slot % BLOCK_SIZE) * stride_cache_offset)[:, None]
                 + kv_head * stride_cache_head + half[None, :])
        tl.store(cache, x1.to(cache_ptr.dtype.element_ty), mask=ok)
        tl.store(cache + HALF, x2.to(cache_ptr.dtype.element_ty), mask=ok)


@dataclass(frozen=True)
class QKVRopeConfig:
    block_m: int = 16
    block_k: int = 128
    w_on_m: bool = True
    num_warps: int = 4
    num_stages: int = 4


# The most rows the fused kernel is asked to take (the largest decode graph); prefill steps, with
# thousands of rows, are GEMM-bound and stay with cuBLAS and the separate rotary kernel.
QKV_ROPE_MAX_ROWS = 256


def qkv_rope_config(num_rows: int) -> QKVRopeConfig | None:
    """The fused kernel's configuration for a step of num_rows tokens, or None where the separate
    cuBLAS GEMM and rotary kernel are faster."""
    if num_rows > QKV_ROPE_MAX_ROWS:
        return None
    if num_rows <= 16:
        return QKVRopeConfig(block_m=16)
    if num_rows <= 64:
        return QKVRopeConfig(block_m=triton.next_power_of_2(num_rows))
    return QKVRopeConfig(block_m=64, block_k=64)


def qkv_proj_rope(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                  q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor, eps: float,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  num_heads: int, num_kv_heads: int, head_dim: int,
                  config: QKVRopeConfig | None = None) -> torch.Tensor:
    """Fused qkv_proj_rope_ref, one launch; the grid depends on shapes only (CUDA-graph safe).
    x: [T, hidden] with unit column stride; weight row-major; caches [num_blocks, block_size, Hkv,
    D] with contiguous heads."""
    (m, k), n = x.shape, weight.shape[0]
    assert x.stride(-1) == 1 and weight.stride(-1) == 1 and weight.shape[1] == k
    assert n == (num_heads + 2 * num_kv_heads) * head_dim and head_dim & (head_dim - 1) == 0
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    q = torch.empty(m, num_heads, head_dim, dtype=x.dtype, device=x.device)
    if m == 0:
        return q
    cfg = config or qkv_rope_config(m) or QKVRopeConfig()
    # fp32 tiles need twice the shared memory of the bf16 ones the configs were tuned with
    block_k = max(16, cfg.block_k * 2 // x.element_size())
    grid = (num_heads + 2 * num_kv_heads, triton.cdiv(m, cfg.block_m))
    _qkv_proj_rope_kernel[grid](
        x, weight, positions, cos_sin_cache, q_norm_weight, k_norm_weight, q, k_cache, v_cache, slot_mapping, eps,
        m, k, x.stride(0), weight.stride(0), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=cfg.block_m, BLOCK_K=block_k, W_ON_M=cfg.w_on_m, EVEN_K=k % block_k == 0,
        DOT_IN_FP32=x.device.type == "cpu", INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return q
