"""A Qwen3-MoE layer's MLP (transformers' Qwen3MoeSparseMoeBlock): a router picks k of E experts
for each token, and the token's update is their SwiGLU MLPs' outputs weighted by the router's
probabilities. The experts run as two grouped GEMMs over the tokens sorted by expert
(kernels/fused_moe.py), after one launch for the router's product, softmax and top-k
(kernels/moe_router.py)."""
import torch
from torch import nn

from mini_engine.config import ModelConfig
from mini_engine.distributed import TensorParallel, all_reduce
from mini_engine.kernels.fp8_fused_moe import fp8_fused_moe_ref
from mini_engine.kernels.fp8_linear import BLOCK, FP8, quantize_fp8_weight_ref
from mini_engine.kernels.fused_moe import fused_moe_ref
from mini_engine.kernels.moe_router import route_ref
from mini_engine.layers.layernorm import RMSNorm


class FusedExperts(nn.Module):
    """The E experts' weights stacked, as the grouped GEMMs read them: w13_weight [E, 2I, H] (each
    expert's gate_proj rows, then its up_proj rows) and w2_weight [E, H, I] (its down_proj). The
    checkpoint stores each expert's three projections apart (experts.{e}.gate_proj.weight ...):
    the loader copies each into its place through load_shard, shard 2e + 0 or 1 for gate or up
    and e for down. Under tensor parallelism every rank holds every expert, with 1/N of its
    columns: gate and up are cut by rows, down by columns, as a dense MLP's are.

    With fp8 weights (hold_fp8_weight: an FP8 checkpoint such as Qwen3-30B-A3B-FP8, or
    quantization="fp8"), both are float8_e4m3fn in 128 x 128 blocks with their fp32 scales stacked
    the same way, w13_weight_scale_inv [E, 2I/128, ceil(H/128)] and w2_weight_scale_inv [E,
    ceil(H/128), I/128] (vLLM's names; the checkpoint's experts.{e}.gate_proj.weight_scale_inv ...),
    and the products are kernels/fp8_fused_moe.py's."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, use_triton: bool = False,
                 tp: TensorParallel = TensorParallel()):
        super().__init__()
        i = tp.shard(intermediate_size)
        self.num_experts, self.intermediate_size, self.tp = num_experts, i, tp
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * i, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, i))
        self.use_triton = use_triton
        self.impl = fused_moe_ref
        if use_triton:
            from mini_engine.kernels.fused_moe import fused_moe
            self.impl = fused_moe
        # With fp8 weights: their block scales, and the products (Triton's where the bf16 ones are).
        self.w13_weight_scale_inv: nn.Parameter | None = None
        self.w2_weight_scale_inv: nn.Parameter | None = None
        self.fp8_impl = fp8_fused_moe_ref

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """The experts' update of x's rows; with residual, added into it (and residual returned)."""
        if self.w13_weight_scale_inv is None:
            return self.impl(x, self.w13_weight, self.w2_weight, weights, ids, residual=residual)
        return self.fp8_impl(x, self.w13_weight, self.w2_weight, weights, ids, self.w13_weight_scale_inv,
                             self.w2_weight_scale_inv, residual=residual)

    # ---- fp8 weights ----

    def hold_fp8_weight(self, device: torch.device, w13: torch.Tensor | None = None,
                        w13_scale: torch.Tensor | None = None, w2: torch.Tensor | None = None,
                        w2_scale: torch.Tensor | None = None) -> None:
        """Hold the weights as fp8 blocks: the given ones (quantization="fp8"), or empty ones on
        `device` that the loader fills from an FP8 checkpoint (the bf16 ones may be meta tensors:
        ModelRunner.start). A block must not straddle an expert's gate and up rows,
        nor two ranks' shares of its columns: this rank's share of moe_intermediate_size is whole
        blocks (as vLLM's fp8 experts need: vllm-project/vllm#25292)."""
        i = self.intermediate_size
        if i % BLOCK:
            share = f" (this rank's share of {i * self.tp.size} under tensor parallelism)" if self.tp.size > 1 else ""
            raise ValueError(f"fp8 experts: an expert's gate and up projections of {i} rows{share} must be whole "
                             f"{BLOCK}-row blocks, so that each block's scale is one projection's and one rank's")
        num_experts, hidden_size = self.num_experts, self.w13_weight.shape[2]
        if w13 is None:
            hidden_blocks = -(-hidden_size // BLOCK)
            w13 = torch.empty(num_experts, 2 * i, hidden_size, dtype=FP8, device=device)
            w13_scale = torch.empty(num_experts, 2 * i // BLOCK, hidden_blocks, dtype=torch.float32, device=device)
            w2 = torch.empty(num_experts, hidden_size, i, dtype=FP8, device=device)
            w2_scale = torch.empty(num_experts, hidden_blocks, i // BLOCK, dtype=torch.float32, device=device)
        self.w13_weight = nn.Parameter(w13, requires_grad=False)
        self.w13_weight_scale_inv = nn.Parameter(w13_scale, requires_grad=False)
        self.w2_weight = nn.Parameter(w2, requires_grad=False)
        self.w2_weight_scale_inv = nn.Parameter(w2_scale, requires_grad=False)
        if self.use_triton:
            from mini_engine.kernels.fp8_fused_moe import fp8_fused_moe
            self.fp8_impl = fp8_fused_moe

    @torch.no_grad()
    def quantize_weight_fp8(self) -> None:
        """quantization="fp8": the loaded weights, in fp8 blocks from now on (each expert's gate and
        up apart, since I is whole blocks)."""
        self.hold_fp8_weight(self.w13_weight.device, *quantize_fp8_weight_ref(self.w13_weight),
                             *quantize_fp8_weight_ref(self.w2_weight))

    # ---- what the loader asks (model/loader.py): for each weight, and for its fp8 scales alike ----

    def num_shards(self, attr: str) -> int:
        return 2 * self.num_experts if attr.startswith("w13_") else self.num_experts

    def shard_shape(self, attr: str, shard: int) -> list[int]:
        """This rank's part of one checkpoint tensor: [I/N, H] for gate or up, [H, I/N] for down (their
        scales: one a 128 x 128 block of these)."""
        shape = list(getattr(self, attr).shape[1:])
        if attr.startswith("w13_"):
            shape[0] //= 2
        return shape

    def split_dim(self, attr: str) -> int:
        """The checkpoint tensor's dimension that the ranks split: gate's and up's rows, down's columns."""
        return 0 if attr.startswith("w13_") else 1

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        if param is self.w2_weight or param is self.w2_weight_scale_inv:
            param.data[shard].copy_(loaded)
        else:
            expert, part = divmod(shard, 2)
            rows = param.shape[1] // 2
            param.data[expert, part * rows:(part + 1) * rows].copy_(loaded)

    @staticmethod
    def checkpoint_name(attr: str, shard: int) -> str:
        """The checkpoint's name of shard `shard` of parameter `attr`, below the experts module."""
        stacked, _, tensor = attr.partition("_")          # "w13", "weight" or "weight_scale_inv"
        if stacked == "w2":
            return f"{shard}.down_proj.{tensor}"
        expert, part = divmod(shard, 2)
        return f"{expert}.{('gate_proj', 'up_proj')[part]}.{tensor}"


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
