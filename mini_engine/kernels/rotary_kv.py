"""Split the packed QKV output, apply Qwen3's per-head RMSNorm and rotary embedding to q and k,
and write k and v into their KV-cache slots."""
import torch

from mini_engine.kernels.rms_norm import rms_norm_ref, scale_by_inv_rms_ref


def rope_cos_sin_cache(head_dim: int, max_position: int, theta: float, device=None,
                       yarn: "YarnScaling | None" = None) -> torch.Tensor:
    """[max_position, head_dim] fp32: cos of each frequency in the first half, sin in the second
    (with YaRN, its frequencies, and both scaled by its attention factor as transformers scales them)."""
    if yarn is None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    else:
        inv_freq = yarn.inverse_frequencies(head_dim, theta, device)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.int64, device=device).float(), inv_freq)
    scale = 1.0 if yarn is None else yarn.attention_scaling()
    return torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)


def apply_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation (rotate_half), computed in x's dtype as transformers does."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype).unsqueeze(-2), sin.to(x.dtype).unsqueeze(-2)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# The fp8 formats a KV cache may take (EngineConfig.kv_cache_dtype).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def to_cache_dtype_ref(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of cache_dtype stores it. An fp8 cache saturates at its largest finite value
    (+-448 for e4m3, +-57344 for e5m2), as vLLM's fp8 cache writes and the GPU's cvt.satfinite do:
    torch's own cast makes NaN of 470 and above on CUDA (torch 2.11 on the H200), though it
    saturates on CPU."""
    if cache_dtype in FP8_DTYPES:
        largest = torch.finfo(cache_dtype).max
        x = x.clamp(-largest, largest)
    return x.to(cache_dtype)


def write_kv_cache_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D]; slot -1 writes nowhere."""
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_flat[slots] = to_cache_dtype_ref(k[valid], k_flat.dtype)
    v_flat[slots] = to_cache_dtype_ref(v[valid], v_flat.dtype)


