import pytest
import torch

pytest.importorskip("triton")
from mini_engine.kernels.rotary_kv import (  # noqa: E402
    qk_norm_rope_kv_write, qk_norm_rope_kv_write_ref, rope_cos_sin_cache, to_cache_dtype_ref)
from mini_engine.kernels.fp8_rounding import to_fp8  # noqa: E402
from mini_engine.kernels.triton_utils import tl, triton  # noqa: E402

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


def test_q_goes_into_a_given_buffer(device):
    """out= (a piecewise CUDA graph's static queries): the kernel and the reference write q there,
    a slice of a larger buffer whose rest stays as it was, and return it."""
    num_heads, num_kv_heads, head_dim, num_tokens = 4, 2, 32, 6
    gen = torch.Generator().manual_seed(11)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(device)
    positions = torch.arange(num_tokens, device=device) * 7
    cos_sin_cache = rope_cos_sin_cache(head_dim, 64, 10_000.0, device=device)
    norms = [(1 + 0.2 * torch.randn(head_dim, generator=gen)).to(device) for _ in range(2)]
    k_cache = torch.zeros(4, 4, num_kv_heads, head_dim, device=device)
    slots = torch.arange(num_tokens, device=device)
    outs = []
    for impl in (qk_norm_rope_kv_write_ref, qk_norm_rope_kv_write):
        buffer = torch.full((num_tokens + 3, num_heads, head_dim), 7.0, device=device)
        q = impl(qkv, positions, cos_sin_cache, *norms, 1e-6, k_cache.clone(), k_cache.clone(), slots, num_heads,
                 num_kv_heads, head_dim, out=buffer[:num_tokens])
        assert q.data_ptr() == buffer.data_ptr() and (buffer[num_tokens:] == 7.0).all()
        outs.append(impl(qkv, positions, cos_sin_cache, *norms, 1e-6, k_cache.clone(), k_cache.clone(), slots,
                         num_heads, num_kv_heads, head_dim))
        torch.testing.assert_close(q, outs[-1], atol=0, rtol=0)
    torch.testing.assert_close(outs[1], outs[0], **TOL[torch.float32])


FP8_FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]


@triton.jit
def to_fp8_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, to_fp8(x.to(tl.float32), out_ptr.dtype.element_ty), mask=offs < n)


@pytest.mark.parametrize("fp8", FP8_FORMATS)
def test_fp8_rounding_matches_torch_on_every_bf16_value(device, fp8):
    """The write's fp8 conversion, bit for bit, against torch's clamped cast: every bf16 value
    (each binade, both signs, the subnormals, ties, +-0, past the saturation at +-448 or +-57344,
    +-inf, and NaN, which stays NaN), then fp32 values across the format's range, whose dropped
    bits also decide ties."""
    every_bf16 = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    lowest, highest = (-14, 11) if fp8 == torch.float8_e4m3fn else (-22, 17)
    spread = torch.randn(100_000, generator=gen) * torch.exp2(
        torch.randint(lowest, highest, (100_000,), generator=gen).float())
    for x in (every_bf16, spread):
        x = x.to(device)
        out = torch.empty(x.shape, dtype=fp8, device=device)
        to_fp8_kernel[(triton.cdiv(x.numel(), 4096),)](x, out, x.numel(), BLOCK=4096)
        expected = to_cache_dtype_ref(x, fp8)
        assert expected.float().nan_to_num().abs().max() == torch.finfo(fp8).max and (expected.float() == 0).any()
        # NaN's bits are not compared (torch keeps the sign, the kernel writes 0x7f), only that it is one
        nan = expected.float().isnan()
        out, expected = out.view(torch.uint8), expected.view(torch.uint8)
        assert torch.equal(out[~nan], expected[~nan]) and out.view(fp8)[nan].float().isnan().all()
    assert every_bf16.isnan().any() and every_bf16.isinf().any()


