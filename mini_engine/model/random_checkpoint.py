"""Writes a randomly initialised Qwen3 checkpoint in Hugging Face's layout (config.json and
model.safetensors), for benchmarks and tests: no weights can be downloaded here, and neither
throughput nor the engine's agreement with transformers depends on the weights' values."""
import json
import os
import re
import shutil

import torch
from safetensors.torch import save_file

from mini_engine.config import ModelConfig
from mini_engine.kernels.awq_linear import quantize_awq_ref
from mini_engine.kernels.fp8_linear import BLOCK, quantize_fp8_weight_ref
from mini_engine.quantization import QuantizationConfig

# Qwen3-0.6B's config.json, as published.
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
    "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None,
    "tie_word_embeddings": True, "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
}

# Qwen3-8B's config.json, as published: where a decode step's time is the weights' (16 GB in bf16)
# more than the KV cache's, the case fp8 weights are for.
QWEN3_8B = QWEN3_0_6B | {
    "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
    "num_key_value_heads": 8, "tie_word_embeddings": False,
}

# Qwen3-30B-A3B's config.json, as published: 48 layers, each a mixture of 128 experts of which a
# token takes 8 (3.3B of its 30.5B parameters a token).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None,
    "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0,
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [],
    "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
}


def qwen3_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    shape = ModelConfig.from_dict(config)            # head_dim and KV heads as transformers reads them
    h, i, v = shape.hidden_size, shape.intermediate_size, shape.vocab_size
    d, hq, hkv = shape.head_dim, shape.num_attention_heads, shape.num_key_value_heads
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (v, h)
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes |= {
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (hq * d, h), p + "self_attn.k_proj.weight": (hkv * d, h),
            p + "self_attn.v_proj.weight": (hkv * d, h), p + "self_attn.o_proj.weight": (h, hq * d),
            p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
        }
        if shape.is_sparse_layer(layer):        # Qwen3-MoE: the router and each expert's projections
            mi = shape.moe_intermediate_size
            shapes[p + "mlp.gate.weight"] = (shape.num_experts, h)
            for e in range(shape.num_experts):
                q = f"{p}mlp.experts.{e}."
                shapes |= {q + "gate_proj.weight": (mi, h), q + "up_proj.weight": (mi, h), q + "down_proj.weight": (h, mi)}
        else:
            shapes |= {p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i)}
        if config.get("attention_bias", False):
            shapes |= {p + "self_attn.q_proj.bias": (hq * d,), p + "self_attn.k_proj.bias": (hkv * d,),
                       p + "self_attn.v_proj.bias": (hkv * d,), p + "self_attn.o_proj.bias": (h,)}
    return shapes


def write_random_checkpoint(path: str, config: dict, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                            device: str = "cpu", std: float = 0.02) -> str:
    """Norm weights near 1, everything else N(0, std): activations stay in a sane range. Tests
    use a larger std so that a tiny model's greedy outputs vary instead of repeating one token."""
    os.makedirs(path, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, shape in qwen3_tensor_shapes(config).items():
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen, device=device)
        else:
            t = std * torch.randn(shape, generator=gen, device=device)
        tensors[name] = t.to(dtype).cpu().contiguous()
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config | {"torch_dtype": str(dtype).removeprefix("torch.")}, f, indent=2)
    return path


def written_once(path: str, write) -> str:
    """path, which write(folder) makes: written once into a folder of this process's own and moved
    into place whole, so that a reader never sees half a checkpoint and a second writer's copy
    never replaces the first's (each process that finds none writes its own, the first one stays)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        tmp = f"{path}.partial-{os.getpid()}"
        write(tmp)
        if not os.path.exists(path):
            os.replace(tmp, path)
    return path


def cached_checkpoint(name: str, config: dict, cache_dir: str | None = None, device: str = "cpu") -> str:
    """A random bf16 checkpoint of `config`'s shape, written once to cache_dir/name and reused."""
    cache_dir = cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "mini_engine")
    return written_once(os.path.join(cache_dir, name),
                        lambda folder: write_random_checkpoint(folder, config, device=device))


def default_checkpoint(cache_dir: str | None = None, device: str = "cpu") -> str:
    """The embedded default: Qwen3-0.6B's shape with random bf16 weights."""
    return cached_checkpoint("qwen3-0.6b-random", QWEN3_0_6B, cache_dir, device)


