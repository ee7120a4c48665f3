"""Weight updates in place: what RL trainers give vLLM's offline LLM between training steps (TRL's
GRPO with vLLM colocated, verl, OpenRLHF all call the model's load_weights with named tensors).
Hugging Face's names and tensors, a whole state dict or any part of it, go through the loader's
name translation, packing (q/k/v -> qkv_proj's rows, gate/up -> gate_up_proj's), tensor-parallel
cut and dtype conversion (model/loader.py), and are copied into the running model's own
parameters: the storage stays where it is, so the CUDA graphs captured over it stay valid. Then
what loading does after the tensors is done again for what changed: the norms' folding, fp8
quantization (quantization="fp8", or an FP8 checkpoint: its weights are given in bf16/fp32 and
quantized here into the same 128 x 128 blocks); a tied lm_head is the embedding's own storage.

Folded norms. A layer's input_layernorm and post_attention_layernorm weights g live in the
projection after them, W' = W diag(g) (layers/linear.py, NormedPackedLinear): the model holds W'
and g (folded_norm_weight), not W. A new W is folded with the g held; a new g needs every
projection's W: the update's own, else a host copy of the W an earlier update gave
(WeightUpdater.unfolded), else, for a projection no update has written since loading, the
checkpoint's on disk, checked first to fold into the W' the model holds (a checkpoint changed on
disk since is refused). So per-tensor updates (TRL and OpenRLHF send one tensor a call, each
layer's norms after its projections) compose to what a fresh load of the final tensors gives, bit
for bit. The price is host memory: a copy of each q/k/v and gate/up projection updates have written
(dividing W' by the old g instead would round, and fails where g has a zero).

Every tensor is checked (name, shape, dtype, finite values) and every W a new g needs is found
before anything is written: a bad update raises ValueError and leaves the model as it was."""
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from mini_engine.kernels.fp8_linear import BLOCK, quantize_fp8_weight_ref
from mini_engine.layers.linear import AWQ_PARAMS, NormedPackedLinear
from mini_engine.layers.moe import FusedExperts
from mini_engine.model.loader import (checkpoint_files, checkpoint_shape, checkpoint_target, module_of, num_shards,
                                      rank_slice, untranslate)

# Weights whose values are given as float8 (or the scales beside them) are refused: an update gives
# the weight in a wider dtype, and the engine makes the fp8 blocks and their scales.
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(slots=True)
class TensorUpdate:
    """One checked tensor of an update: the parameter (and shard of it) it fills, and this rank's share."""
    checkpoint_name: str
    param_name: str
    shard: int | None
    tensor: torch.Tensor                  # this rank's share, as given (cast when written)
    source: torch.Tensor | None = None    # the whole tensor, as given: what rank 0 sends the other ranks


@dataclass(slots=True)
class FoldedUpdate:
    """What an update writes into one folded NormedPackedLinear: its new g, if given, and the W of
    each projection (shard) to fold into its rows: given, held on the host, or read from disk."""
    module: NormedPackedLinear
    weight_name: str
    norm: torch.Tensor | None = None
    rows: dict[int, torch.Tensor] = field(default_factory=dict)
    # The shards whose W this update gives or read from disk: kept on the host afterwards.
    new_rows: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass(slots=True)
class UpdatePlan:
    """An update's writes, everything that could fail (bad tensors, checkpoint reads) done."""
    plain: list[TensorUpdate]
    folded: list[FoldedUpdate]
    written: set[tuple[str, int]]         # (parameter, shard) each tensor fills


def folds_norm(module: nn.Module) -> bool:
    """Whether the module holds W diag(g) in place of W (a loaded NormedPackedLinear that folded)."""
    return isinstance(module, NormedPackedLinear) and module.norm_in_weight and module.folded_norm_weight is not None


