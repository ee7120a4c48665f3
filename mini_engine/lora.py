"""LoRA adapters (vLLM's LoRARequest, `enable_lora`): a PEFT adapter folder read into the low-rank
pairs that the model's projections add, h W^T + s (h A^T) B^T, with s = lora_alpha / r (or
lora_alpha / sqrt(r) for rsLoRA). The pairs are read and checked here, on the host; the layers
hold `max_loras` adapters at a time in slots (layers/lora.py), and the runner decides which
adapter a slot holds (runner/lora_adapters.py)."""
import json
import os
import re
from collections import OrderedDict
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from mini_engine.config import ModelConfig

# The projections an adapter may target: a Qwen3 decoder layer's seven (the dense MLP's three only
# in a dense layer: a Qwen3-MoE layer's experts take none).
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")

# PEFT's key for a pair's tensor: base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.(layers\.(\d+)\.(self_attn|mlp)\.(\w+))\.lora_([AB])\.weight$")


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """vLLM's: which adapter a request runs with. lora_int_id names the adapter inside the engine
    (its slot, its prefix-cache blocks): two requests with one id share one adapter."""
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, (str, os.PathLike)):
            raise ValueError(f"lora_path must be a folder's path, got {self.lora_path!r}")


@dataclass(slots=True)
class LoRAAdapter:
    """An adapter's pairs by the projection they change ("layers.0.self_attn.q_proj"): A [r, in]
    and B [out, r] in fp32, B already multiplied by the scale."""
    request: LoRARequest
    rank: int
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]