def qk_norm_rope_kv_write_ref(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                              q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor, eps: float,
                              k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                              num_heads: int, num_kv_heads: int, head_dim: int,
                              norm_input: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """qkv: [T, (Hq + 2 Hkv) D]. Returns the rotated, normed q as [T, Hq, D] (in `out` when
    given). With norm_input ([T, H]), qkv is first scaled row by row by 1/rms(norm_input): the rest
    of the decoder's input RMSNorm, folded into the QKV projection (layers.linear.NormedPackedLinear)."""
    T = qkv.shape[0]
    if norm_input is not None:
        qkv = scale_by_inv_rms_ref(qkv, norm_input, eps)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = rms_norm_ref(q.reshape(T, num_heads, head_dim), q_norm_weight, eps)
    k = rms_norm_ref(k.reshape(T, num_kv_heads, head_dim), k_norm_weight, eps)
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    q = apply_rope_ref(q, cos, sin)
    k = apply_rope_ref(k, cos, sin)
    write_kv_cache_ref(k, v.reshape(T, num_kv_heads, head_dim), k_cache, v_cache, slot_mapping)
    return q if out is None else out.copy_(q)


# ---- Triton ----

from mini_engine.kernels.fp8_rounding import to_fp8  # noqa: E402
from mini_engine.kernels.rms_norm import load_row_inv_rms, scale_by_inv_rms  # noqa: E402
from mini_engine.kernels.triton_utils import pdl_enter, pdl_options, tl, triton  # noqa: E402


@triton.jit
def _rms_norm_rope(x1, x2, w1, w2, cos, sin, eps, HEAD_DIM: tl.constexpr):
    """Per-head RMSNorm then neox rotation of a [heads, HEAD_DIM/2] pair of halves, given in the
    model dtype. Math in fp32, rounded to the model dtype wherever the reference (transformers)
    rounds: after the norm, after the weight, and after each product and sum of the rotation."""
    dtype = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    variance = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM
    inv_rms = tl.rsqrt(variance + eps)[:, None]
    x1 = ((x1 * inv_rms).to(dtype).to(tl.float32) * w1.to(tl.float32)).to(dtype).to(tl.float32)
    x2 = ((x2 * inv_rms).to(dtype).to(tl.float32) * w2.to(tl.float32)).to(dtype).to(tl.float32)
    cos = cos.to(dtype).to(tl.float32)
    sin = sin.to(dtype).to(tl.float32)
    out1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    out2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    return out1.to(dtype), out2.to(dtype)


@triton.jit
def _to_cache_dtype(x, cache_ptr, FP8_CACHE: tl.constexpr):
    if FP8_CACHE:
        return to_fp8(x.to(tl.float32), cache_ptr.dtype.element_ty)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _qk_norm_rope_kv_write_kernel(
        qkv_ptr, positions_ptr, cos_sin_ptr, q_norm_ptr, k_norm_ptr, q_out_ptr,
        k_cache_ptr, v_cache_ptr, slot_mapping_ptr, norm_input_ptr, hidden_size, eps,
        stride_qkv, stride_cos_sin, stride_cache_block, stride_cache_offset, stride_cache_head,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
        HAS_NORM: tl.constexpr, BLOCK_H: tl.constexpr, FP8_CACHE: tl.constexpr, USE_PDL: tl.constexpr):
    """One program per token, all of its heads at once: q and k are loaded as [heads, D/2] halves
    (the two operands of the neox rotation), normed per head, rotated with this position's cos and
    sin (loaded once for all heads), q stored to q_out, k and v stored into the paged cache at
    slot_mapping[token] (a slot of -1 stores nothing). With HAS_NORM, q, k and v are first scaled
    by 1/rms of the token's norm_input row, rounded to the model dtype as the reference does."""
    token = tl.program_id(0).to(tl.int64)
    half = tl.arange(0, HEAD_DIM // 2)
    # positions (a step input) and the cos/sin table are written by no kernel of the step
    pos = tl.load(positions_ptr + token)
    cos = tl.load(cos_sin_ptr + pos * stride_cos_sin + half)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cos_sin + HEAD_DIM // 2 + half)[None, :]
    pdl_enter(USE_PDL)
    row = qkv_ptr + token * stride_qkv
    inv_rms = 1.0
    if HAS_NORM:
        _, inv_rms = load_row_inv_rms(norm_input_ptr + token * hidden_size, hidden_size, eps, BLOCK_H)

    # q: heads [0, NUM_HEADS) of the packed row
    hq = tl.arange(0, BLOCK_HQ)[:, None]
    mq = hq < NUM_HEADS
    q_offs = hq * HEAD_DIM + half[None, :]
    q1 = scale_by_inv_rms(tl.load(row + q_offs, mask=mq, other=0.0), inv_rms, HAS_NORM)
    q2 = scale_by_inv_rms(tl.load(row + q_offs + HEAD_DIM // 2, mask=mq, other=0.0), inv_rms, HAS_NORM)
    q_w1 = tl.load(q_norm_ptr + half)[None, :]
    q_w2 = tl.load(q_norm_ptr + HEAD_DIM // 2 + half)[None, :]
    q1, q2 = _rms_norm_rope(q1, q2, q_w1, q_w2, cos, sin, eps, HEAD_DIM)
    q_out = q_out_ptr + token * NUM_HEADS * HEAD_DIM + q_offs
    tl.store(q_out, q1.to(q_out_ptr.dtype.element_ty), mask=mq)
    tl.store(q_out + HEAD_DIM // 2, q2.to(q_out_ptr.dtype.element_ty), mask=mq)

    # k and v: the next 2 * NUM_KV_HEADS heads, written to the cache slot
    hk = tl.arange(0, BLOCK_HKV)[:, None]
    mk = hk < NUM_KV_HEADS
    k_offs = NUM_HEADS * HEAD_DIM + hk * HEAD_DIM + half[None, :]
    k1 = scale_by_inv_rms(tl.load(row + k_offs, mask=mk, other=0.0), inv_rms, HAS_NORM)
    k2 = scale_by_inv_rms(tl.load(row + k_offs + HEAD_DIM // 2, mask=mk, other=0.0), inv_rms, HAS_NORM)
    k_w1 = tl.load(k_norm_ptr + half)[None, :]
    k_w2 = tl.load(k_norm_ptr + HEAD_DIM // 2 + half)[None, :]
    k1, k2 = _rms_norm_rope(k1, k2, k_w1, k_w2, cos, sin, eps, HEAD_DIM)
    v_offs = k_offs + NUM_KV_HEADS * HEAD_DIM
    v1 = scale_by_inv_rms(tl.load(row + v_offs, mask=mk, other=0.0), inv_rms, HAS_NORM)
    v2 = scale_by_inv_rms(tl.load(row + v_offs + HEAD_DIM // 2, mask=mk, other=0.0), inv_rms, HAS_NORM)

    slot = tl.load(slot_mapping_ptr + token)
    # A padded token (slot -1) stores no head. (Written as a head count, not `mk & (slot >= 0)`:
    # the interpreter rejects a mask built from a scalar.)
    mk = hk < tl.where(slot >= 0, NUM_KV_HEADS, 0)
    slot = tl.maximum(slot, 0)      # keeps the masked-off address in range
    cache_offs = ((slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_offset
                  + hk * stride_cache_head + half[None, :])
    tl.store(k_cache_ptr + cache_offs, _to_cache_dtype(k1, k_cache_ptr, FP8_CACHE), mask=mk)
    tl.store(k_cache_ptr + cache_offs + HEAD_DIM // 2, _to_cache_dtype(k2, k_cache_ptr, FP8_CACHE), mask=mk)
    tl.store(v_cache_ptr + cache_offs, _to_cache_dtype(v1, v_cache_ptr, FP8_CACHE), mask=mk)
    tl.store(v_cache_ptr + cache_offs + HEAD_DIM // 2, _to_cache_dtype(v2, v_cache_ptr, FP8_CACHE), mask=mk)


def qk_norm_rope_kv_write(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                          q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor, eps: float,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          num_heads: int, num_kv_heads: int, head_dim: int,
                          norm_input: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Fused qk_norm_rope_kv_write_ref, one launch. qkv: [T, (Hq + 2 Hkv) D] with contiguous rows;
    caches [num_blocks, block_size, Hkv, D] with contiguous heads; norm_input, when given, [T, H]
    contiguous. Returns q as [T, Hq, D], in `out` (contiguous) when given."""
    num_tokens = qkv.shape[0]
    assert qkv.stride(-1) == 1 and head_dim & (head_dim - 1) == 0, "head_dim must be a power of two"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and k_cache.dtype == v_cache.dtype
    assert norm_input is None or norm_input.is_contiguous()
    hidden_size = 1 if norm_input is None else norm_input.shape[1]
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device) if out is None else out
    assert q.shape == (num_tokens, num_heads, head_dim) and q.is_contiguous()
    if num_tokens:
        _qk_norm_rope_kv_write_kernel[(num_tokens,)](
            qkv, positions, cos_sin_cache, q_norm_weight, k_norm_weight, q, k_cache, v_cache, slot_mapping,
            qkv if norm_input is None else norm_input, hidden_size, eps,
            qkv.stride(0), cos_sin_cache.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
            BLOCK_HQ=triton.next_power_of_2(num_heads), BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
            HAS_NORM=norm_input is not None, BLOCK_H=triton.next_power_of_2(hidden_size),
            FP8_CACHE=k_cache.dtype in FP8_DTYPES, num_warps=4,
            **pdl_options(qkv.device))
    return q