def fold(weight: torch.Tensor, norm: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W diag(g) as NormedPackedLinear.fold_norm_weight makes it from the loaded W and g (both in the
    model's dtype): their product in fp32, rounded once to the model's dtype."""
    return (weight.to(dtype).float() * norm.to(dtype).float()).to(dtype)


def row_range(module: nn.Module, shard: int | None, rows_per: int = 1) -> slice:
    """The rows of a packed parameter that projection `shard` fills (rows_per: BLOCK for the fp8
    scales, one a block of rows); all of them for an unpacked one (shard None)."""
    if shard is None:
        return slice(None)
    sizes = module.output_sizes
    start = sum(sizes[:shard]) // rows_per
    return slice(start, start + sizes[shard] // rows_per)


def stored_values(module: nn.Module, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What a weight's rows hold for these values (in the model's dtype): the values, or with fp8
    weights their 128 x 128 blocks and scales (quantization="fp8" quantizes the loaded weight so)."""
    if getattr(module, "weight_scale_inv", None) is None:
        return values, None
    return quantize_fp8_weight_ref(values)


class WeightUpdater:
    """Checks and writes one rank's updates (WeightUpdater.check, plan, apply); held by its ModelRunner."""

    def __init__(self, model: nn.Module, checkpoint: str, dtype: torch.dtype):
        self.model = model
        self.checkpoint = checkpoint      # where a projection never updated is read from (its W)
        self.dtype = dtype                # the model's (its norms' and unquantized weights')
        self.params = dict(model.named_parameters())     # a tied lm_head is embed_tokens.weight, listed once
        # (weight name, shard) -> the W last written into a folded projection's rows, this rank's
        # share, on the host: what a later update of the norm alone folds again.
        self.unfolded: dict[tuple[str, int], torch.Tensor] = {}
        # After sleep(level=2): the (parameter, shard)s not loaded again yet (generation waits for all).
        self.discarded: set[tuple[str, int]] = set()

    def all_tensors(self) -> set[tuple[str, int]]:
        """Every (parameter, shard) a checkpoint fills (the fp8 scales come with their weights)."""
        return {(name, shard) for name in self.params if not name.endswith("weight_scale_inv")
                for shard in range(num_shards(self.model, name))}

    def discard_all(self) -> None:
        """sleep(level=2): the weights' values are gone, and so are the host copies of W."""
        self.discarded = self.all_tensors()
        self.unfolded.clear()

    def missing_names(self) -> list[str]:
        """The checkpoint names of the tensors sleep(level=2) discarded that are not loaded yet."""
        return sorted(untranslate(self.model, name, shard) for name, shard in self.discarded)

    # ---- checking: nothing is written ----

    def check(self, weights) -> list[TensorUpdate]:
        """Each (name, tensor) of weights checked and cut to this rank's share; a ValueError for an
        unknown name, a wrong shape or dtype, a name given twice, or a value that is not finite."""
        updates: dict[tuple[str, int | None], TensorUpdate] = {}
        for item in weights:
            if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)
                    and isinstance(item[1], torch.Tensor)):
                raise ValueError(f"weights must be (name, torch.Tensor) pairs, got {type(item).__name__}")
            name, tensor = item
            if name == "lm_head.weight" and self.model.lm_head is None:
                continue                        # an embedding model has no lm_head (as the loader skips it)
            update = self.check_one(name, tensor)
            previous = updates.setdefault((update.param_name, update.shard), update)
            if previous is update:
                continue
            # A tied lm_head is the embedding: state_dict() lists both names for one tensor.
            if "lm_head.weight" in (name, previous.checkpoint_name) and name != previous.checkpoint_name:
                if torch.equal(previous.source, tensor.to(previous.source)):
                    continue
                raise ValueError("config.json ties lm_head to the embedding (tie_word_embeddings), but the "
                                 "update's lm_head.weight differs from its model.embed_tokens.weight")
            raise ValueError(f"tensor {name!r} is given twice")
        return list(updates.values())

    def check_one(self, name: str, tensor: torch.Tensor) -> TensorUpdate:
        if self.model.config.tie_word_embeddings and name == "lm_head.weight":
            param_name, shard = "embed_tokens.weight", None
        else:
            param_name, shard = checkpoint_target(self.model, self.params, name)
        if param_name.endswith("weight_scale_inv"):
            raise ValueError(f"tensor {name!r}: fp8 scales are made by the engine: give the weight in bf16 or fp32")
        if param_name.rpartition(".")[2] in AWQ_PARAMS:
            method = self.model.config.quantization.method.upper()
            raise ValueError(f"tensor {name!r}: load_weights does not update {method}'s 4-bit weights (their "
                             f"rounding comes from a calibration the engine does not run); start an engine on the new "
                             f"checkpoint")
        expected = checkpoint_shape(self.model, param_name, shard)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
        if not tensor.dtype.is_floating_point or tensor.dtype in FP8_DTYPES:
            raise ValueError(f"tensor {name!r} is {tensor.dtype}: give weights in a floating-point dtype wider than "
                             "fp8 (the engine casts them to the model's, and quantizes fp8 weights itself)")
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"tensor {name!r} holds values that are not finite (NaN or inf)")
        module = module_of(self.model, param_name)
        tensor = tensor.detach()
        return TensorUpdate(name, param_name, shard, rank_slice(module, param_name, tensor), tensor)

    def plan(self, updates: list[TensorUpdate]) -> UpdatePlan:
        """Groups the updates by what they write, and finds the W of every projection whose new norm
        they fold into it (a ValueError where one cannot be had: nothing written)."""
        plain, folded = [], {}
        for u in updates:
            module_name, _, attr = u.param_name.rpartition(".")
            module = module_of(self.model, u.param_name)
            if folds_norm(module) and attr in ("weight", "norm_weight"):
                entry = folded.setdefault(module_name, FoldedUpdate(module, f"{module_name}.weight"))
                if attr == "norm_weight":
                    entry.norm = u.tensor
                else:
                    entry.rows[u.shard] = entry.new_rows[u.shard] = u.tensor
            else:
                plain.append(u)
        from_disk: list[tuple[FoldedUpdate, int]] = []
        for entry in folded.values():
            if entry.norm is None:
                continue                        # the given rows fold with the g held
            for shard in range(len(entry.module.output_sizes)):
                key = (entry.weight_name, shard)
                if shard in entry.rows or key in self.discarded:
                    continue                    # (a discarded projection's rows are folded when it comes)
                if key in self.unfolded:
                    entry.rows[shard] = self.unfolded[key]
                else:
                    from_disk.append((entry, shard))
        if from_disk:
            self.read_projections(from_disk)
        return UpdatePlan(plain, list(folded.values()), {(u.param_name, u.shard or 0) for u in updates})

    def read_projections(self, wanted: list[tuple[FoldedUpdate, int]]) -> None:
        """The W of projections no update has written, from the checkpoint the model was loaded from,
        each checked to fold (with the g held) into exactly what its rows hold now."""
        names = {untranslate(self.model, entry.weight_name, shard): (entry, shard) for entry, shard in wanted}
        found = {}
        for file, listed in checkpoint_files(self.checkpoint).items():
            with safe_open(file, framework="pt") as f:
                for name in set(listed if listed is not None else f.keys()) & names.keys():
                    found[name] = f.get_tensor(name)
        for name, (entry, shard) in names.items():
            module = entry.module
            if name not in found:
                raise ValueError(f"{self.checkpoint} no longer holds {name!r}, which the new norm of "
                                 f"{entry.weight_name.removesuffix('.weight')} must be folded into: give it in "
                                 "the update")
            weight = rank_slice(module, entry.weight_name, found[name])
            held = module.weight.data[row_range(module, shard)]
            values, scales = stored_values(module, fold(weight.to(held.device), module.folded_norm_weight, self.dtype))
            same = held.view(torch.uint8).equal(values.contiguous().view(torch.uint8))
            if same and scales is not None:
                same = module.weight_scale_inv.data[row_range(module, shard, BLOCK)].equal(scales)
            if not same:
                raise ValueError(f"the checkpoint on disk ({self.checkpoint}) no longer holds the {name!r} that was "
                                 "loaded from it, which the update's new norm must be folded into: give it in the "
                                 "update")
            entry.rows[shard] = entry.new_rows[shard] = weight

    # ---- writing ----

    @torch.no_grad()
    def apply(self, plan: UpdatePlan) -> None:
        for u in plan.plain:
            self.write(module_of(self.model, u.param_name), u.param_name, u.shard, u.tensor)
        for entry in plan.folded:
            module = entry.module
            norm = module.folded_norm_weight if entry.norm is None else entry.norm.to(self.dtype)
            for shard, weight in entry.rows.items():
                self.write(module, entry.weight_name, shard, fold(weight.to(module.norm_weight.device), norm,
                                                                  self.dtype))
            if entry.norm is not None:
                module.folded_norm_weight.copy_(norm)
                module.norm_weight.fill_(1.0)       # as folding leaves it (sleep level 2 may have zeroed it)
            for shard, weight in entry.new_rows.items():
                self.unfolded[entry.weight_name, shard] = weight.to("cpu", self.dtype, copy=True)
        self.discarded -= plan.written

    def write(self, module: nn.Module, param_name: str, shard: int | None, values: torch.Tensor) -> None:
        """Copies values into the parameter's own storage (a packed one's rows of that shard, stacked
        experts' one projection); an fp8 weight takes the values' blocks and scales."""
        param = self.params[param_name]
        expert_scales = getattr(module, f"{param_name.rpartition('.')[2]}_scale_inv", None)
        if isinstance(module, FusedExperts) and expert_scales is not None:     # fp8 experts: one projection's
            blocks, scales = quantize_fp8_weight_ref(values.to(param.device, self.dtype))
            module.load_shard(param, blocks, shard)
            module.load_shard(expert_scales, scales, shard)
        elif param_name.endswith(".weight") and getattr(module, "weight_scale_inv", None) is not None:
            blocks, scales = stored_values(module, values.to(param.device, self.dtype))
            param.data[row_range(module, shard)].copy_(blocks)
            module.weight_scale_inv.data[row_range(module, shard, BLOCK)].copy_(scales)
        elif shard is None:
            param.data.copy_(values)
        else:
            module.load_shard(param, values, shard)


def broadcast_tensor(tensor: torch.Tensor) -> None:
    """Rank 0's tensor into every rank's (same shape and dtype, on each rank's device), as bytes, so
    that any dtype crosses gloo and NCCL alike."""
    dist.broadcast(tensor.view(-1).view(torch.uint8), src=0)

