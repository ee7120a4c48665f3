import pytest
import torch

pytest.importorskip("triton")
from mini_engine.kernels.rms_norm import add_rms_norm, add_rms_norm_ref  # noqa: E402

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,hidden_size", [(1, 64), (9, 96), (4, 1024)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_reference(device, dtype, num_tokens, hidden_size, with_residual):
    gen = torch.Generator().manual_seed(num_tokens * hidden_size)
    x = torch.randn(num_tokens, hidden_size, generator=gen).to(device, dtype)
    residual = torch.randn(num_tokens, hidden_size, generator=gen).to(device, dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(hidden_size, generator=gen)).to(device, dtype)
    out_ref, residual_ref = add_rms_norm_ref(x, residual, weight, 1e-6)

    residual_in = None if residual is None else residual.clone()
    out, residual_out = add_rms_norm(x, residual_in, weight, 1e-6)
    torch.testing.assert_close(out, out_ref, **TOL[dtype])
    torch.testing.assert_close(residual_out, residual_ref, **TOL[dtype])
    if with_residual:   # documented: the new residual overwrites the old one's storage
        assert residual_out.data_ptr() == residual_in.data_ptr()
    else:
        assert residual_out is x


def test_add_rms_norm_empty_batch(device):
    x = torch.randn(0, 64, device=device)
    out, residual = add_rms_norm(x, torch.randn(0, 64, device=device), torch.ones(64, device=device), 1e-6)
    assert out.shape == (0, 64) and residual.shape == (0, 64)
