"""Split the packed QKV output, apply Qwen3's per-head RMSNorm and rotary embedding to q and k,
and write k and v into their KV-cache slots."""
import torch

from mini_engine.kernels.rms_norm import rms_norm_ref


def rope_cos_sin_cache(head_dim: int, max_position: int, theta: float, device=None) -> torch.Tensor:
    """[max_position, head_dim] fp32: cos of each frequency in the first half, sin in the second."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.int64, device=device).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def apply_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation (rotate_half), computed in x's dtype as transformers does."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype).unsqueeze(-2), sin.to(x.dtype).unsqueeze(-2)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def write_kv_cache_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D]; slot -1 writes nowhere."""
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_flat[slots] = k[valid].to(k_flat.dtype)
    v_flat[slots] = v[valid].to(v_flat.dtype)


def qk_norm_rope_kv_write_ref(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                              q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor, eps: float,
                              k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                              num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """qkv: [T, (Hq + 2 Hkv) D]. Returns the rotated, normed q as [T, Hq, D]."""
    T = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = rms_norm_ref(q.reshape(T, num_heads, head_dim), q_norm_weight, eps)
    k = rms_norm_ref(k.reshape(T, num_kv_heads, head_dim), k_norm_weight, eps)
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    q = apply_rope_ref(q, cos, sin)
    k = apply_rope_ref(k, cos, sin)
    write_kv_cache_ref(k, v.reshape(T, num_kv_heads, head_dim), k_cache, v_cache, slot_mapping)
    return q
