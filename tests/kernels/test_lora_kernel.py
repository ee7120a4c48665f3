import pytest
import torch

pytest.importorskip("triton")
from mini_engine.kernels.lora import LoRAKernelConfig, lora_add, lora_add_ref, lora_mask  # noqa: E402

# bf16: the same shrink (one matmul), but PyTorch's CPU addmm rounds the expand before adding out,
# where the kernel adds in fp32 and rounds once (as cuBLAS's beta = 1 does): one unit of the last
# place apart (1/128 of a value at most). A wrong slot or a lost row is off by ~4.
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=0.0625, rtol=1e-2)}


def operands(m, n, k, num_loras, width, seed, device, dtype):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    a = (torch.randn(num_loras * width, k, generator=gen) / k ** 0.5).to(device, dtype)
    b = torch.randn(n, num_loras * width, generator=gen).to(device, dtype)
    out = (4 * torch.randn(m, n, generator=gen)).to(device, dtype)
    # Every slot, and -1 (no adapter), in a random order.
    slots = torch.randint(-1, num_loras, (m,), generator=gen, dtype=torch.int32)
    if m > 1:
        slots[-1] = -1
    return x, a, b, slots.to(device), out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,num_loras,width", [
    (1, 96, 256, 1, 16),         # one decode row, one slot
    (5, 200, 136, 3, 8),         # three slots of rank 8 (24 columns, padded to 32); K not whole tiles
    (37, 64, 128, 2, 48),        # a packed q/k/v's slots (3 x 16 columns each)
    (70, 130, 64, 4, 16),        # two row blocks; a column tile that is partly past the end
])
def test_lora_add_matches_reference(device, dtype, m, n, k, num_loras, width):
    x, a, b, slots, out = operands(m, n, k, num_loras, width, m * n + k, device, dtype)
    # The reference in the same dtype rounds where the kernel does (the shrink, then the sum).
    expected = lora_add_ref(x, a, b, lora_mask(slots, num_loras, dtype), out.clone())
    got = lora_add(x, a, b, slots, out.clone(), width)
    torch.testing.assert_close(got, expected, **TOL[dtype])
    in_place = out.clone()
    assert lora_add(x, a, b, slots, in_place, width).data_ptr() == in_place.data_ptr()
    # A row without an adapter keeps its bits: nothing is added, not even a rounded zero.
    none = slots == -1
    assert torch.equal(got[none], out[none])


@pytest.mark.parametrize("config", [LoRAKernelConfig(16, 16, 16), LoRAKernelConfig(32, 32, 16, num_stages=3),
                                    LoRAKernelConfig(64, 64, 64)])
def test_lora_add_tiles(device, config):
    """B's columns in several chunks, a chunk that straddles two slots (width 24 in chunks of 16),
    and rows in several blocks or one."""
    x, a, b, slots, out = operands(21, 150, 96, 3, 24, 7, device, torch.float32)
    expected = lora_add_ref(x, a, b, lora_mask(slots, 3, torch.float32), out.clone())
    torch.testing.assert_close(lora_add(x, a, b, slots, out.clone(), 24, config), expected, **TOL[torch.float32])


def test_lora_add_rows_without_adapters_change_nothing(device):
    """A step of base-model rows only (every slot -1): out keeps its bits."""
    x, a, b, _, out = operands(9, 64, 64, 2, 16, 3, device, torch.bfloat16)
    slots = torch.full((9,), -1, dtype=torch.int32, device=device)
    assert torch.equal(lora_add(x, a, b, slots, out.clone(), 16), out)


def test_lora_add_reads_strided_rows(device):
    """x and out as views into wider buffers (a packed product's slice), rows not contiguous."""
    x_wide, a, b, slots, out_wide = operands(6, 80, 64, 1, 16, 5, device, torch.float32)
    x = torch.cat([x_wide, x_wide], dim=1)[:, :64]
    out_buffer = torch.cat([out_wide, out_wide], dim=1)
    out = out_buffer[:, :80]
    expected = lora_add_ref(x, a, b, lora_mask(slots, 1, torch.float32), out.clone())
    lora_add(x, a, b, slots, out, 16)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])
    assert torch.equal(out_buffer[:, 80:], out_wide)
