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
