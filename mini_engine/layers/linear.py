import torch
import torch.nn.functional as F
from torch import nn

from mini_engine.kernels.linear import skinny_config


class Linear(nn.Linear):
    """nn.Linear whose products over a few rows (decode steps) take the skinny Triton kernel where
    it was measured faster than cuBLAS (kernels.linear.skinny_config); other shapes, and layers
    with a bias, stay with cuBLAS."""

    def __init__(self, in_features: int, out_features: int, bias: bool, use_triton: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.use_triton = use_triton

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton and self.bias is None:
            config = skinny_config(x.shape[0], self.out_features, self.in_features)
            if config is not None:
                from mini_engine.kernels.linear import skinny_linear
                return skinny_linear(x, self.weight, config)
        return F.linear(x, self.weight, self.bias)


class PackedLinear(Linear):
    """Several projections that read the same input, stacked into one GEMM (q/k/v, gate/up).
    The checkpoint stores them apart; `load_shard` copies each into its rows."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, use_triton: bool = False):
        super().__init__(in_features, sum(output_sizes), bias=bias, use_triton=use_triton)
        self.output_sizes = output_sizes

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        start = sum(self.output_sizes[:shard])
        size = self.output_sizes[shard]
        param.data[start:start + size].copy_(loaded)
