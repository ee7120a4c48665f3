import torch
from torch import nn

from mini_engine.kernels.rotary_kv import qk_norm_rope_kv_write_ref


class QKNormRopeKVWrite(nn.Module):
    """Everything between the QKV projection and attention: the rest of the folded input norm,
    split q/k/v, Qwen3's per-head RMSNorm on q and k, rotary embedding, and the KV-cache write.
    Returns q as [T, Hq, D]."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 cos_sin_cache: torch.Tensor, use_triton: bool = False):
        """cos_sin_cache: rope_cos_sin_cache's table, one tensor that every layer shares (one a
        layer took 28 x 21 MB of Qwen3-0.6B's GPU memory, out of the KV pool)."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.eps = num_heads, num_kv_heads, head_dim, eps
        self.q_norm_weight = nn.Parameter(torch.ones(head_dim))
        self.k_norm_weight = nn.Parameter(torch.ones(head_dim))
        self.register_buffer("cos_sin_cache", cos_sin_cache, persistent=False)
        self.impl = qk_norm_rope_kv_write_ref
        if use_triton:
            from mini_engine.kernels.rotary_kv import qk_norm_rope_kv_write
            self.impl = qk_norm_rope_kv_write

    def forward(self, qkv, positions, k_cache, v_cache, slot_mapping, norm_input=None, out=None) -> torch.Tensor:
        """norm_input: the rows whose 1/rms first scales qkv (the folded input norm:
        layers.linear.NormedPackedLinear); Qwen3 gives every norm the same eps. out: where q goes
        (a piecewise CUDA graph's static buffer), else a new tensor."""
        return self.impl(qkv, positions, self.cos_sin_cache, self.q_norm_weight, self.k_norm_weight, self.eps,
                         k_cache, v_cache, slot_mapping, self.num_heads, self.num_kv_heads, self.head_dim,
                         norm_input, out)
