"""RMSNorm, and the per-row 1/rms that the decoder's folded norms need (layers.linear.NormedPackedLinear)."""
import torch


def inv_rms_ref(x: torch.Tensor, eps: float) -> torch.Tensor:
    """[T, H] -> [T, 1] fp32: 1 / sqrt(mean(x^2) + eps) for each row."""
    return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)


def scale_by_inv_rms_ref(x: torch.Tensor, norm_input: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, N] scaled row by row by 1/rms(norm_input [T, H]) in fp32 and rounded back to x's
    dtype: what is left of an RMSNorm whose weight was folded into the projection that made x
    from norm_input (layers.linear.NormedPackedLinear), as transformers rounds the normed row."""
    return (x.float() * inv_rms_ref(norm_input, eps)).to(x.dtype)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same order of operations as transformers' Qwen3RMSNorm: normalise in fp32, cast, then scale.
    return weight * (x.float() * inv_rms_ref(x, eps)).to(x.dtype)


# ---- Triton ----

from mini_engine.kernels.triton_utils import pdl_enter, pdl_options, tl, triton  # noqa: E402


@triton.jit
def load_row_inv_rms(row_ptr, hidden_size, eps, BLOCK_H: tl.constexpr):
    """One contiguous row of hidden_size elements (BLOCK_H >= hidden_size) in fp32, and its
    1 / rms. Kernels that scale a projection of the row by it (layers.linear.NormedPackedLinear)
    use only the second."""
    cols = tl.arange(0, BLOCK_H)
    x = tl.load(row_ptr + cols, mask=cols < hidden_size, other=0.0).to(tl.float32)
    return x, tl.rsqrt(tl.sum(x * x, axis=0) / hidden_size + eps)


@triton.jit
def scale_by_inv_rms(x, inv_rms, HAS_NORM: tl.constexpr):
    """scale_by_inv_rms_ref inside a kernel, given the row's 1/rms (load_row_inv_rms); x itself
    where there is no folded norm."""
    if HAS_NORM:
        x = (x.to(tl.float32) * inv_rms).to(x.dtype)
    return x


@triton.jit
def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, hidden_size, eps, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr):
    """One program per token; the whole row fits one tile (BLOCK_H >= hidden_size), so the sum of
    squares needs no second pass over memory. Roundings match the reference: the normed row is
    rounded to the model dtype before the weight multiplies it."""
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden_size
    x, scale = load_row_inv_rms(x_ptr + row * hidden_size, hidden_size, eps, BLOCK_H)
    normed = (x * scale).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden_size + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Fused rms_norm_ref. x: [T, H] contiguous."""
    assert x.is_contiguous()
    num_tokens, hidden_size = x.shape
    out = torch.empty_like(x, dtype=torch.promote_types(x.dtype, weight.dtype))
    if num_tokens:
        block_h = triton.next_power_of_2(hidden_size)
        _rms_norm_kernel[(num_tokens,)](x, weight, out, hidden_size, eps, BLOCK_H=block_h,
                                        num_warps=min(max(block_h // 256, 1), 8), **pdl_options(x.device))
    return out
