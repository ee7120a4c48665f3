"""SwiGLU: silu(gate) * up over the packed gate/up projection's output."""
import torch
import torch.nn.functional as F

from mini_engine.kernels.rms_norm import scale_by_inv_rms_ref


def silu_and_mul_ref(gate_up: torch.Tensor, norm_input: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """With norm_input, gate_up is first scaled row by row by 1/rms(norm_input): the rest of the
    RMSNorm folded into the projection that made gate_up (layers.linear.NormedPackedLinear)."""
    if norm_input is not None:
        gate_up = scale_by_inv_rms_ref(gate_up, norm_input, eps)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---- Triton ----

from mini_engine.kernels.rms_norm import load_row_inv_rms, scale_by_inv_rms  # noqa: E402
from mini_engine.kernels.triton_utils import pdl_enter, pdl_options, tl, triton  # noqa: E402


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, norm_input_ptr, intermediate_size, hidden_size, eps,
                         stride_in, stride_out, HAS_NORM: tl.constexpr, BLOCK: tl.constexpr, BLOCKS: tl.constexpr,
                         BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (token, column group): out = silu(gate) * up for BLOCKS blocks of BLOCK columns of
    one token, one block after another, where gate and up are the two halves of the packed row.
    SiLU runs in fp32 and is rounded to the model dtype before the product, as the eager
    F.silu(gate) * up does. With HAS_NORM, gate and up are first scaled by 1/rms of the token's
    norm_input row (rounded as the reference does), which each program reads for itself (2 KB at
    Qwen3-0.6B's width)."""
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    inv_rms = 1.0
    if HAS_NORM:
        _, inv_rms = load_row_inv_rms(norm_input_ptr + row * hidden_size, hidden_size, eps, BLOCK_H)
    for b in tl.static_range(BLOCKS):
        cols = (tl.program_id(1) * BLOCKS + b) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < intermediate_size
        gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0)
        up = tl.load(gate_up_ptr + row * stride_in + intermediate_size + cols, mask=mask, other=0.0)
        dtype = up.dtype
        gate = scale_by_inv_rms(gate, inv_rms, HAS_NORM).to(tl.float32)
        up = scale_by_inv_rms(up, inv_rms, HAS_NORM)
        act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty),
                 mask=mask)


# From this many tokens a program walks its token's whole row, so the norm row is read once a
# token, not once a column block: on the H200 (Qwen3-0.6B's 3,072 columns, three blocks) 78.4
# against 94.0 us at 16,384 tokens, 2.48 against 2.75 at 256 and 2.43 against 2.58 at 224; at 192
# they tie, and fewer tokens need the parallelism of a program a block (64 tokens: 2.05 against
# 1.45 us). benchmarks/decode_sweep.py --sections swiglu; benchmarks/NOTES.md, entry 37.
WHOLE_ROW_MIN_TOKENS = 224


def silu_and_mul(gate_up: torch.Tensor, norm_input: torch.Tensor | None = None, eps: float = 0.0,
                 whole_row_min_tokens: int = WHOLE_ROW_MIN_TOKENS) -> torch.Tensor:
    """[T, 2I] -> [T, I]; the rows of gate_up may be strided, each row's columns contiguous.
    norm_input, when given: [T, H] contiguous (see silu_and_mul_ref). From whole_row_min_tokens
    tokens on, a program a token; below, a program a column block."""
    assert gate_up.stride(-1) == 1 and (norm_input is None or norm_input.is_contiguous())
    num_tokens, intermediate_size = gate_up.shape[0], gate_up.shape[1] // 2
    hidden_size = 1 if norm_input is None else norm_input.shape[1]
    out = torch.empty(num_tokens, intermediate_size, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens:
        block = min(triton.next_power_of_2(intermediate_size), 1024)
        num_blocks = triton.cdiv(intermediate_size, block)
        blocks = num_blocks if num_tokens >= whole_row_min_tokens else 1
        grid = (num_tokens, triton.cdiv(num_blocks, blocks))
        _silu_and_mul_kernel[grid](gate_up, out, gate_up if norm_input is None else norm_input, intermediate_size,
                                   hidden_size, eps, gate_up.stride(0), out.stride(0), HAS_NORM=norm_input is not None,
                                   BLOCK=block, BLOCKS=blocks, BLOCK_H=triton.next_power_of_2(hidden_size),
                                   num_warps=4, **pdl_options(gate_up.device))
    return out
