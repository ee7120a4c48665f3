"""kernels/awq_linear.py: AutoAWQ's packing, its round-to-nearest quantization, and the Triton
products (the fused decode kernel and the dequantize launch ahead of cuBLAS) against
awq_linear_ref on fresh random inputs (CPU tensors through Triton's interpreter; CUDA ones on a GPU)."""
import importlib.util

import pytest
import torch

from mini_engine.kernels.awq_linear import (AWQ_MAX, DEQUANTIZE_ROWS, GEMV_ROWS, awq_linear_ref, dequantize_awq_ref,
                                            pack_awq_ref, quantize_awq_ref, unpack_awq_ref)

requires_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

AUTOAWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def autoawq_pack(values: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's WQLinear_GEMM.from_linear packing loop, written out: word c's nibble i holds
    column 8c + AUTOAWQ_ORDER[i]."""
    rows, cols = values.shape
    packed = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for c in range(cols // 8):
        for i in range(8):
            packed[:, c] |= values[:, c * 8 + AUTOAWQ_ORDER[i]].to(torch.int64) << (i * 4)
    return packed.to(torch.uint32).view(torch.int32) if hasattr(torch, "uint32") else \
        torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)


def test_packing_is_autoawqs():
    values = torch.randint(0, 16, (5, 48))
    values[0, :8] = 15                                  # nibble 7 set: the word's sign bit
    packed = pack_awq_ref(values)
    assert packed.dtype == torch.int32 and packed.shape == (5, 6)
    assert torch.equal(packed, autoawq_pack(values))
    assert torch.equal(unpack_awq_ref(packed), values.to(torch.int32))


@pytest.mark.parametrize("group_size", [16, 64])
def test_round_to_nearest_with_a_zero_point(group_size):
    """Every weight within a step of its group's scale (half a step from rounding, half from the
    rounded zero point at the range's ends, as AutoAWQ's), most within half; the zero points and
    values in 0..15, a group's largest value reached."""
    weight = torch.randn(24, 128) * 0.1
    qweight, qzeros, scales = quantize_awq_ref(weight, group_size)
    assert qweight.shape == (128, 3) and qzeros.shape == (128 // group_size, 3)
    assert scales.shape == (128 // group_size, 24) and scales.dtype == torch.float16
    dequantized = dequantize_awq_ref(qweight, qzeros, scales)
    step = scales.float().repeat_interleave(group_size, 0)
    error = (dequantized - weight.t()).abs()
    assert (error <= step + 1e-6).all() and (error <= step / 2 + 1e-6).float().mean() > 0.95
    q = unpack_awq_ref(qweight)
    assert q.min() >= 0 and q.max() <= AWQ_MAX and unpack_awq_ref(qzeros).max() <= AWQ_MAX
    assert (q.view(128 // group_size, group_size, 24).amax(1) == AWQ_MAX).float().mean() > 0.9


def test_dequantization_is_the_definition():
    """(q - z) * s, element by element, for one hand-picked word."""
    q = torch.zeros(16, 8, dtype=torch.int32)
    q[5] = torch.tensor([1, 2, 3, 4, 5, 6, 7, 15], dtype=torch.int32)
    z = torch.full((1, 8), 3, dtype=torch.int32)
    s = torch.linspace(0.5, 4.0, 8, dtype=torch.float16)[None]
    w = dequantize_awq_ref(pack_awq_ref(q), pack_awq_ref(z), s)
    assert torch.equal(w[5], (q[5] - 3).float() * s[0].float())
    assert torch.equal(w[0], -3 * s[0].float())


def random_awq(n: int, k: int, group_size: int, device) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(device) for t in quantize_awq_ref(torch.randn(n, k) * 0.05, group_size))


@requires_triton
@pytest.mark.parametrize("rows", [GEMV_ROWS + 1, 7, 16, 33, 64, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_product_matches_reference(device, rows, dtype):
    from mini_engine.kernels.awq_linear import awq_linear, awq_tile
    from mini_engine.kernels.triton_utils import num_sms
    torch.manual_seed(rows)
    # 32 columns over 256 inputs: one column tile, so K splits in 2-4 (the splits' sum kernel)
    assert rows > 16 or awq_tile(rows, 32, 256, 64, num_sms(torch.device(device))).split_k > 1
    for n, k, group_size in ((72, 256, 128), (40, 96, 32), (32, 256, 64)):
        weights = random_awq(n, k, group_size, device)
        x = torch.randn(rows, k, device=device).to(dtype)
        expected = awq_linear_ref(x, *weights).float()
        out = awq_linear(x, *weights)
        assert out.dtype == dtype and out.shape == (rows, n)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2       # a bf16 output's last bit
        torch.testing.assert_close(out.float(), expected, rtol=0, atol=tolerance * expected.abs().max().item())


@requires_triton
@pytest.mark.parametrize("rows", range(1, 9))
def test_fma_product_matches_reference(device, rows, monkeypatch):
    """The FMA product, at up to 8 rows (the engine takes it to GEMV_ROWS): K split or not, a
    partial word tile (200 columns are 25 words), one group over the whole input, in fp32 (to its
    last bits: no rounding of W then) and bf16 (a bf16 output's last bit, W rounded by the
    reference only)."""
    from mini_engine.kernels import awq_linear as module
    from mini_engine.kernels.awq_linear import awq_gemv_tile, awq_linear
    monkeypatch.setattr(module, "GEMV_ROWS", 8)
    torch.manual_seed(rows)
    assert awq_gemv_tile(200, 256, 256).split_k == 2 and awq_gemv_tile(40, 96, 32).split_k == 1
    for n, k, group_size in ((200, 256, 256), (40, 96, 32), (1024, 512, 128)):
        weights = random_awq(n, k, group_size, device)
        for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            x = torch.randn(rows, k, device=device).to(dtype)
            expected = awq_linear_ref(x, *weights).float()
            out = awq_linear(x, *weights)
            assert out.dtype == dtype and out.shape == (rows, n)
            torch.testing.assert_close(out.float(), expected, rtol=0, atol=tolerance * expected.abs().max().item())


@requires_triton
@pytest.mark.parametrize("rows", [GEMV_ROWS, 3, DEQUANTIZE_ROWS + 5])
def test_residual_and_bias(device, rows):
    """The product added into the residual stream (rounded first, as linear_ref), with a bias;
    on FMAs, on the tensor cores, and the dequantize-then-cuBLAS path from DEQUANTIZE_ROWS rows."""
    from mini_engine.kernels.awq_linear import awq_linear
    torch.manual_seed(1)
    weights = random_awq(32, 256, 32, device)          # at 3 rows, K split: the residual added by the sum
    x, bias = torch.randn(rows, 256, device=device), torch.randn(32, device=device)
    residual = torch.randn(rows, 32, device=device)
    for b in (None, bias):
        expected = awq_linear_ref(x, *weights, residual.clone(), b)
        into = residual.clone()
        out = awq_linear(x, *weights, into, b)
        assert out.data_ptr() == into.data_ptr()
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-4)
        torch.testing.assert_close(awq_linear(x, *weights, None, b), awq_linear_ref(x, *weights, None, b),
                                   rtol=0, atol=1e-4)


@requires_triton
def test_dequantize_launch_matches_reference(device):
    from mini_engine.kernels.awq_linear import dequantize_awq
    weights = random_awq(200, 96, 32, device)           # 200 columns: a partial column tile
    for dtype in (torch.float32, torch.bfloat16):
        out, expected = dequantize_awq(*weights, dtype), dequantize_awq_ref(*weights).to(dtype)
        if device == "cuda" or dtype == torch.float32:
            assert torch.equal(out, expected)
        else:       # the interpreter casts fp32 to bf16 by truncation: one bit of 8 at most
            torch.testing.assert_close(out, expected, rtol=2 ** -7, atol=0)
