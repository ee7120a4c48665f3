"""Quantized weights, as a checkpoint's `quantization_config` says:
- fp8 (Qwen3-*-FP8: quant_method "fp8", e4m3 in 128 x 128 blocks, activations quantized as they
  arrive), or quantization="fp8" over a bf16 checkpoint, whose projections the engine quantizes
  to the same blocks as it loads them; the products are kernels/fp8_linear.py's;
- AWQ (Qwen3-*-AWQ: quant_method "awq", 4-bit weights with a scale and zero point for each group
  of 128 input rows, AutoAWQ's "gemm" layout); the products are kernels/awq_linear.py's.
The layers that hold them are layers/linear.py's."""
import re
from dataclasses import dataclass

from mini_engine.kernels.fp8_linear import BLOCK

# EngineConfig.quantization's values, as vLLM's --quantization names them.
QUANTIZATION_METHODS = ("fp8", "awq")


@dataclass(frozen=True, slots=True)
class QuantizationConfig:
    """What a checkpoint's quantization_config says that this engine reads."""
    # modules_to_not_convert: the modules kept in the model's dtype (the embedding, lm_head and
    # norms always are: only the decoder's projections are ever quantized).
    modules_to_not_convert: tuple[str, ...] = ()

    method = ""

    def quantizes(self, module: str) -> bool:
        """Whether the checkpoint's module `module` ("model.layers.0.self_attn.q_proj") is
        quantized, by transformers' rule: a pattern matches from the start up to a module
        boundary, as a regex with the same boundary, or as a suffix."""
        boundary = r"(?:(?<=\.)|(?=\.|$))"
        return not any(re.match(rf"(?:{key}){boundary}", module) or module.endswith(key)
                       for key in self.modules_to_not_convert)


@dataclass(frozen=True, slots=True)
class Fp8Config(QuantizationConfig):
    method = "fp8"


@dataclass(frozen=True, slots=True)
class AwqConfig(QuantizationConfig):
    # The input rows that share a scale and a zero point (the whole input where the checkpoint
    # says -1: group_size 0 here, resolved by each layer).
    group_size: int = 128

    method = "awq"


def parse_quantization_config(raw: dict | None) -> QuantizationConfig | None:
    """config.json's quantization_config: None where there is none; an error that says why for
    any scheme but fp8 blocks of 128 x 128 with dynamic activations and AutoAWQ's 4-bit "gemm"."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"config.json: quantization_config must be an object, got {raw!r}")
    method = raw.get("quant_method")
    if method == "awq":
        return parse_awq_config(raw)
    if method != "fp8":
        raise ValueError(f"config.json: quantization_config's quant_method {method!r} is not supported; "
                         f"mini_engine runs fp8 checkpoints (Qwen3-*-FP8) and AWQ ones (Qwen3-*-AWQ), or "
                         f"quantizes a bf16 one with quantization='fp8'")
    if raw.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"config.json: fp8 format {raw['fmt']!r} is not supported (e4m3 is)")
    if raw.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"config.json: activation_scheme {raw['activation_scheme']!r} is not supported: the "
                         "activations are quantized as they arrive ('dynamic')")
    if raw.get("scale_fmt", "float") != "float":
        raise ValueError(f"config.json: scale_fmt {raw['scale_fmt']!r} is not supported (fp32 scales are)")
    if raw.get("weight_block_size") != [BLOCK, BLOCK]:
        raise ValueError(f"config.json: fp8 weight_block_size {raw.get('weight_block_size')!r} is not supported: "
                         f"mini_engine reads weights quantized in {BLOCK} x {BLOCK} blocks")
    return Fp8Config(modules_not_converted(raw))


def parse_awq_config(raw: dict) -> AwqConfig:
    """AutoAWQ's quantization_config ({"bits": 4, "group_size": 128, "zero_point": true, "version":
    "gemm"} in Qwen3-*-AWQ); other widths and layouts are refused by name."""
    if raw.get("bits", raw.get("w_bit")) != 4:
        raise ValueError(f"config.json: AWQ with {raw.get('bits', raw.get('w_bit'))!r} bits is not supported (4 is)")
    if not raw.get("zero_point", True):
        raise ValueError("config.json: AWQ without zero points (zero_point false) is not supported")
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"config.json: AWQ version {raw['version']!r} is not supported: mini_engine reads "
                         f"AutoAWQ's 'gemm' layout (Qwen3-*-AWQ's)")
    group_size = raw.get("group_size", raw.get("q_group_size", 128))
    if not isinstance(group_size, int) or isinstance(group_size, bool) or not (group_size == -1 or group_size >= 16
                                                                               and group_size % 16 == 0):
        raise ValueError(f"config.json: AWQ group_size must be -1 (the whole input) or a multiple of 16, "
                         f"got {group_size!r}")
    return AwqConfig(modules_not_converted(raw), max(group_size, 0))


def modules_not_converted(raw: dict) -> tuple[str, ...]:
    ignored = raw.get("modules_to_not_convert") or raw.get("ignored_layers") or []
    if not isinstance(ignored, list) or not all(isinstance(name, str) for name in ignored):
        raise ValueError(f"config.json: modules_to_not_convert must be a list of names, got {ignored!r}")
    return tuple(ignored)
