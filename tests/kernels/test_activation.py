import pytest
import torch

pytest.importorskip("triton")
from mini_engine.kernels.activation import silu_and_mul, silu_and_mul_ref  # noqa: E402

# bf16: with a norm_input, a 1-ulp flip of the scaled gate or up (fp32 sums of squares in another
# order) can reach 2 ulps of the output through silu and the product.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=3.2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,intermediate_size", [(1, 16), (5, 40), (3, 1100), (2, 2100)])  # 1100, 2100: two, three column blocks
@pytest.mark.parametrize("hidden_size", [None, 48])
def test_silu_and_mul_matches_reference(device, dtype, num_tokens, intermediate_size, hidden_size):
    """With hidden_size, the product is first scaled by 1/rms of a norm_input row (the folded norm);
    its rows have rms far from 1 (x 5), so a missing or wrong scale shows."""
    gen = torch.Generator().manual_seed(intermediate_size)
    gate_up = (3 * torch.randn(num_tokens, 2 * intermediate_size, generator=gen)).to(device, dtype)
    norm_input = None
    if hidden_size:
        norm_input = (5 * torch.randn(num_tokens, hidden_size, generator=gen)).to(device, dtype)
    ref = silu_and_mul_ref(gate_up, norm_input, 1e-6)
    for whole_row_min_tokens in (num_tokens + 1, num_tokens):     # a program a column block, then a token
        out = silu_and_mul(gate_up, norm_input, 1e-6, whole_row_min_tokens)
        assert out.shape == (num_tokens, intermediate_size)
        torch.testing.assert_close(out, ref, **TOL[dtype])
    if hidden_size:
        assert not torch.allclose(ref, silu_and_mul_ref(gate_up), **TOL[dtype])
