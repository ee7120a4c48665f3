"""kernels/fp8_linear.py: the activations' quantization (with and without the fused RMSNorm) and
the block-scaled GEMM against their PyTorch references, and the references against the
definition of the block scheme."""
import pytest
import torch

pytest.importorskip("triton")
from mini_engine.kernels.fp8_linear import (FP8, FP8_MAX, cublas_block_scaled, dequantize_fp8_ref,  # noqa: E402
                                            fp8_gemm_config, fp8_linear, fp8_linear_ref, quantize_fp8,
                                            quantize_fp8_ref, quantize_fp8_weight_ref, split_counters,
                                            takes_cublas)
from mini_engine.kernels.triton_utils import num_sms  # noqa: E402

# (rows M, columns K): K a multiple of the 128-column group, and K that leaves the last group short.
SHAPES = [(1, 256), (5, 200), (33, 384), (70, 130)]


def activations(m: int, k: int, dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    """Rows of very different sizes (a quantized row's scales must follow each row), one row all
    zeros (its scales stay finite) where there are several."""
    gen = torch.Generator().manual_seed(seed + m * k)
    x = torch.randn(m, k, generator=gen) * torch.exp(3 * torch.randn(m, 1, generator=gen))
    if m > 1:
        x[1] = 0
    return x.to(device, dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k", SHAPES)
def test_quantize_matches_reference_bit_for_bit(device, dtype, m, k):
    x = activations(m, k, dtype, device)
    q, scales = quantize_fp8(x)
    ref_q, ref_scales = quantize_fp8_ref(x)
    assert q.dtype == FP8 and q.shape == (m, k) and scales.shape == (m, -(-k // 128))
    assert torch.equal(bits(q), bits(ref_q))
    assert torch.equal(scales, ref_scales)


def test_quantize_reference_is_the_definition():
    """Each group's largest |value| becomes +-448 exactly; every value is its group's scale times
    an e4m3 number, within half an e4m3 step of x / scale; a group of zeros quantizes to zeros."""
    x = activations(6, 300, torch.float32, "cpu")
    q, scales = quantize_fp8_ref(x)
    for row in range(6):
        for group in range(3):
            cols = slice(128 * group, min(128 * (group + 1), 300))
            part, values = x[row, cols], q[row, cols].float()
            if row == 1:
                assert not values.any() and scales[row, group] > 0
                continue
            assert scales[row, group] == part.abs().max() / FP8_MAX
            assert values.abs().max() == FP8_MAX
            exact = part / scales[row, group]
            # e4m3 keeps 3 mantissa bits: a step is 2^(exponent - 3); half of it bounds the error
            step = torch.exp2(torch.floor(torch.log2(exact.abs().clamp(min=2 ** -6))) - 3)
            assert ((values - exact).abs() <= step / 2).all()


@pytest.mark.parametrize("m,k", SHAPES)
def test_quantize_with_the_norm_matches_reference(device, m, k):
    """fp32 rows: the fused RMSNorm rounds as rms_norm_ref, so the bits agree. bf16: the kernel's
    1/rms may differ from torch's in its last bit, which moves a normed value by one bf16 step
    (and a group's scale with its largest value), and a value on a rounding boundary of e4m3 by
    one e4m3 step, 2^-3 of it at most: the dequantized rows agree to that."""
    weight = (0.5 + torch.rand(k, generator=torch.Generator().manual_seed(k))).to(device)
    x = activations(m, k, torch.float32, device, seed=1)
    q, scales = quantize_fp8(x, weight, 1e-6)
    ref_q, ref_scales = quantize_fp8_ref(x, weight, 1e-6)
    assert torch.equal(bits(q), bits(ref_q))
    torch.testing.assert_close(scales, ref_scales, rtol=1e-6, atol=0)
    x, weight = x.bfloat16(), weight.bfloat16()
    got = dequantize_fp8_ref(*quantize_fp8(x, weight, 1e-6), 1)
    ref = dequantize_fp8_ref(*quantize_fp8_ref(x, weight, 1e-6), 1)
    torch.testing.assert_close(got, ref, rtol=0.13, atol=0.02 * ref.abs().max().item())


def test_weight_blocks_are_the_definition():
    """A 300 x 260 weight: 3 x 3 blocks, the last ones short; each block's own largest |value|
    becomes 448, and dequantizing gives W back within e4m3's rounding (2^-4 of each value)."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(300, 260, generator=gen) * torch.exp(torch.randn(300, 1, generator=gen))
    q, scales = quantize_fp8_weight_ref(w)
    assert q.shape == (300, 260) and scales.shape == (3, 3)
    for i in range(3):
        for j in range(3):
            block = w[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]
            assert scales[i, j] == block.abs().max() / FP8_MAX
    back = dequantize_fp8_ref(q, scales, 128)
    assert ((back - w).abs() <= w.abs() * 2 ** -4 + scales.max() * 2 ** -9).all()


def weight_and_scales(n: int, k: int, device: str, seed: int = 5):
    gen = torch.Generator().manual_seed(seed + n)
    w = torch.randn(n, k, generator=gen) / k ** 0.5 * torch.exp(torch.randn(n, 1, generator=gen))
    q, scales = quantize_fp8_weight_ref(w)
    return q.to(device), scales.to(device)


def assert_close_to(out: torch.Tensor, ref: torch.Tensor) -> None:
    """The kernel sums each group's fp8 dot in fp32 then scales it; the reference multiplies the
    dequantized fp32 operands: the same products, summed in another order, so fp32 outputs agree
    to ~1e-6 of the largest (outputs near zero by cancellation differ in relative terms). A bf16
    output may round the other way (the interpreter rounds toward zero): one bf16 step, 2^-8.

    On Hopper a tile of 64 rows or more takes wgmma, whose fp8 dot adds in fewer bits than fp32
    (DeepSeek-V3's report: about 14), which is why the kernel adds each 128-column group into an
    fp32 sum of its own: measured on the H200, fp32 outputs 1.5e-4 of the largest apart."""
    tol = 2 ** -7 if ref.dtype != torch.float32 else 2 ** -11 if ref.is_cuda else 1e-5
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k", SHAPES)
@pytest.mark.parametrize("n", [96, 130])
def test_gemm_matches_reference(device, dtype, m, k, n):
    """Rows under one tile, over several (70 > 64), and column counts that fill no tile."""
    x = activations(m, k, dtype, device, seed=2)
    w, scales = weight_and_scales(n, k, device)
    out = fp8_linear(x, w, scales)
    assert out.shape == (m, n) and out.dtype == dtype
    assert_close_to(out, fp8_linear_ref(x, w, scales))


@pytest.mark.parametrize("dtype, with_norm", [(torch.float32, True), (torch.float32, False), (torch.bfloat16, False)])
def test_gemm_with_norm_bias_and_residual(device, dtype, with_norm):
    """The norm fused into the quantization, a bias, and the sum into the residual's storage. The
    norm in bf16 is left to test_quantize_with_the_norm_matches_reference: a last-bit difference
    in 1/rms re-rounds whole groups, which moves bf16 outputs by ~2%, more than the sum's order."""
    m, k, n = 9, 256, 160
    x = activations(m, k, dtype, device, seed=4)
    w, scales = weight_and_scales(n, k, device)
    gen = torch.Generator().manual_seed(8)
    norm = (0.5 + torch.rand(k, generator=gen)).to(device, dtype) if with_norm else None
    bias = torch.randn(n, generator=gen).to(device, dtype)
    residual = (10 * torch.randn(m, n, generator=gen)).to(device, dtype)
    expected = fp8_linear_ref(x, w, scales, residual.clone(), norm, 1e-6, bias)
    out = fp8_linear(x, w, scales, residual, norm, 1e-6, bias)
    assert out.data_ptr() == residual.data_ptr()
    assert_close_to(out, expected)


@pytest.mark.parametrize("n", [20, 40])
def test_gemm_split_over_k(device, n):
    """Few output tiles and a deep K (o_proj and down_proj at decode): K's 17 groups (the last
    short) shared by several programs a tile, whose partials the last to finish adds. With a bias
    and a residual; twice, so a tile's counter is back at zero for the next launch."""
    m, k = 5, 2100
    assert fp8_gemm_config(m, n, k, num_sms(torch.device(device))).split_k > 1
    x = activations(m, k, torch.bfloat16, device, seed=6)
    w, scales = weight_and_scales(n, k, device)
    gen = torch.Generator().manual_seed(10)
    bias = torch.randn(n, generator=gen).to(device, torch.bfloat16)
    for _ in range(2):
        residual = (10 * torch.randn(m, n, generator=gen)).to(device, torch.bfloat16)
        expected = fp8_linear_ref(x, w, scales, residual.clone(), bias=bias)
        assert_close_to(fp8_linear(x, w, scales, residual, bias=bias), expected)
        assert not split_counters(torch.device(device)).any()


@pytest.mark.skipif(not torch.cuda.is_available() or not cublas_block_scaled(torch.device("cuda")),
                    reason="cuBLAS's block-scaled fp8 GEMM: a Hopper GPU and a torch with F.scaled_mm")
@pytest.mark.parametrize("m", [4096, 4099])
@pytest.mark.parametrize("with_norm", [False, True])
def test_cublas_product_matches_reference(m, with_norm):
    """Prefill's rows on cuBLAS (rows padded to 16 for it, the scales column-major): against the
    reference, with the norm and the sum into a residual, as the Triton kernel is held."""
    k, n = 1024, 1024
    assert takes_cublas(m, n, k, torch.bfloat16, False, torch.device("cuda"))
    x = activations(m, k, torch.bfloat16, "cuda", seed=11)
    w, scales = weight_and_scales(n, k, "cuda")
    norm = (0.5 + torch.rand(k, generator=torch.Generator().manual_seed(12))).to("cuda", torch.bfloat16)
    norm = norm if with_norm else None
    residual = 10 * torch.randn(m, n, generator=torch.Generator().manual_seed(13)).to("cuda", torch.bfloat16)
    out = fp8_linear(x, w, scales, norm_weight=norm, eps=1e-6)
    assert out.shape == (m, n)
    expected = fp8_linear_ref(x, w, scales, norm_weight=norm, eps=1e-6)
    if with_norm:       # a last-bit 1/rms re-rounds a group (test_quantize_with_the_norm_matches_reference)
        torch.testing.assert_close(out, expected, rtol=0.03, atol=0.03 * expected.abs().max().item())
    else:
        assert_close_to(out, expected)
        summed = fp8_linear(x, w, scales, residual.clone())
        assert_close_to(summed, fp8_linear_ref(x, w, scales, residual.clone()))


def test_reference_product_is_close_to_the_unquantized_one():
    """fp8 weights and activations cost a few percent of each output (e4m3's 3 mantissa bits,
    averaged over K): the scheme's error, against an fp32 product of the same matrices."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(16, 512, generator=gen) * torch.exp(torch.randn(16, 1, generator=gen))
    w = torch.randn(384, 512, generator=gen) / 512 ** 0.5 * torch.exp(torch.randn(384, 1, generator=gen))
    exact = x @ w.T
    got = fp8_linear_ref(x, *quantize_fp8_weight_ref(w))
    error = (got - exact).norm() / exact.norm()
    assert 0.005 < error < 0.05, error