def projection_shapes(mc: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each projection an adapter may target, by its checkpoint name, and its (out, in) features."""
    d, h, kv = mc.head_dim, mc.num_attention_heads, mc.num_key_value_heads
    attention = {"q_proj": (h * d, mc.hidden_size), "k_proj": (kv * d, mc.hidden_size),
                 "v_proj": (kv * d, mc.hidden_size), "o_proj": (mc.hidden_size, h * d)}
    mlp = {"gate_proj": (mc.intermediate_size, mc.hidden_size), "up_proj": (mc.intermediate_size, mc.hidden_size),
           "down_proj": (mc.hidden_size, mc.intermediate_size)}
    shapes = {}
    for i in range(mc.num_hidden_layers):
        shapes |= {f"layers.{i}.self_attn.{name}": shape for name, shape in attention.items()}
        if not mc.is_sparse_layer(i):
            shapes |= {f"layers.{i}.mlp.{name}": shape for name, shape in mlp.items()}
    return shapes


def read_adapter_config(folder: str) -> dict:
    path = os.path.join(folder, "adapter_config.json")
    if not os.path.isfile(path):
        raise ValueError(f"LoRA adapter {folder!r}: no adapter_config.json (a PEFT adapter folder holds "
                         "adapter_config.json and adapter_model.safetensors)")
    try:
        with open(path) as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    except OSError as e:        # gone or unreadable since isfile(): the request's error, not the engine's
        raise ValueError(f"{path}: cannot be read ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    return config


@dataclass(frozen=True, slots=True)
class AdapterScales:
    """adapter_config.json's ranks and scales: r and lora_alpha, which PEFT's rank_pattern and
    alpha_pattern override for the modules their keys match (PEFT's rule: the first key that
    matches the module's name up to a module boundary)."""
    r: int
    alpha: float
    rslora: bool
    rank_pattern: dict
    alpha_pattern: dict

    @staticmethod
    def pattern_value(patterns: dict, module: str, default):
        for key, value in patterns.items():
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        return default

    def rank_and_scale(self, module: str) -> tuple[int, float]:
        """(r, s) of the module ("model.layers.0.self_attn.q_proj")."""
        r = self.pattern_value(self.rank_pattern, module, self.r)
        alpha = self.pattern_value(self.alpha_pattern, module, self.alpha)
        return r, alpha / (r ** 0.5 if self.rslora else r)


def read_scales(config: dict, path: str) -> AdapterScales:
    """The ranks and scales from adapter_config.json, refusing what this engine does not apply."""
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {config['peft_type']!r} is not LoRA")
    r, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    patterns = {name: config.get(name) or {} for name in ("rank_pattern", "alpha_pattern")}
    for value in (r, *patterns["rank_pattern"].values()):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{path}: a rank (r, rank_pattern) must be an integer >= 1, got {value!r}")
    for value in (alpha, *patterns["alpha_pattern"].values()):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"{path}: lora_alpha (and alpha_pattern's values) must be numbers, got {value!r}")
    refused = {"use_dora": "DoRA", "modules_to_save": "modules_to_save (whole modules trained beside the adapter)",
               "layers_to_transform": "layers_to_transform", "layer_replication": "layer_replication",
               "lora_bias": "lora_bias", "fan_in_fan_out": "fan_in_fan_out",
               "trainable_token_indices": "trainable_token_indices"}
    for name, what in refused.items():
        if config.get(name):
            raise ValueError(f"{path}: {what} is not supported by mini_engine's LoRA")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{path}: bias {config['bias']!r} is not supported (only 'none': the adapter's pairs alone)")
    return AdapterScales(r, alpha, bool(config.get("use_rslora")), patterns["rank_pattern"], patterns["alpha_pattern"])


def load_adapter(request: LoRARequest, mc: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    """The adapter at request.lora_path, checked against the model: a ValueError that names the
    file and the problem for anything this engine cannot apply exactly."""
    folder = os.fspath(request.lora_path)
    if not os.path.isdir(folder):
        raise ValueError(f"LoRA adapter {request.lora_name!r}: {folder!r} is not a folder")
    config_path = os.path.join(folder, "adapter_config.json")
    scales = read_scales(read_adapter_config(folder), config_path)
    weights_path = os.path.join(folder, "adapter_model.safetensors")
    if not os.path.isfile(weights_path):
        hint = " (convert adapter_model.bin to safetensors)" if os.path.isfile(
            os.path.join(folder, "adapter_model.bin")) else ""
        raise ValueError(f"LoRA adapter {request.lora_name!r}: no adapter_model.safetensors in {folder!r}{hint}")
    try:
        tensors = load_file(weights_path)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{weights_path}: not a readable safetensors file ({e})") from None
    shapes = projection_shapes(mc)
    halves: dict[str, dict[str, torch.Tensor]] = {}
    unknown = []
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None or match.group(1) not in shapes:
            unknown.append(key)
            continue
        halves.setdefault(match.group(1), {})[match.group(5)] = tensor
    if unknown:
        raise ValueError(f"{weights_path}: tensors for modules this engine cannot apply LoRA to (it takes "
                         f"{ATTENTION_TARGETS + MLP_TARGETS} of the decoder layers, not a Qwen3-MoE layer's experts, "
                         f"the embedding or lm_head): {sorted(unknown)[:4]}")
    if not halves:
        raise ValueError(f"{weights_path}: no LoRA pairs (lora_A / lora_B weights) in the file")
    pairs = {}
    for name, half in halves.items():
        if set(half) != {"A", "B"}:
            raise ValueError(f"{weights_path}: {name} has lora_{''.join(half)} without its other half")
        a, b = half["A"].float(), half["B"].float()
        out_features, in_features = shapes[name]
        rank, scale = scales.rank_and_scale(f"model.{name}")
        if a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise ValueError(f"{weights_path}: {name}'s lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not "
                             f"fit the model's projection ({out_features} x {in_features}) at r={rank}")
        if rank > max_lora_rank:
            raise ValueError(f"{config_path}: {name}'s rank {rank} is more than max_lora_rank={max_lora_rank}: "
                             f"start the engine with max_lora_rank >= {rank}")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise ValueError(f"{weights_path}: {name} holds values that are not finite")
        pairs[name] = (a, b * scale)
    return LoRAAdapter(request, max(a.shape[0] for a, _ in pairs.values()), pairs)


class AdapterCache:
    """The adapters read so far, the max_cpu_loras most recently used (vLLM's max_cpu_loras): a
    request checks its adapter here when it is added, and LoRAAdapters.prepare reads it again here
    before a step needs it, if it was evicted in between. capacity None: no eviction but drop()'s.
    reads_files False: a tensor-parallel worker's, which holds what rank 0 sends it (put, drop)
    and never reads a file, so that a file gone or damaged cannot fail on one rank alone."""

    def __init__(self, mc: ModelConfig, max_lora_rank: int, capacity: int | None, reads_files: bool = True):
        self.mc, self.max_lora_rank, self.capacity = mc, max_lora_rank, capacity
        self.reads_files = reads_files
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()
        # Every id seen, evicted or not: an id's slot and prefix-cache blocks stay its adapter's.
        self.requests: dict[int, LoRARequest] = {}

    def get(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter, read from request.lora_path if it is not in host memory: a ValueError that
        says what is wrong with the files."""
        known = self.requests.get(request.lora_int_id)
        if known is not None and known != request:
            raise ValueError(f"lora_int_id {request.lora_int_id} is adapter {known.lora_name!r} ({known.lora_path}) "
                             f"in this engine: give {request.lora_name!r} an id of its own")
        adapter = self.adapters.get(request.lora_int_id)
        if adapter is None:
            if not self.reads_files:
                raise LookupError(f"LoRA adapter {request.lora_name!r} (id {request.lora_int_id}) is not in this "
                                  "tensor-parallel worker's memory: rank 0 sends each adapter before the step that "
                                  "loads it")
            self.put(load_adapter(request, self.mc, self.max_lora_rank))
        self.adapters.move_to_end(request.lora_int_id)
        return self.adapters[request.lora_int_id]

    def put(self, adapter: LoRAAdapter) -> None:
        """Holds adapter (replacing its id's copy, if any) as the most recently used."""
        lora_id = adapter.request.lora_int_id
        self.requests[lora_id] = adapter.request
        self.adapters[lora_id] = adapter
        self.adapters.move_to_end(lora_id)
        while self.capacity is not None and len(self.adapters) > self.capacity:
            self.adapters.popitem(last=False)

    def drop(self, lora_id: int) -> None:
        self.adapters.pop(lora_id, None)

    def resident(self, lora_id: int) -> LoRAAdapter | None:
        """The adapter if it is in host memory, None if not; reads nothing, and leaves the LRU order."""
        return self.adapters.get(lora_id)


def write_random_adapter(folder: str, mc: ModelConfig, rank: int, seed: int, alpha: float | None = None,
                         dtype: torch.dtype = torch.bfloat16, std: float = 0.02) -> str:
    """A PEFT adapter folder of random pairs on every projection an adapter may target (for
    benchmarks, which cannot download one, and GPU checks, where PEFT is not installed): the
    files and names PEFT's save_pretrained writes. Written once; returns the folder."""
    if os.path.isfile(os.path.join(folder, "adapter_model.safetensors")):
        return folder
    from safetensors.torch import save_file
    os.makedirs(folder, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (out_features, in_features) in projection_shapes(mc).items():
        key = f"base_model.model.model.{name}"
        tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, in_features, generator=generator) * std).to(dtype)
        tensors[f"{key}.lora_B.weight"] = (torch.randn(out_features, rank, generator=generator) * std).to(dtype)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha if alpha is not None else 2 * rank,
              "target_modules": sorted({name.rpartition(".")[2] for name in projection_shapes(mc)}),
              "bias": "none", "use_rslora": False, "use_dora": False, "task_type": "CAUSAL_LM"}
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return folder