def assert_at_most_one_fp8_step_apart(got: torch.Tensor, expected: torch.Tensor, atol: float,
                                      most_differing: float) -> None:
    """NaN (the slots nobody writes) and inf exactly where expected has them; every finite element
    the same fp8 value as expected's, or the one beside it (codes of one sign are in the values'
    order, so a step is 1 in the low 7 bits), or within atol, the model dtype's own tolerance
    (bf16's rotation can move a small k by several fp8 steps of its size); and at most a share
    most_differing of the written elements differ at all."""
    got_values, expected_values = got.float(), expected.float()
    assert torch.equal(got_values.isnan(), expected_values.isnan())
    assert not got_values.isinf().any() and not expected_values.isinf().any()
    written = ~expected_values.isnan()
    codes, expected_codes = got.view(torch.uint8)[written].int(), expected.view(torch.uint8)[written].int()
    same_sign = (codes & 0x80) == (expected_codes & 0x80)
    beside = same_sign & (((codes & 0x7F) - (expected_codes & 0x7F)).abs() <= 1)
    across_zero = ((codes & 0x7F) <= 1) & ((expected_codes & 0x7F) <= 1)
    close = (got_values[written] - expected_values[written]).abs() <= atol
    assert (beside | across_zero | close).all()
    share = (codes != expected_codes).float().mean().item()
    assert share <= most_differing, share


@pytest.mark.parametrize("fp8", FP8_FORMATS)
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden_size", [None, 40])
def test_qk_norm_rope_kv_write_into_an_fp8_cache(device, model_dtype, hidden_size, fp8):
    """kv_cache_dtype "fp8" and "fp8_e5m2": q in the model's dtype as before; k and v stored in
    fp8 as the reference stores them. Unscaled v is a pure conversion, compared bit for bit; k (and
    scaled v) come through sums in another order, so an element may round to the fp8 value beside
    the reference's."""
    # v's scales: from below the subnormals' start to past saturation
    lowest, highest = (-12, 11) if fp8 == torch.float8_e4m3fn else (-20, 19)
    num_heads, num_kv_heads, head_dim, block_size, num_tokens, num_blocks = 4, 2, 32, 16, 9, 4
    gen = torch.Generator().manual_seed(17)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    # v's columns over the format's range: subnormals (below 2^-6 or 2^-14) up to saturation
    v_cols = slice((num_heads + num_kv_heads) * head_dim, None)
    qkv[:, v_cols] *= torch.exp2(torch.randint(lowest, highest, (num_kv_heads * head_dim,), generator=gen).float())
    qkv = qkv.to(device, model_dtype)
    positions = torch.arange(3, 3 + num_tokens, device=device)
    cos_sin_cache = rope_cos_sin_cache(head_dim, 64, 10_000.0, device=device)
    q_norm = (1 + 0.2 * torch.randn(head_dim, generator=gen)).to(device, model_dtype)
    k_norm = (1 + 0.2 * torch.randn(head_dim, generator=gen)).to(device, model_dtype)
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(device)
    slot_mapping[4] = -1
    norm_input = None if hidden_size is None else (5 * torch.randn(num_tokens, hidden_size, generator=gen)).to(
        device, model_dtype)
    # 0x7f is a NaN in both formats: slots nobody writes must keep it.
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), 0x7F, dtype=torch.uint8,
                         device=device).view(fp8)
    v_cache = k_cache.clone()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    args = (qkv, positions, cos_sin_cache, q_norm, k_norm, 1e-6)
    shape = (slot_mapping, num_heads, num_kv_heads, head_dim, norm_input)
    q_ref = qk_norm_rope_kv_write_ref(*args, k_ref, v_ref, *shape)
    q = qk_norm_rope_kv_write(*args, k_cache, v_cache, *shape)

    torch.testing.assert_close(q, q_ref, **TOL[model_dtype])
    # fp32 rounds k as the reference does; in bf16 most k come a bf16 step or two off through the
    # rotation, and some of those cross an fp8 boundary (17-19% of e4m3's codes, 7-8% of e5m2's)
    most_differing = 0.01 if model_dtype == torch.float32 else 0.25
    assert_at_most_one_fp8_step_apart(k_cache, k_ref, TOL[model_dtype]["atol"], most_differing)
    if hidden_size is None:
        assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))
    else:
        assert_at_most_one_fp8_step_apart(v_cache, v_ref, TOL[model_dtype]["atol"], most_differing)
    written = ~v_ref.float().isnan().flatten(0, 1).all(-1).all(-1)
    assert written.sum() == num_tokens - 1
    assert v_ref.float().nan_to_num().abs().max() == torch.finfo(fp8).max       # some v saturated
