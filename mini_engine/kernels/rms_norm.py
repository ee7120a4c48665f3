"""RMSNorm, optionally fused with the residual add that precedes it."""
import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same order of operations as transformers' Qwen3RMSNorm: normalise in fp32, cast, then scale.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); with no residual, x itself is the residual."""
    residual = x if residual is None else x + residual
    return rms_norm_ref(residual, weight, eps), residual


# ---- Triton ----

from mini_engine.kernels.triton_utils import tl, triton  # noqa: E402


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, hidden_size, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr):
    """One program per token: reads the row of x (and of the residual) once, writes x + residual
    back as the new residual and its RMSNorm as the output. The whole row fits one tile
    (BLOCK_H >= hidden_size), so the sum of squares needs no second pass over memory.
    Roundings match the reference: the sum is rounded to the model dtype before it is normed,
    the normed row before the weight multiplies it."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * hidden_size + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + row * hidden_size + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * hidden_size + cols, x, mask=mask)
        x = x.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / hidden_size
    normed = (x * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden_size + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused add_rms_norm_ref. x, residual: [T, H] contiguous. The new residual is written IN PLACE
    into `residual`'s storage (the model never reads the old one again), so the hidden state is read
    once and written once; with no residual, x itself is returned as the residual."""
    assert x.is_contiguous() and (residual is None or residual.is_contiguous())
    num_tokens, hidden_size = x.shape
    out = torch.empty_like(x, dtype=torch.promote_types(x.dtype, weight.dtype))
    residual_out = x if residual is None else residual
    if num_tokens:
        block_h = triton.next_power_of_2(hidden_size)
        _add_rms_norm_kernel[(num_tokens,)](
            x, residual, weight, out, residual_out, hidden_size, eps,
            HAS_RESIDUAL=residual is not None, BLOCK_H=block_h, num_warps=min(max(block_h // 256, 1), 8))
    return out, residual_out
