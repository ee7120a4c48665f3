import torch
from torch import nn

from mini_engine.kernels.activation import silu_and_mul_ref


class SiluAndMul(nn.Module):
    """SwiGLU over the packed gate/up product; with norm_input, the product is first divided row
    by row by rms(norm_input) (the folded post-attention norm: layers.linear.NormedPackedLinear)."""

    def __init__(self, eps: float = 0.0, use_triton: bool = False):
        super().__init__()
        self.eps = eps
        self.impl = silu_and_mul_ref
        if use_triton:
            from mini_engine.kernels.activation import silu_and_mul
            self.impl = silu_and_mul

    def forward(self, gate_up: torch.Tensor, norm_input: torch.Tensor | None = None) -> torch.Tensor:
        return self.impl(gate_up, norm_input, self.eps)
