import torch
import torch.nn.functional as F
from torch import nn

from mini_engine.distributed import TensorParallel, all_reduce
from mini_engine.kernels.awq_linear import PACK, awq_linear_ref
from mini_engine.kernels.fp8_linear import BLOCK, FP8, fp8_linear_ref, quantize_fp8_weight_ref
from mini_engine.kernels.linear import skinny_config
from mini_engine.kernels.rms_norm import rms_norm_ref
from mini_engine.layers.lora import LoRASlots, LoRAStep


class Linear(nn.Linear):
    """nn.Linear whose products over a few rows (decode steps) take the skinny Triton kernel where
    it was measured faster than cuBLAS (kernels.linear.skinny_config); other shapes, and layers
    with a bias, stay with cuBLAS.

    forward(x, residual) adds the product to the residual stream in place, in the product's own
    epilogue (cuBLAS's beta = 1, or the skinny kernel's store): the decoder's residual adds cost
    no launch of their own.

    With fp8 weights (hold_fp8_weight: an FP8 checkpoint, or quantization="fp8"), the weight is
    float8_e4m3fn in 128 x 128 blocks, each with its fp32 scale in weight_scale_inv, and the
    product is kernels/fp8_linear.py's.

    With AWQ weights (hold_awq_weight: an AWQ checkpoint, or a GPTQ one, repacked as it loads by
    model/gptq_repack.py), `weight` is None and the layer holds the checkpoint's qweight, qzeros
    and scales (4 bits a weight, a scale and zero point a group of input rows); the product is
    kernels/awq_linear.py's."""
    # Under tensor parallelism, the dimension of the checkpoint's weight that a rank holds a slice
    # of (model/loader.py cuts it): 0, output rows (a column-parallel layer); 1, input columns
    # (row-parallel); None, all of it.
    tp_dim: int | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool, use_triton: bool = False,
                 tp: TensorParallel = TensorParallel()):
        super().__init__(in_features, out_features, bias=bias)
        self.use_triton = use_triton
        self.tp = tp
        self.weight_scale_inv: nn.Parameter | None = None       # with fp8 weights: their block scales
        self.fp8_product = fp8_linear_ref
        # With AWQ weights: W^T's 4-bit values packed eight to an int32, its zero points, its scales.
        self.qweight: nn.Parameter | None = None
        self.qzeros: nn.Parameter | None = None
        self.scales: nn.Parameter | None = None
        self.awq_product = awq_linear_ref
        self.lora: LoRASlots | None = None                      # with enable_lora: the adapters' slots

    def enable_lora(self, step: LoRAStep, max_rank: int) -> None:
        self.lora = LoRASlots(step, self.in_features, getattr(self, "output_sizes", [self.out_features]), max_rank)
        if self.joins_lora_weight():
            self.weight = nn.Parameter(self.lora.join_weight(self.weight.data), requires_grad=False)

    def joins_lora_weight(self) -> bool:
        """Whether the product computes LoRA's shrink too, over [W; A_all] (layers/lora.py): a
        packed layer (never called with a residual) with a plain weight, no bias."""
        return isinstance(self, PackedLinear) and self.bias is None and self.weight is not None \
            and self.weight_scale_inv is None

    def lora_pair(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of a LoRA pair of one of its projections, A [r, in] and B [out, r] as
        the checkpoint's shapes are: a column-parallel layer's rows of B, a row-parallel one's
        columns of A (its input is its share of the columns: the ranks' deltas sum, in the
        all-reduce the product already makes)."""
        if self.tp.size > 1 and self.tp_dim is not None:
            half = b if self.tp_dim == 0 else a
            share = half.shape[self.tp_dim] // self.tp.size
            half = half.narrow(self.tp_dim, self.tp.rank * share, share)
            a, b = (a, half) if self.tp_dim == 0 else (half, b)
        return a, b

    def hold_fp8_weight(self, use_triton: bool, device: torch.device, weight: torch.Tensor | None = None,
                        scale: torch.Tensor | None = None) -> None:
        """Hold the weight as fp8 blocks: the given ones (quantization="fp8"), or empty ones on
        `device` that the loader fills from an FP8 checkpoint (the bf16 weight may be a meta
        tensor: ModelRunner.start). A block must not straddle two projections of a packed layer,
        nor two ranks' shares."""
        n, k = self.weight.shape
        if self.tp.size > 1 and (n if self.tp_dim == 0 else k) % BLOCK:
            raise ValueError(f"fp8 weights under tensor parallelism: a rank's share of a projection "
                             f"({n} x {k}) must be whole {BLOCK}-wide blocks")
        if weight is None:
            weight = torch.empty(n, k, dtype=FP8, device=device)
            scale = torch.empty(-(-n // BLOCK), -(-k // BLOCK), dtype=torch.float32, device=device)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
        if use_triton:
            from mini_engine.kernels.fp8_linear import fp8_linear
            self.fp8_product = fp8_linear

    def hold_awq_weight(self, group_size: int, use_triton: bool, device: torch.device) -> None:
        """Hold the weight as an AWQ checkpoint stores it, empty on `device`, for the loader to fill:
        qweight [in, out / 8] int32, qzeros [in / group, out / 8] int32, scales [in / group, out] fp16
        (this rank's share of each). group_size 0: one group of the whole input. A group must not
        straddle two ranks' shares, nor a packed word two projections' or ranks' columns."""
        n, k = self.weight.shape
        if group_size == 0:
            if self.tp.size > 1 and self.tp_dim == 1:
                raise ValueError("AWQ weights with group_size -1 (one group of the whole input) under tensor "
                                 "parallelism: a row-parallel layer's ranks would share its scales; not supported")
            group_size = k
        if k % group_size or n % PACK:
            raise ValueError(f"AWQ weights: a projection of {n} x {k} (this rank's share) must be whole groups "
                             f"of {group_size} input rows and whole words of {PACK} output columns")
        self.weight = None
        self.qweight = nn.Parameter(torch.empty(k, n // PACK, dtype=torch.int32, device=device), requires_grad=False)
        self.qzeros = nn.Parameter(torch.empty(k // group_size, n // PACK, dtype=torch.int32, device=device),
                                   requires_grad=False)
        self.scales = nn.Parameter(torch.empty(k // group_size, n, dtype=torch.float16, device=device),
                                   requires_grad=False)
        if use_triton:
            from mini_engine.kernels.awq_linear import awq_linear
            self.awq_product = awq_linear

    @torch.no_grad()
    def quantize_weight_fp8(self, use_triton: bool) -> None:
        """quantization="fp8": the loaded weight, in fp8 blocks from now on."""
        self.hold_fp8_weight(use_triton, self.weight.device, *quantize_fp8_weight_ref(self.weight))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.lora is None:
            return self.product(x, residual)
        if self.lora.joined is not None:
            return self.lora.expand(self.dense_product(x, self.lora.joined))
        return self.lora.add(x, self.product(x, residual))

    def product(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.qweight is not None:
            return self.awq_product(x, self.qweight, self.qzeros, self.scales, residual, self.bias)
        if self.weight_scale_inv is not None:
            return self.fp8_product(x, self.weight, self.weight_scale_inv, residual, bias=self.bias)
        if self.bias is not None:
            out = F.linear(x, self.weight, self.bias)
            return out if residual is None else residual.add_(out)
        return self.dense_product(x, self.weight, residual)

    def dense_product(self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """x weight^T (added into residual), weight a plain [N, in] matrix: the layer's own, or
        [W; A_all] with LoRA (layers/lora.py)."""
        if self.use_triton:
            config = skinny_config(x.shape[0], weight.shape[0], self.in_features)
            if config is not None:
                from mini_engine.kernels.linear import skinny_linear
                return skinny_linear(x, weight, config, residual)
        if residual is None:
            return F.linear(x, weight)
        return residual.addmm_(x, weight.t())      # linear_ref's add, in cuBLAS's epilogue


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
            if self.weight_scale_inv is not None:
                residual.copy_(self.fp8_product(x, self.weight, self.weight_scale_inv))
            elif self.qweight is not None:
                residual.copy_(self.awq_product(x, self.qweight, self.qzeros, self.scales))
            else:
                torch.mm(x, self.weight.t(), out=residual)
            if self.lora is not None:
                self.lora.add(x, residual)
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

    # ---- quantized weights: a block or packed word never straddles two projections ----

    def hold_fp8_weight(self, use_triton: bool, device: torch.device, weight: torch.Tensor | None = None,
                        scale: torch.Tensor | None = None) -> None:
        if any(size % BLOCK for size in self.output_sizes):
            raise ValueError(f"fp8 weights: the projections packed here ({self.output_sizes} rows) must be "
                             f"whole {BLOCK}-row blocks, so that each block's scale is one projection's")
        super().hold_fp8_weight(use_triton, device, weight, scale)

    def hold_awq_weight(self, group_size: int, use_triton: bool, device: torch.device) -> None:
        if any(size % PACK for size in self.output_sizes):
            raise ValueError(f"AWQ weights: the projections packed here ({self.output_sizes} columns) must be "
                             f"whole words of {PACK} columns, so that each word is one projection's")
        super().hold_awq_weight(group_size, use_triton, device)

    # ---- what the loader asks (model/loader.py), as of layers.moe.FusedExperts ----

    def num_shards(self, attr: str) -> int:
        """Checkpoint tensors that fill parameter `attr`: one a projection for the weight (or its
        AWQ tensors), its scales and the bias."""
        return len(self.output_sizes) if attr in PROJECTION_PARAMS else 1

    def shard_span(self, attr: str) -> tuple[int, int]:
        """(the dimension of `attr` along which the projections are stacked, how many of a
        projection's outputs one index of it holds): rows for the weight, its bias and fp8 block
        scales (1/128 of a row each), columns for AWQ's W^T (eight a packed word)."""
        return PROJECTION_PARAMS[attr]

    def shard_shape(self, attr: str, shard: int) -> list[int]:
        """Projection `shard`'s part of `attr` (this rank's share of it)."""
        dim, per_index = self.shard_span(attr)
        shape = list(getattr(self, attr).shape)
        shape[dim] = self.output_sizes[shard] // per_index
        return shape

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        attr = next(name for name, p in self.named_parameters(recurse=False) if p is param)
        dim, per_index = self.shard_span(attr)
        start = sum(self.output_sizes[:shard]) // per_index
        param.data.narrow(dim, start, self.output_sizes[shard] // per_index).copy_(loaded)


# An AWQ projection's parameters (hold_awq_weight), named as the checkpoint names them: W^T's packed
# values, zero points and scales.
AWQ_PARAMS = ("qweight", "qzeros", "scales")

# A packed layer's parameters that its projections fill in turn: the dimension they are stacked
# along, and a projection's outputs an index of it holds (PackedLinear.shard_span).
PROJECTION_PARAMS = {"weight": (0, 1), "bias": (0, 1), "weight_scale_inv": (0, BLOCK),
                     "qweight": (1, PACK), "qzeros": (1, PACK), "scales": (1, 1)}


class NormedPackedLinear(PackedLinear):
    """RMSNorm followed by a packed projection, with the norm's weight g folded into the projection's:
    RMSNorm(x) W^T = (x / rms(x)) diag(g) W^T = (x W'^T) / rms(x), with W' = W diag(g).

    So the product reads the residual stream x itself, and the norm needs no launch and no pass
    over x of its own: `fold_norm_weight` (called once the checkpoint is loaded) makes W', forward
    returns x W'^T and x, and the kernel that reads the product next divides each row by rms(x),
    reading x's row to get it (kernels.rotary_kv and kernels.activation, `norm_input`).

    A bias is added after the norm, which a divided product cannot do: a layer with one is not
    folded and norms x itself (returning None in place of x). Nor are an FP8 checkpoint's weights
    (rounding W diag(g) to fp8 again would change them): the norm is done in the launch that
    quantizes x for the product (kernels/fp8_linear.py). quantization="fp8" quantizes W' itself,
    once it is folded."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, eps: float, use_triton: bool = False,
                 tp: TensorParallel = TensorParallel()):
        super().__init__(in_features, output_sizes, bias, use_triton, tp)
        self.norm_weight = nn.Parameter(torch.ones(in_features))
        self.eps = eps
        self.norm_in_weight = not bias       # whether g is (or will be) folded into the weight
        self.folded_norm_weight: torch.Tensor | None = None     # g, once folded (LoRA's A takes it too)
        self.norm = rms_norm_ref                # where g is not folded: the norm ahead of the product

    def hold_fp8_weight(self, use_triton: bool, device: torch.device, weight: torch.Tensor | None = None,
                        scale: torch.Tensor | None = None) -> None:
        super().hold_fp8_weight(use_triton, device, weight, scale)
        if weight is None:                   # an FP8 checkpoint's: never folded
            self.norm_in_weight = False

    def hold_awq_weight(self, group_size: int, use_triton: bool, device: torch.device) -> None:
        """AWQ weights are never folded: g varies within a group of input rows, which shares one
        scale. The norm runs ahead of the product, on Triton where the product does."""
        super().hold_awq_weight(group_size, use_triton, device)
        self.norm_in_weight = False
        if use_triton:
            from mini_engine.kernels.rms_norm import rms_norm
            self.norm = rms_norm

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (product, norm_input): the rows whose 1/rms the product's reader still owes,
        or None when the product is already normed."""
        if self.norm_in_weight:
            return super().forward(x), x
        if self.weight_scale_inv is not None:
            out = self.fp8_product(x, self.weight, self.weight_scale_inv, None, self.norm_weight, self.eps, self.bias)
            if self.lora is not None:
                self.lora.add(rms_norm_ref(x, self.norm_weight, self.eps), out)
            return out, None
        return super().forward(self.norm(x, self.norm_weight, self.eps)), None

    def lora_pair(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """With g folded into the weight the product reads x, not the normed x: A takes g as W did
        (the reader's 1/rms then norms the delta with the product)."""
        a, b = super().lora_pair(a, b)
        if self.norm_in_weight and self.folded_norm_weight is not None:
            a = a * self.folded_norm_weight.float().cpu()
        return a, b

    @torch.no_grad()
    def fold_norm_weight(self) -> None:
        """W <- W diag(g), rounded once to W's dtype; then g <- 1, so folding twice changes nothing."""
        if self.norm_in_weight:
            self.weight.copy_(self.weight.float() * self.norm_weight.float())
            if self.folded_norm_weight is None:
                self.folded_norm_weight = self.norm_weight.detach().clone()
            self.norm_weight.fill_(1.0)
