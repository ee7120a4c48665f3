"""SwiGLU: silu(gate) * up over the packed gate/up projection's output."""
import torch
import torch.nn.functional as F


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---- Triton ----

from mini_engine.kernels.triton_utils import tl, triton  # noqa: E402


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, intermediate_size, stride_in, stride_out,
                         BLOCK: tl.constexpr):
    """Program (token, column block): out = silu(gate) * up for BLOCK columns of one token, where
    gate and up are the two halves of the packed row. SiLU runs in fp32 and is rounded to the
    model dtype before the product, as the eager F.silu(gate) * up does."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate_size
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + intermediate_size + cols, mask=mask, other=0.0)
    act = (gate * tl.sigmoid(gate)).to(up.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]; the rows of gate_up may be strided, each row's columns contiguous."""
    assert gate_up.stride(-1) == 1
    num_tokens, intermediate_size = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_tokens, intermediate_size, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens:
        block = min(triton.next_power_of_2(intermediate_size), 1024)
        grid = (num_tokens, triton.cdiv(intermediate_size, block))
        _silu_and_mul_kernel[grid](gate_up, out, intermediate_size, gate_up.stride(0), out.stride(0),
                                   BLOCK=block, num_warps=4)
    return out
