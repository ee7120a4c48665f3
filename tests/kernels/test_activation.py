import pytest
import torch

pytest.importorskip("triton")
from mini_engine.kernels.activation import silu_and_mul, silu_and_mul_ref  # noqa: E402

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,intermediate_size", [(1, 16), (5, 40), (3, 1100)])  # 1100: two column blocks
def test_silu_and_mul_matches_reference(device, dtype, num_tokens, intermediate_size):
    gen = torch.Generator().manual_seed(intermediate_size)
    gate_up = (3 * torch.randn(num_tokens, 2 * intermediate_size, generator=gen)).to(device, dtype)
    out = silu_and_mul(gate_up)
    assert out.shape == (num_tokens, intermediate_size)
    torch.testing.assert_close(out, silu_and_mul_ref(gate_up), **TOL[dtype])
