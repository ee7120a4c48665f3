import torch
from torch import nn

from mini_engine.kernels.rms_norm import rms_norm_ref


class RMSNorm(nn.Module):
    """The final norm, before lm_head. The decoder layers' norms are folded into the projections
    that follow them (layers.linear.NormedPackedLinear)."""

    def __init__(self, size: int, eps: float, use_triton: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.impl = rms_norm_ref
        if use_triton:
            from mini_engine.kernels.rms_norm import rms_norm
            self.impl = rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.impl(x, self.weight, self.eps)
