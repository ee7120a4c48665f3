import torch
import torch.nn.functional as F
from torch import nn

from mini_engine.kernels.linear import skinny_config
from mini_engine.kernels.rms_norm import rms_norm_ref


class Linear(nn.Linear):
    """nn.Linear whose products over a few rows (decode steps) take the skinny Triton kernel where
    it was measured faster than cuBLAS (kernels.linear.skinny_config); other shapes, and layers
    with a bias, stay with cuBLAS.

    forward(x, residual) adds the product to the residual stream in place, in the product's own
    epilogue (cuBLAS's beta = 1, or the skinny kernel's store): the decoder's residual adds cost
    no launch of their own."""

    def __init__(self, in_features: int, out_features: int, bias: bool, use_triton: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.use_triton = use_triton

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.bias is not None:
            out = F.linear(x, self.weight, self.bias)
            return out if residual is None else residual.add_(out)
        if self.use_triton:
            config = skinny_config(x.shape[0], self.out_features, self.in_features)
            if config is not None:
                from mini_engine.kernels.linear import skinny_linear
                return skinny_linear(x, self.weight, config, residual)
        if residual is None:
            return F.linear(x, self.weight)
        return residual.addmm_(x, self.weight.t())      # linear_ref's add, in cuBLAS's epilogue


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


class NormedPackedLinear(PackedLinear):
    """RMSNorm followed by a packed projection, with the norm's weight g folded into the projection's:
    RMSNorm(x) W^T = (x / rms(x)) diag(g) W^T = (x W'^T) / rms(x), with W' = W diag(g).

    So the product reads the residual stream x itself, and the norm needs no launch and no pass
    over x of its own: `fold_norm_weight` (called once the checkpoint is loaded) makes W', forward
    returns x W'^T and x, and the kernel that reads the product next divides each row by rms(x),
    reading x's row to get it (kernels.rotary_kv and kernels.activation, `norm_input`).

    A bias is added after the norm, which a divided product cannot do: a layer with one is not
    folded and norms x itself (returning None in place of x)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, eps: float, use_triton: bool = False):
        super().__init__(in_features, output_sizes, bias, use_triton)
        self.norm_weight = nn.Parameter(torch.ones(in_features))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (product, norm_input): the rows whose 1/rms the product's reader still owes,
        or None when the product is already normed."""
        if self.bias is not None:
            return super().forward(rms_norm_ref(x, self.norm_weight, self.eps)), None
        return super().forward(x), x

    @torch.no_grad()
    def fold_norm_weight(self) -> None:
        """W <- W diag(g), rounded once to W's dtype; then g <- 1, so folding twice changes nothing."""
        if self.bias is None:
            self.weight.copy_(self.weight.float() * self.norm_weight.float())
            self.norm_weight.fill_(1.0)
