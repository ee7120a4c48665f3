"""Loads a Hugging Face safetensors checkpoint into Qwen3ForCausalLM, packing q/k/v and gate/up
(and, for Qwen3-MoE, stacking each layer's experts: layers.moe.FusedExperts). A GPTQ checkpoint's
tensors become AWQ's as they are read (model/gptq_repack.py)."""
import json
import os
import re

import torch
from safetensors import safe_open
from torch import nn

from mini_engine.kernels.fp8_linear import FP8
from mini_engine.layers.linear import AWQ_PARAMS, Linear
from mini_engine.layers.moe import FusedExperts
from mini_engine.model.gptq_repack import as_awq_tensor, check_g_idx, stored_shape
from mini_engine.quantization import AwqConfig, GptqConfig, QuantizationConfig


def checkpoint_files(path: str) -> dict[str, list[str] | None]:
    """Each safetensors file of the checkpoint, with the tensors to take from it: those its index's
    weight_map names (a stale shard may hold others), or None, all of them, without an index."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map'")
        files: dict[str, list[str] | None] = {}
        for tensor, name in sorted(weight_map.items()):
            files.setdefault(os.path.join(path, name), []).append(tensor)
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = {os.path.join(path, "model.safetensors"): None}
    else:
        raise FileNotFoundError(f"{path}: neither model.safetensors nor model.safetensors.index.json")
    for file in files:
        if not os.path.isfile(file):
            raise FileNotFoundError(f"checkpoint shard {file} is missing")
    return files


def load_model(model: nn.Module, path: str) -> None:
    params = dict(model.named_parameters())       # tied lm_head shares embed_tokens.weight: listed once
    tied = model.config.tie_word_embeddings
    loaded: set[tuple[str, int]] = set()
    needed = {(name, shard) for name in params for shard in range(num_shards(model, name))}
    tied_copy = None
    # A GPTQ checkpoint's tensors become AWQ's as they are read (model/gptq_repack.py).
    gptq = model.config.quantization if isinstance(model.config.quantization, GptqConfig) else None
    for file, names in checkpoint_files(path).items():
        try:
            handle = safe_open(file, framework="pt")
        except Exception as e:
            raise ValueError(f"{file}: not a readable safetensors file ({e})") from e
        with handle as f:
            if names is None:
                names = list(f.keys())
            elif missing := sorted(set(names) - set(f.keys())):
                raise ValueError(f"{file}: the index places {missing[:4]} here, but the file does not hold them")
            for ckpt_name in names:
                if ckpt_name == "lm_head.weight" and model.lm_head is None:
                    continue                    # an embedding model pools the hidden states
                if tied and ckpt_name == "lm_head.weight":
                    tied_copy = f.get_tensor(ckpt_name)    # some exporters write the tied copy too
                    continue
                if (gptq is not None and ckpt_name.endswith(".g_idx")
                        and gptq.quantizes(ckpt_name.removesuffix(".g_idx"))):
                    check_g_idx(file, ckpt_name, f.get_tensor(ckpt_name), gptq.group_size)
                    continue
                try:
                    name, shard = checkpoint_target(model, params, ckpt_name)
                except ValueError as e:
                    raise ValueError(f"{file}: {e}") from None
                param = params[name]
                tensor = f.get_tensor(ckpt_name)
                module = module_of(model, name)
                expected = checkpoint_shape(model, name, shard)
                if gptq is not None:
                    expected = stored_shape(name, expected)
                if tuple(tensor.shape) != expected:
                    raise ValueError(f"{file}: tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, "
                                     f"expected {expected}" + (f" (config.json's id2label or num_labels: "
                                                               f"{model.config.num_labels} labels)"
                                                               if name == "score.weight" else ""))
                if (param.dtype == FP8) != (tensor.dtype == FP8):   # a cast would drop (or skip) the scales
                    raise ValueError(f"{file}: tensor {ckpt_name!r} is {tensor.dtype}, expected "
                                     + ("float8_e4m3fn (config.json's quantization_config says fp8)"
                                        if param.dtype == FP8 else f"{param.dtype} (config.json says nothing of fp8)"
                                        if model.config.quantization is None else
                                        f"{param.dtype} (only the decoder's projections and experts are fp8, less "
                                        f"modules_to_not_convert: this tensor is kept in the model's dtype)"))
                if (param.dtype == torch.int32) != (tensor.dtype == torch.int32):   # AWQ's packed words
                    raise ValueError(f"{file}: tensor {ckpt_name!r} is {tensor.dtype}, expected "
                                     + ("int32 (eight 4-bit values packed in each)" if param.dtype == torch.int32
                                        else f"{param.dtype}"))
                if gptq is not None:
                    tensor = as_awq_tensor(name, tensor, gptq)
                tensor = rank_slice(module, name, tensor)
                with torch.no_grad():
                    if shard is None:
                        param.copy_(tensor)
                    else:
                        module.load_shard(param, tensor, shard)
                loaded.add((name, shard or 0))
    missing = sorted(needed - loaded)
    if ("score.weight", 0) in missing:
        raise ValueError(f"{path}: config.json says this is a sequence classifier (Qwen3ForSequenceClassification), "
                         "but the checkpoint has no score.weight, its classification head")
    if missing:
        names = [untranslate(model, name, shard) for name, shard in missing]
        raise ValueError(f"{path}: checkpoint is missing tensors {names[:8]}" + (" ..." if len(names) > 8 else ""))
    embed = model.embed_tokens.weight
    if tied_copy is not None and not torch.equal(rank_slice(model.embed_tokens, "embed_tokens.weight",
                                                            tied_copy).to(embed), embed):
        raise ValueError(f"{path}: config.json ties lm_head to the embedding (tie_word_embeddings), but the "
                         "checkpoint's lm_head.weight differs from model.embed_tokens.weight")
    model.fold_norm_weights()


def checkpoint_target(model: nn.Module, params: dict[str, nn.Parameter], ckpt_name: str) -> tuple[str, int | None]:
    """(our parameter's name, its shard or None) that checkpoint tensor ckpt_name fills; a
    ValueError where the model has no such parameter (params: model.named_parameters())."""
    name, shard = translate(model, ckpt_name)
    if name not in params or (shard or 0) >= num_shards(model, name):
        raise ValueError(f"unexpected tensor {ckpt_name!r} (no parameter {name!r} in Qwen3"
                         + (f", or no shard {shard} of it)" if shard else ")"))
    return name, shard


def checkpoint_shape(model: nn.Module, name: str, shard: int | None) -> tuple[int, ...]:
    """The shape of the checkpoint tensor that fills shard `shard` of our parameter `name`: whole,
    as the checkpoint stores it, where tensor parallelism gives this rank a slice of it."""
    module = module_of(model, name)
    if shard is None:
        expected = list(model.get_parameter(name).shape)
    else:
        expected = module.shard_shape(name.rpartition(".")[2], shard)
    dim = split_dim(module, name)
    if dim is not None:           # the parameter is this rank's slice of the tensor
        expected[dim] = getattr(module, "vocab_size", expected[dim] * module.tp.size)
    return tuple(expected)


def split_dim(module: nn.Module, param_name: str) -> int | None:
    """The dimension of a checkpoint tensor that tensor parallelism splits among the ranks, each
    loading its slice (layers' tp_dim), or None: every rank loads it whole. A bias is split with
    its weight's output rows; a row-parallel layer's is whole (rank 0 adds it), as are norms'. An
    fp8 weight's block scales are split as the weight is.
    Stacked experts say for each of their parameters (layers.moe.FusedExperts.split_dim)."""
    dim, tp = getattr(module, "tp_dim", None), getattr(module, "tp", None)
    attr = param_name.rpartition(".")[2]
    if callable(getattr(module, "split_dim", None)):
        return None if tp.size == 1 else module.split_dim(attr)
    if (dim is None or tp is None or tp.size == 1 or attr not in ("weight", "bias", "weight_scale_inv", *AWQ_PARAMS)
            or (attr == "bias" and dim != 0)):
        return None
    return 1 - dim if attr in AWQ_PARAMS else dim



def rank_slice(module: nn.Module, param_name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The part of a checkpoint tensor that this rank holds: ceil(size / N) along the split
    dimension, the last rank's padded with zeros where N does not divide it (a vocabulary's rows)."""
    dim = split_dim(module, param_name)
    if dim is None:
        return tensor
    share = module.tp.shard(tensor.shape[dim])
    start = min(module.tp.rank * share, tensor.shape[dim])
    part = tensor.narrow(dim, start, min(share, tensor.shape[dim] - start))
    if part.shape[dim] < share:
        padding = list(part.shape)
        padding[dim] = share - part.shape[dim]
        part = torch.cat([part, part.new_zeros(padding)], dim=dim)
    return part


def num_shards(model: nn.Module, param_name: str) -> int:
    """How many checkpoint tensors fill a parameter, as its module says (a packed layer's weight and
    bias: one a projection; stacked experts: one an expert and projection), else one."""
    module, _, attr = param_name.rpartition(".")
    shards = getattr(model.get_submodule(module), "num_shards", None)
    return shards(attr) if callable(shards) else 1


# One expert's projection in a Qwen3-MoE checkpoint, or its fp8 scales:
# layers.{i}.mlp.experts.{e}.gate_proj.weight (.weight_scale_inv)
EXPERT_TENSOR = re.compile(r"(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\."
                           r"(?P<tensor>weight|weight_scale_inv)")


def translate(model: nn.Module, ckpt_name: str) -> tuple[str, int | None]:
    """Checkpoint tensor name -> (our parameter name, shard index in a packed parameter or None).
    An expert's projection is shard 2e (gate) or 2e + 1 (up) of w13_weight, or e of w2_weight (its
    fp8 scales the same shard of w13_weight_scale_inv or w2_weight_scale_inv)."""
    name = ckpt_name.removeprefix("model.")
    for old, new in model.renames(name).items():
        name = name.replace(old, new)
    if expert := EXPERT_TENSOR.fullmatch(name):
        e = int(expert["expert"])
        if expert["proj"] == "down_proj":
            return f"{expert['experts']}.w2_{expert['tensor']}", e
        return f"{expert['experts']}.w13_{expert['tensor']}", 2 * e + (expert["proj"] == "up_proj")
    for part, (packed, shard) in model.packed_modules_mapping.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{packed}."), shard
    return name, None


def untranslate(model: nn.Module, name: str, shard: int) -> str:
    module, _, attr = name.rpartition(".")
    checkpoint_name = getattr(model.get_submodule(module), "checkpoint_name", None)
    if checkpoint_name is not None:
        name = f"{module}.{checkpoint_name(attr, shard)}"
    for part, (packed, index) in model.packed_modules_mapping.items():
        if f".{packed}." in name and index == shard:
            name = name.replace(f".{packed}.", f".{part}.")
            break
    for old, new in model.renames(name).items():
        name = name.replace(new, old)
    return name if name.startswith(("lm_head", "score")) else "model." + name


def module_of(model: nn.Module, param_name: str) -> nn.Module:
    return model.get_submodule(param_name.rpartition(".")[0])


def hold_quantized_weights(model: nn.Module, quantization: QuantizationConfig, use_triton: bool,
                           device: torch.device) -> None:
    """Before a quantized checkpoint loads: each projection that it stores quantized holds its
    weight as the checkpoint does (layers.linear.Linear.hold_fp8_weight, hold_awq_weight; a
    Qwen3-MoE layer's experts, layers.moe.FusedExperts.hold_fp8_weight), empty on `device`, to be
    filled with the scales (and AWQ's zero points) beside it. The model may still be on the meta
    device (ModelRunner.start): then no full-precision copy of these weights is ever allocated.
    use_triton: the fp8 or AWQ products' kernel (the experts take the grouped GEMM's, where their
    bf16 products would)."""
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            weights = [f"{name}.weight"]
        elif isinstance(module, FusedExperts):
            weights = [f"{name}.w13_weight", f"{name}.w2_weight"]
        else:
            continue
        stored = [untranslate(model, weight, shard).removesuffix(".weight")
                  for weight in weights for shard in range(num_shards(model, weight))]
        quantized = [quantization.quantizes(part) for part in stored]
        if all(quantized):
            if isinstance(module, FusedExperts):
                if quantization.method != "fp8":        # EngineConfig refuses these first
                    raise ValueError(f"{quantization.method} Qwen3-MoE experts are not supported")
                module.hold_fp8_weight(device)
            elif isinstance(quantization, AwqConfig):       # a GPTQ checkpoint's too, repacked as it loads
                module.hold_awq_weight(quantization.group_size, use_triton, device)
            else:
                module.hold_fp8_weight(use_triton, device)
        elif any(quantized):
            kept = [part for part, q in zip(stored, quantized) if not q]
            kept_by = "modules_to_not_convert" + (" or dynamic" if isinstance(quantization, GptqConfig) else "")
            raise ValueError(f"config.json: {kept_by} keeps some of {abridged(stored)} out of "
                             f"{quantization.method} but not all ({abridged(kept)}); mini_engine runs them as one "
                             f"product" + (" (a layer's experts: one grouped GEMM)" if len(weights) > 1 else ""))


def abridged(names: list[str], most: int = 4) -> str:
    """A list of names for an error message: a layer's experts have hundreds."""
    return str(names) if len(names) <= most else f"[{', '.join(map(repr, names[:most]))}, ... {len(names)} in all]"
