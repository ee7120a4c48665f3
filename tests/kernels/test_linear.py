import pytest
import torch

pytest.importorskip("triton")
from mini_engine.kernels.linear import SkinnyConfig, linear_ref, skinny_config, skinny_linear  # noqa: E402

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", [SkinnyConfig(), SkinnyConfig(block_n=32, block_k=64, split_k=2),
                                    SkinnyConfig(block_n=16, block_k=32, split_k=3)])
@pytest.mark.parametrize("m,n,k", [(1, 48, 256), (5, 40, 200), (16, 64, 96), (37, 24, 512), (2, 16, 64)])
def test_skinny_linear_matches_reference(device, dtype, config, m, n, k):
    """Rows, columns and K that fill no tile exactly (40, 200, 37, 24), and a split of K that leaves
    a share empty (K = 64 in three shares of one 32-wide tile each)."""
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    weight = (torch.randn(n, k, generator=gen) / k ** 0.5).to(device, dtype)
    out = skinny_linear(x, weight, config)
    assert out.shape == (m, n) and out.dtype == dtype
    ref = linear_ref(x.float(), weight.float()).to(dtype)
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", [SkinnyConfig(), SkinnyConfig(block_n=32, block_k=64, split_k=2)])
def test_skinny_linear_adds_into_residual(device, dtype, config):
    """With a residual, out = residual + x W^T, written into the residual's storage, for one share
    of K (added in the product's store) and for split K (added by the shares' sum)."""
    gen = torch.Generator().manual_seed(11)
    m, n, k = 5, 40, 256
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    weight = (torch.randn(n, k, generator=gen) / k ** 0.5).to(device, dtype)
    residual = (10 * torch.randn(m, n, generator=gen)).to(device, dtype)
    ref = (residual.float() + linear_ref(x.float(), weight.float())).to(dtype)
    ref_in_place = linear_ref(x, weight, residual.clone())
    out = skinny_linear(x, weight, config, residual)
    assert out.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(out, ref, **TOL[dtype])
    torch.testing.assert_close(ref_in_place, ref, **TOL[dtype])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="checks cuBLAS's beta = 1 epilogue")
@pytest.mark.parametrize("rows", [1, 16, 17, 64, 65, 256])
@pytest.mark.parametrize("in_features", [2048, 3072])       # o_proj, down_proj
def test_residual_add_rounds_as_the_reference_on_every_path(rows, in_features):
    """Linear(x, residual) is residual + Linear(x): the product rounded, then added. On the skinny
    kernel bit for bit. cuBLAS may run its beta = 1 product as another kernel than its plain one
    (seen at 65 rows x 3072: another summation order), so there within one rounding of the sum.
    That both paths round the product first is what keeps a row's bits when its batch crosses
    o_proj's switch between them at 16 rows (benchmarks/residual_add_paths.py measures it)."""
    from mini_engine.layers.linear import Linear
    torch.manual_seed(rows)
    layer = Linear(in_features, 1024, bias=False, use_triton=True).to("cuda", torch.bfloat16)
    x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
    residual = 10 * torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        expected = residual + layer(x)
        got = layer(x, residual=residual.clone())
    if skinny_config(rows, 1024, in_features) is not None:
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=2 ** -7, atol=1e-2)


def test_skinny_linear_strided_rows(device):
    """A row stride wider than K (a view into a wider buffer) reads only each row's K columns."""
    gen = torch.Generator().manual_seed(7)
    wide = torch.randn(3, 300, generator=gen).to(device)
    weight = torch.randn(20, 256, generator=gen).to(device)
    torch.testing.assert_close(skinny_linear(wide[:, :256], weight), linear_ref(wide[:, :256], weight),
                               **TOL[torch.float32])


def test_linear_layer_takes_the_kernel_only_where_configured(device, monkeypatch):
    """Linear(use_triton=True) equals F.linear; the narrow down projection at a few rows takes the
    kernel, the same layer at 65 rows and a wide projection stay with cuBLAS."""
    import mini_engine.kernels.linear as linear_kernels
    from mini_engine.layers.linear import Linear
    calls = []
    skinny = linear_kernels.skinny_linear
    monkeypatch.setattr(linear_kernels, "skinny_linear", lambda *a: calls.append(a[0].shape[0]) or skinny(*a))
    torch.manual_seed(0)
    down = Linear(3072, 64, bias=False, use_triton=True).to(device)
    wide = Linear(64, 4096, bias=False, use_triton=True).to(device)
    with torch.no_grad():
        for rows in (3, 65):
            x = torch.randn(rows, 3072, device=device)
            torch.testing.assert_close(down(x), linear_ref(x, down.weight), **TOL[torch.float32])
            residual = torch.randn(rows, 64, device=device)
            expected = residual + linear_ref(x, down.weight)
            out = down(x, residual=residual)            # the residual add, in place, on either path
            assert out.data_ptr() == residual.data_ptr()
            torch.testing.assert_close(out, expected, **TOL[torch.float32])
        x = torch.randn(3, 64, device=device)
        torch.testing.assert_close(wide(x), linear_ref(x, wide.weight), **TOL[torch.float32])
    assert calls == [3, 3]
