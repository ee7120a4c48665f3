import torch
from torch import nn

from mini_engine.kernels.rms_norm import add_rms_norm_ref


class RMSNorm(nn.Module):
    """RMSNorm that also takes the residual stream: forward(x, residual) returns
    (norm(x + residual), x + residual), so the add and the norm can be one kernel."""

    def __init__(self, size: int, eps: float, use_triton: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.impl = add_rms_norm_ref
        if use_triton:
            from mini_engine.kernels.rms_norm import add_rms_norm
            self.impl = add_rms_norm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.impl(x, residual, self.weight, self.eps)