def first_layers_checkpoint(name: str, config: dict, num_layers: int, cache_dir: str | None, device: str) -> str:
    """A random bf16 checkpoint of config's shape cut to its first num_layers layers, cached as
    name-<num_layers>-layers-random."""
    if not 1 <= num_layers <= config["num_hidden_layers"]:
        raise ValueError(f"num_layers must be in [1, {config['num_hidden_layers']}], got {num_layers}")
    return cached_checkpoint(f"{name}-{num_layers}-layers-random", config | {"num_hidden_layers": num_layers},
                             cache_dir, device)


def dense_8b_checkpoint(num_layers: int, cache_dir: str | None = None, device: str = "cpu") -> str:
    """Qwen3-8B's shape cut to num_layers of its 36 layers (0.4 GB of bf16 a layer, 2.5 GB of
    embedding and lm_head), with random bf16 weights."""
    return first_layers_checkpoint("qwen3-8b", QWEN3_8B, num_layers, cache_dir, device)


def moe_checkpoint(num_layers: int, cache_dir: str | None = None, device: str = "cpu") -> str:
    """Qwen3-30B-A3B's shape cut to num_layers of its 48 layers (1.2 GB of bf16 experts a layer,
    61 GB in all at 48), with random bf16 weights."""
    return first_layers_checkpoint("qwen3-30b-a3b", QWEN3_30B_A3B, num_layers, cache_dir, device)


