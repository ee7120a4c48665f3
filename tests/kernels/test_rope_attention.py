import pytest
import torch

pytest.importorskip("triton")
from mini_engine.kernels.rope_attention import rope_decode_attention, rope_decode_attention_ref  # noqa: E402
from mini_engine.kernels.rotary_kv import rope_cos_sin_cache  # noqa: E402

TOL = {torch.float32: dict(atol=2e-3, rtol=2e-3), torch.bfloat16: dict(atol=6.3e-2, rtol=3.2e-2)}


def decode_inputs(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, hidden_size, seed):
    """A decode batch as the engine runs one: token i is sequence i's newest (position seq_len - 1),
    its k and v not yet in the cache (slot -1 for padding rows: written nowhere), the rest of each
    context already there; blocks scattered over a pool with spare blocks."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 3
    pool = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(seq_lens), max(blocks) + 1), -1, dtype=torch.int32)
    slots, used = [], 0
    for i, (n, nb) in enumerate(zip(seq_lens, blocks)):
        tables[i, :nb] = pool[used:used + nb]
        used += nb
        slots.append(int(tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size)
    slots[-1] = -1                      # a padding row, as a CUDA graph's batch has
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(device, dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(device, dtype)
    qkv = torch.randn(len(seq_lens), (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(device, dtype)
    norm_input = None
    if hidden_size:
        norm_input = (3 * torch.randn(len(seq_lens), hidden_size, generator=gen)).to(device, dtype)
    q_norm = (1 + 0.2 * torch.randn(head_dim, generator=gen)).to(device, dtype)
    k_norm = (1 + 0.2 * torch.randn(head_dim, generator=gen)).to(device, dtype)
    return dict(
        qkv=qkv, positions=torch.tensor(seq_lens, device=device) - 1,
        cos_sin_cache=rope_cos_sin_cache(head_dim, 1024, 1_000_000.0, device=device), q_norm_weight=q_norm,
        k_norm_weight=k_norm, eps=1e-6, k_cache=k_cache, v_cache=v_cache,
        slot_mapping=torch.tensor(slots, device=device), num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, norm_input=norm_input, block_tables=tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=device), scale=head_dim ** -0.5)


# Few rows: several splits and the reduce kernel; more rows than the interpreter's 4 SMs x 3 slots
# need splits for: one split, the output written by the programs themselves.
@pytest.mark.parametrize("seq_lens", [[1, 17, 40, 130], [5, 16, 33, 64, 3, 90, 41, 7, 12, 100, 2, 65, 1]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden_size", [None, 40])
def test_rope_decode_attention_matches_reference(device, seq_lens, dtype, hidden_size):
    """The fused launch against the rotary reference then the attention reference: its output, and
    the cache it leaves (each newest k and v written, the padding row's nowhere)."""
    inputs = decode_inputs(seq_lens, 4, 2, 32, 16, dtype, device, hidden_size, seed=len(seq_lens))
    ref_caches = dict(k_cache=inputs["k_cache"].clone(), v_cache=inputs["v_cache"].clone())
    expected = rope_decode_attention_ref(**(inputs | ref_caches))
    sync = torch.zeros(2, dtype=torch.int32, device=device)
    # Later launches run on the counters the first left. On the GPU, many: consumers that did not
    # wait for every producer would read a q or a newest k/v that is not there yet in some of them.
    for launch in range(2 if device == "cpu" else 50):
        out = rope_decode_attention(**inputs, max_seq_len=max(seq_lens), sync=sync)
        torch.testing.assert_close(out, expected, **TOL[dtype])
        torch.testing.assert_close(inputs["k_cache"], ref_caches["k_cache"], **TOL[dtype])
        torch.testing.assert_close(inputs["v_cache"], ref_caches["v_cache"], **TOL[dtype])
        assert sync.tolist() == [0, 0], launch
