import torch
from torch import nn


class PackedLinear(nn.Linear):
    """Several projections that read the same input, stacked into one GEMM (q/k/v, gate/up).
    The checkpoint stores them apart; `load_shard` copies each into its rows."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool):
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = output_sizes

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        start = sum(self.output_sizes[:shard])
        size = self.output_sizes[shard]
        param.data[start:start + size].copy_(loaded)