def write_embedding_layout(source: str, path: str) -> str:
    """source's checkpoint as Qwen3-Embedding lays itself out (saved from transformers' Qwen3Model):
    its tensors without the "model." prefix and without lm_head, beside source's other files."""
    from safetensors.torch import load_file
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(source):
        if name != "model.safetensors" and os.path.isfile(os.path.join(source, name)):
            shutil.copy(os.path.join(source, name), path)
    tensors = load_file(os.path.join(source, "model.safetensors"))
    save_file({name.removeprefix("model."): t for name, t in tensors.items() if name != "lm_head.weight"},
              os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


# A decoder projection's weight, which a quantized checkpoint stores quantized: attention's, a
# dense MLP's, and a Qwen3-MoE layer's experts' (mlp.experts.{e}.gate_proj; not its router, mlp.gate).
PROJECTION_WEIGHT = re.compile(r"(model\.layers\.\d+\.(?:self_attn\.[qkvo]|mlp\.(?:experts\.\d+\.)?(?:gate|up|down))"
                               r"_proj)\.weight")


def write_quantized_layout(source: str, path: str, quantize, modules_to_not_convert: list[str] | None,
                           quantization_config: dict) -> str:
    """source's checkpoint with each decoder projection's weight replaced by quantize(module name,
    weight) -> {tensor name: tensor} (those of the modules in modules_to_not_convert, by
    transformers' rule, left as they are), and config.json's quantization_config."""
    from safetensors.torch import load_file
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    kept = QuantizationConfig(tuple(modules_to_not_convert or ()))
    tensors = {}
    for name, t in load_file(os.path.join(source, "model.safetensors")).items():
        projection = PROJECTION_WEIGHT.fullmatch(name)
        if projection and kept.quantizes(projection[1]):
            tensors |= quantize(projection[1], t)
        else:
            tensors[name] = t
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = quantization_config | {"modules_to_not_convert": modules_to_not_convert}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path


def write_fp8_layout(source: str, path: str, modules_to_not_convert: list[str] | None = None,
                     scale_dtype: torch.dtype = torch.float32) -> str:
    """source's checkpoint as Qwen3-*-FP8 (and Qwen3-30B-A3B-FP8) lays itself out: each decoder
    projection's weight, each expert's too, in float8_e4m3fn, 128 x 128 blocks, with its scales as
    `weight_scale_inv` (those of the modules in modules_to_not_convert left as they are), and
    config.json's quantization_config. (Qwen3-30B-A3B-FP8 lists each layer's router, mlp.gate, in
    modules_to_not_convert; it is never quantized here either way.)"""
    def quantize(module: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scales = quantize_fp8_weight_ref(weight)
        return {f"{module}.weight": q, f"{module}.weight_scale_inv": scales.to(scale_dtype)}
    return write_quantized_layout(source, path, quantize, modules_to_not_convert,
                                  {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                   "weight_block_size": [BLOCK, BLOCK]})


def write_awq_layout(source: str, path: str, group_size: int = 128,
                     modules_to_not_convert: list[str] | None = None, device: str = "cpu") -> str:
    """source's checkpoint as Qwen3-*-AWQ lays itself out: each decoder projection's weight as
    AutoAWQ's "gemm" tensors (qweight, qzeros, scales: kernels/awq_linear.py), rounded to 4 bits
    in groups of group_size input rows (-1: the whole input), the other tensors (and the modules
    in modules_to_not_convert) as they are, and config.json's quantization_config. The rounding
    is to nearest, without AWQ's calibrated scale search: the layout, and so what the engine
    reads, is the same. device: where the rounding is done."""
    def quantize(module: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        tensors = quantize_awq_ref(weight.to(device), group_size if group_size > 0 else weight.shape[1])
        return {f"{module}.{name}": t.cpu() for name, t in zip(("qweight", "qzeros", "scales"), tensors)}
    return write_quantized_layout(source, path, quantize, modules_to_not_convert,
                                  {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                                   "version": "gemm"})


def quantize_gptq_ref(weight: torch.Tensor, group_size: int, sym: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [N, K] -> (q [K, N], zeros [K/group, N], scales [K/group, N] fp16), rounded to nearest as
    GPTQ's Quantizer rounds (its find_params: the range widened to hold 0; sym, a range symmetric
    about 0 and zero point 8), without GPTQ's error feedback, which needs calibration data: the
    layout is the same."""
    n, k = weight.shape
    groups = weight.float().t().reshape(k // group_size, group_size, n)
    low, high = groups.amin(dim=1).clamp(max=0), groups.amax(dim=1).clamp(min=0)
    if sym:
        high = torch.maximum(-low, high)
        low = torch.where(low < 0, -high, low)
    scales = ((high - low).clamp(min=1e-5) / 15).half()
    zeros = torch.full_like(low, 8) if sym else torch.round(-low / scales.float())
    q = (torch.round(groups / scales.float()[:, None]) + zeros[:, None]).clamp(0, 15)
    return q.reshape(k, n).long(), zeros.long(), scales


def pack_plain_nibbles(values: torch.Tensor, dim: int) -> torch.Tensor:
    """values 0..15 -> int64 words of eight along `dim`, values 8i .. 8i + 7 in word i's nibbles
    0 .. 7: GPTQ's order, for qweight's rows and qzeros' columns alike."""
    values = values.long().movedim(dim, -1)
    return sum(values[..., j::8] << (4 * j) for j in range(8)).movedim(-1, dim).contiguous()


def int32_words(words: torch.Tensor) -> torch.Tensor:
    """int64 words, modulo 2^32, as the int32s with the same bits."""
    words = words % (1 << 32)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def gptq_tensors(weight: torch.Tensor, group_size: int, sym: bool, zeros_less_one: bool) -> dict[str, torch.Tensor]:
    """W [N, K] as GPTQ stores it (model/gptq_repack.py): qweight, qzeros, scales, g_idx (the rows in
    order). zeros_less_one (checkpoint_format "gptq", v1): each int32 word of zero points less
    0x11111111, as GPTQModel writes v1 (convert_gptq_v2_to_v1_format_module)."""
    q, zeros, scales = quantize_gptq_ref(weight, group_size, sym)
    qzeros = pack_plain_nibbles(zeros, 1) - (0x11111111 if zeros_less_one else 0)
    g_idx = torch.arange(weight.shape[1], device=weight.device) // group_size
    return {"qweight": int32_words(pack_plain_nibbles(q, 0)), "qzeros": int32_words(qzeros), "scales": scales,
            "g_idx": g_idx.to(torch.int32)}


def write_gptq_layout(source: str, path: str, group_size: int = 128, sym: bool = True, checkpoint_format: str = "gptq",
                      desc_act: bool = False, modules_to_not_convert: list[str] | None = None,
                      device: str = "cpu") -> str:
    """source's checkpoint as AutoGPTQ and GPTQModel lay one out (Qwen3-*-GPTQ-Int4, quant_method
    "gptq"): each decoder projection's weight as qweight, qzeros, scales and g_idx (gptq_tensors),
    in groups of group_size input rows (-1: the whole input), the zero points stored as
    checkpoint_format says ("gptq": v1, "gptq_v2"); the other tensors (and the modules in
    modules_to_not_convert) as they are. desc_act goes into config.json only: the rows stay in
    order, as GPTQ's act-order with static groups leaves them. device: where the rounding is done."""
    def quantize(module: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        tensors = gptq_tensors(weight.to(device), group_size if group_size > 0 else weight.shape[1], sym,
                               checkpoint_format == "gptq")
        return {f"{module}.{name}": t.cpu() for name, t in tensors.items()}
    return write_quantized_layout(source, path, quantize, modules_to_not_convert,
                                  {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act,
                                   "sym": sym, "lm_head": False, "checkpoint_format": checkpoint_format})
