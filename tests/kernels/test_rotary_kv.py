import pytest
import torch

pytest.importorskip("triton")
from mini_engine.kernels.rotary_kv import (  # noqa: E402
    qk_norm_rope_kv_write, qk_norm_rope_kv_write_ref, rope_cos_sin_cache)

# bf16: a 1-ulp flip after the norm (fp32 sums in another order) can reach 2 ulps through the
# rotation's rounded products, whose magnitude can exceed that of their difference.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=6.3e-2, rtol=3.2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", [(4, 4, 1), (4, 2, 4), (8, 1, 16), (6, 2, 64)])
@pytest.mark.parametrize("hidden_size", [None, 40])
def test_qk_norm_rope_kv_write_matches_reference(device, dtype, num_heads, num_kv_heads, block_size, hidden_size):
    """With hidden_size, qkv is first scaled by 1/rms of a norm_input row (the folded input norm).
    q and k are normed per head after it, so only v (compared exactly) shows a wrong scale."""
    head_dim, num_tokens, num_blocks = 32, 11, 12
    gen = torch.Generator().manual_seed(num_heads * 100 + block_size)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(device, dtype)
    # Positions at and around block boundaries, and far into the rotary table.
    positions = torch.tensor([0, 1, block_size - 1, block_size, block_size + 1, 2 * block_size - 1,
                              63, 64, 200, 511, 5], device=device)
    cos_sin_cache = rope_cos_sin_cache(head_dim, 512, 1_000_000.0, device=device)
    q_norm = (1 + 0.2 * torch.randn(head_dim, generator=gen)).to(device, dtype)
    k_norm = (1 + 0.2 * torch.randn(head_dim, generator=gen)).to(device, dtype)
    # Distinct slots across the pool; -1 marks padded tokens that must write nowhere.
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1
    slot_mapping = slots.to(device)
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    norm_input = None
    if hidden_size:
        norm_input = (5 * torch.randn(num_tokens, hidden_size, generator=gen)).to(device, dtype)

    args = (qkv, positions, cos_sin_cache, q_norm, k_norm, 1e-6)
    shape = (slot_mapping, num_heads, num_kv_heads, head_dim, norm_input)
    q_ref = qk_norm_rope_kv_write_ref(*args, k_ref, v_ref, *shape)
    q = qk_norm_rope_kv_write(*args, k_cache, v_cache, *shape)

    torch.testing.assert_close(q, q_ref, **TOL[dtype])
    # equal_nan: every slot the reference left untouched (NaN) must still be untouched.
    torch.testing.assert_close(k_cache, k_ref, equal_nan=True, **TOL[dtype])
    # v is copied exactly, unless scaled (then by a 1/rms summed in another order than the reference's)
    torch.testing.assert_close(v_cache, v_ref, equal_nan=True, **(TOL[dtype] if hidden_size else dict(atol=0, rtol=0)))
    written = ~k_cache.isnan().flatten(0, 1).all(-1).all(-1)
    assert written.sum() == num_tokens - 2
    if hidden_size:     # the scale reached v: an unscaled write differs
        v_unscaled = torch.full_like(v_ref, float("nan"))
        qk_norm_rope_kv_write_ref(*args, k_ref.clone(), v_unscaled, *shape[:-1])
        assert not torch.allclose(v_unscaled.nan_to_num(), v_ref.nan_to_num())
