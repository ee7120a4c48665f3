import torch
import torch.nn.functional as F
from torch import nn

from mini_engine.kernels.linear import SkinnyConfig, skinny_config


class Linear(nn.Linear):
    """nn.Linear whose products over a few rows (decode steps) take the skinny Triton kernel where
    it was measured faster than cuBLAS (kernels.linear.skinny_config); other shapes, and layers
    with a bias, stay with cuBLAS."""

    def __init__(self, in_features: int, out_features: int, bias: bool, use_triton: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.use_triton = use_triton

    def skinny_config(self, num_rows: int, gated: bool = False) -> SkinnyConfig | None:
        if not self.use_triton or self.bias is not None:
            return None
        return skinny_config(num_rows, self.out_features, self.in_features, gated)

    def forward(self, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
        """gated: x is a packed [gate | up] pair and the layer computes linear(silu(gate) * up), in
        the skinny kernel; only where skinny_config(rows, gated=True) gives a configuration."""
        config = self.skinny_config(x.shape[0], gated)
        if config is not None:
            from mini_engine.kernels.linear import skinny_linear
            return skinny_linear(x, self.weight, config, gated)
        if gated:
            raise ValueError(f"no gated skinny configuration for {x.shape[0]} rows")
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
