import torch
import torch.nn.functional as F
from torch import nn

from mini_engine.distributed import TensorParallel, all_reduce
from mini_engine.kernels.linear import skinny_config
from mini_engine.kernels.rms_norm import rms_norm_ref


class Linear(nn.Linear):
    """nn.Linear whose products over a few rows (decode steps) take the skinny Triton kernel where
    it was measured faster than cuBLAS (kernels.linear.skinny_config); other shapes, and layers
    with a bias, stay with cuBLAS.

    forward(x, residual) adds the product to the residual stream in place, in the product's own
    epilogue (cuBLAS's beta = 1, or the skinny kernel's store): the decoder's residual adds cost
    no launch of their own."""
    # Under tensor parallelism, the dimension of the checkpoint's weight that a rank holds a slice
    # of (model/loader.py cuts it): 0, output rows (a column-parallel layer); 1, input columns
    # (row-parallel); None, all of it.
    tp_dim: int | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool, use_triton: bool = False,
                 tp: TensorParallel = TensorParallel()):
        super().__init__(in_features, out_features, bias=bias)
        self.use_triton = use_triton
        self.tp = tp

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


class RowParallelLinear(Linear):
    """o_proj and down_proj: under tensor parallelism each rank holds the input columns of its
    share of the heads (or of the MLP's columns), so its product is one term of a sum over ranks.
    Rank 0 adds its term to the residual stream, the others write theirs in the stream's place,
    and one all-reduce of the stream leaves every rank h + x W^T (the bias, too, added by rank 0
    alone). in_features is this rank's share."""
    tp_dim = 1

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x, residual)
        if residual is None:
            raise ValueError("a row-parallel product under tensor parallelism sums into the residual stream")
        if self.tp.rank == 0:
            super().forward(x, residual)
        else:
            torch.mm(x, self.weight.t(), out=residual)
        return all_reduce(residual, self.tp)


class PackedLinear(Linear):
    """Several projections that read the same input, stacked into one GEMM (q/k/v, gate/up).
    The checkpoint stores them apart; `load_shard` copies each into its rows. Under tensor
    parallelism the layer is column-parallel: each projection keeps this rank's share of its rows
    (output_sizes are the shares), so the heads or columns a rank holds stay together."""
    tp_dim = 0

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, use_triton: bool = False,
                 tp: TensorParallel = TensorParallel()):
        super().__init__(in_features, sum(output_sizes), bias=bias, use_triton=use_triton, tp=tp)
        self.output_sizes = output_sizes

    # ---- what the loader asks (model/loader.py), as of layers.moe.FusedExperts ----

    def num_shards(self, attr: str) -> int:
        """Checkpoint tensors that fill parameter `attr`: one a projection for the weight and bias."""
        return len(self.output_sizes) if attr in ("weight", "bias") else 1

    def shard_shape(self, attr: str, shard: int) -> list[int]:
        """Projection `shard`'s part of `attr`: its rows (this rank's share of them)."""
        return [self.output_sizes[shard], *getattr(self, attr).shape[1:]]

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

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, eps: float, use_triton: bool = False,
                 tp: TensorParallel = TensorParallel()):
        super().__init__(in_features, output_sizes, bias, use_triton, tp)
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
