import torch
from torch import nn

from mini_engine.kernels.activation import silu_and_mul_ref


class SiluAndMul(nn.Module):
    def __init__(self, use_triton: bool = False):
        super().__init__()
        self.impl = silu_and_mul_ref
        if use_triton:
            from mini_engine.kernels.activation import silu_and_mul
            self.impl = silu_and_mul

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.impl(gate_up)
