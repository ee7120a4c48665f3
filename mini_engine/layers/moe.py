"""A Qwen3-MoE layer's MLP (transformers' Qwen3MoeSparseMoeBlock): a router picks k of E experts
for each token, and the token's update is their SwiGLU MLPs' outputs weighted by the router's
probabilities. The experts run as two grouped GEMMs over the tokens sorted by expert
(kernels/fused_moe.py), after one launch for the router's product, softmax and top-k
(kernels/moe_router.py)."""
import torch
from torch import nn

from mini_engine.config import ModelConfig
from mini_engine.distributed import TensorParallel, all_reduce
from mini_engine.kernels.fused_moe import fused_moe_ref
from mini_engine.kernels.moe_router import route_ref
from mini_engine.layers.layernorm import RMSNorm


class FusedExperts(nn.Module):
    """The E experts' weights stacked, as the grouped GEMMs read them: w13_weight [E, 2I, H] (each
    expert's gate_proj rows, then its up_proj rows) and w2_weight [E, H, I] (its down_proj). The
    checkpoint stores each expert's three projections apart (experts.{e}.gate_proj.weight ...):
    the loader copies each into its place through load_shard, shard 2e + 0 or 1 for gate or up
    and e for down. Under tensor parallelism every rank holds every expert, with 1/N of its
    columns: gate and up are cut by rows, down by columns, as a dense MLP's are."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, use_triton: bool = False,
                 tp: TensorParallel = TensorParallel()):
        super().__init__()
        i = tp.shard(intermediate_size)
        self.num_experts, self.intermediate_size, self.tp = num_experts, i, tp
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * i, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, i))
        self.impl = fused_moe_ref
        if use_triton:
            from mini_engine.kernels.fused_moe import fused_moe
            self.impl = fused_moe

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """The experts' update of x's rows; with residual, added into it (and residual returned)."""
        return self.impl(x, self.w13_weight, self.w2_weight, weights, ids, residual=residual)

    # ---- what the loader asks (model/loader.py) ----

    def num_shards(self, attr: str) -> int:
        return 2 * self.num_experts if attr == "w13_weight" else self.num_experts

    def shard_shape(self, attr: str, shard: int) -> list[int]:
        """This rank's part of one checkpoint tensor: [I/N, H] for gate or up, [H, I/N] for down."""
        return list(getattr(self, attr).shape[1:]) if attr == "w2_weight" else [self.intermediate_size,
                                                                                self.w13_weight.shape[2]]

    def split_dim(self, attr: str) -> int:
        """The checkpoint tensor's dimension that the ranks split: gate's and up's rows, down's columns."""
        return 1 if attr == "w2_weight" else 0

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        if param is self.w2_weight:
            param.data[shard].copy_(loaded)
        else:
            expert, part = divmod(shard, 2)
            i = self.intermediate_size
            param.data[expert, part * i:(part + 1) * i].copy_(loaded)

    @staticmethod
    def checkpoint_name(attr: str, shard: int) -> str:
        """The checkpoint's name of shard `shard` of parameter `attr`, below the experts module."""
        if attr == "w2_weight":
            return f"{shard}.down_proj.weight"
        expert, part = divmod(shard, 2)
        return f"{expert}.{('gate_proj', 'up_proj')[part]}.weight"


class Qwen3SparseMoeBlock(nn.Module):
    """post_attention_layernorm, the router (`gate`, as the checkpoint names it) and the experts;
    the update is added to the residual stream in place, as the dense MLP's down_proj adds it.
    The norm is not folded into the weights here (as it is into a dense layer's gate/up
    projection): the router and the experts both read the normed rows, which one RMSNorm makes."""

    def __init__(self, config: ModelConfig, kernels: frozenset[str], tp: TensorParallel):
        super().__init__()
        self.top_k, self.renormalize, self.tp = config.num_experts_per_tok, config.norm_topk_prob, tp
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, use_triton="rms_norm" in kernels)
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = FusedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                    use_triton="fused_moe" in kernels, tp=tp)
        self.route = route_ref
        if "fused_moe" in kernels:
            from mini_engine.kernels.moe_router import route
            self.route = route

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = self.norm(hidden)
        weights, ids = self.route(x, self.gate.weight, self.top_k, self.renormalize)
        if self.tp.size == 1:
            return self.experts(x, weights, ids, residual=hidden)
        # Each rank's update is its share of the experts' columns: a term of the sum, as a
        # row-parallel product's (layers/linear.py RowParallelLinear).
        if self.tp.rank == 0:
            self.experts(x, weights, ids, residual=hidden)
        else:
            hidden.copy_(self.experts(x, weights, ids))
        return all_reduce(hidden, self.tp)
