import pytest
import torch

pytest.importorskip("triton")
from mini_engine.kernels.rms_norm import rms_norm, rms_norm_ref  # noqa: E402

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,hidden_size", [(1, 64), (9, 96), (4, 1024)])
def test_rms_norm_matches_reference(device, dtype, num_tokens, hidden_size):
    gen = torch.Generator().manual_seed(num_tokens * hidden_size)
    x = (3 * torch.randn(num_tokens, hidden_size, generator=gen)).to(device, dtype)
    weight = (1 + 0.1 * torch.randn(hidden_size, generator=gen)).to(device, dtype)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6), **TOL[dtype])


def test_rms_norm_empty_batch(device):
    assert rms_norm(torch.randn(0, 64, device=device), torch.ones(64, device=device), 1e-6).shape == (0, 64)
