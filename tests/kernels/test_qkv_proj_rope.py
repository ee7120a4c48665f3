import pytest
import torch

pytest.importorskip("triton")
from mini_engine.kernels.qkv_proj_rope import (  # noqa: E402
    QKVRopeConfig, qkv_proj_rope, qkv_proj_rope_ref, qkv_rope_config)
from mini_engine.kernels.rotary_kv import rope_cos_sin_cache  # noqa: E402

# As the rotary kernel's test: the product's rounding can flip a bf16 ulp before the norm, and the
# rotation's rounded products can carry it to two.
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=6.3e-2, rtol=3.2e-2)}


def _case(device, dtype, num_tokens, hidden, num_heads=4, num_kv_heads=2, head_dim=32, block_size=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = (num_heads + 2 * num_kv_heads) * head_dim
    x = torch.randn(num_tokens, hidden, generator=gen).to(device, dtype)
    weight = (torch.randn(n, hidden, generator=gen) / hidden ** 0.5).to(device, dtype)
    positions = torch.randint(0, 512, (num_tokens,), generator=gen).to(device)
    num_blocks = num_tokens // block_size + 3
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::3] = -1                              # padded rows: they write nowhere
    cos_sin_cache = rope_cos_sin_cache(head_dim, 512, 1_000_000.0, device=device)
    q_norm = (1 + 0.2 * torch.randn(head_dim, generator=gen)).to(device, dtype)
    k_norm = (1 + 0.2 * torch.randn(head_dim, generator=gen)).to(device, dtype)
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    args = (x, weight, positions, cos_sin_cache, q_norm, k_norm, 1e-6)
    return args, k_cache, slots.to(device), (num_heads, num_kv_heads, head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", [QKVRopeConfig(), QKVRopeConfig(block_m=16, block_k=32, w_on_m=False),
                                    QKVRopeConfig(block_m=32, block_k=64, num_stages=2)])
@pytest.mark.parametrize("num_tokens,hidden", [(1, 128), (7, 96), (19, 128), (40, 80)])
def test_qkv_proj_rope_matches_reference(device, dtype, config, num_tokens, hidden):
    """Row counts that fill no row block (and 40 rows: two or three of them), K that is not a
    multiple of the K tile (96 and 80 against 64; 80 against 32 fp32 columns), both dot
    orientations; q, the written cache slots and the untouched ones all checked."""
    args, k_cache, slot_mapping, shape = _case(device, dtype, num_tokens, hidden, seed=num_tokens * 1000 + hidden)
    v_cache = torch.full_like(k_cache, float("nan"))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q_ref = qkv_proj_rope_ref(*args, k_ref, v_ref, slot_mapping, *shape)
    q = qkv_proj_rope(*args, k_cache, v_cache, slot_mapping, *shape, config=config)
    torch.testing.assert_close(q, q_ref, **TOL[dtype])
    # equal_nan: every slot the reference left untouched (NaN) must still be untouched.
    torch.testing.assert_close(k_cache, k_ref, equal_nan=True, **TOL[dtype])
    torch.testing.assert_close(v_cache, v_ref, equal_nan=True, **TOL[dtype])
    written = ~k_cache.isnan().flatten(0, 1).all(-1).all(-1)
    assert written.sum() == (slot_mapping >= 0).sum()


def test_qkv_rope_config_covers_decode_batches_only():
    """Every decode graph size gets a configuration whose row block is a dot-sized power of two;
    a prefill-sized step gets none (cuBLAS and the separate rotary kernel)."""
    for rows in (1, 2, 8, 16, 17, 48, 64, 65, 200, 256):
        cfg = qkv_rope_config(rows)
        assert cfg is not None and cfg.block_m >= 16 and cfg.block_m & (cfg.block_m - 1) == 0
    assert qkv_rope_config(257) is None and qkv_rope_config(16384) is None
