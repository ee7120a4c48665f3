"""Quantized weights, as a checkpoint's `quantization_config` says:
- fp8 (Qwen3-*-FP8: quant_method "fp8", e4m3 in 128 x 128 blocks, activations quantized as they
  arrive), or quantization="fp8" over a bf16 checkpoint, whose projections the engine quantizes
  to the same blocks as it loads them; the products are kernels/fp8_linear.py's;
- AWQ (Qwen3-*-AWQ: quant_method "awq", 4-bit weights with a scale and zero point for each group
  of 128 input rows, AutoAWQ's "gemm" layout); the products are kernels/awq_linear.py's;
- GPTQ (Qwen3-*-GPTQ-Int4: quant_method "gptq", AutoGPTQ's and GPTQModel's 4-bit layout), whose
  tensors are repacked into AWQ's as they load (model/gptq_repack.py), and from there run as AWQ.
The layers that hold them are layers/linear.py's."""
import re
from dataclasses import dataclass

from mini_engine.kernels.fp8_linear import BLOCK

# EngineConfig.quantization's values, as vLLM's --quantization names them.
QUANTIZATION_METHODS = ("fp8", "awq", "gptq")


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


@dataclass(frozen=True, slots=True)
class GptqConfig(AwqConfig):
    """A GPTQ checkpoint: held and run as AWQ once its tensors are repacked (model/gptq_repack.py),
    so everything that takes an AwqConfig takes this one."""
    # checkpoint_format "gptq" (v1, the default): each zero point stored less one; "gptq_v2": as is.
    zeros_stored_less_one: bool = True
    # GPTQModel's "dynamic" entries "-:regex": the modules they match (re.match, as GPTQModel and
    # vLLM match them) were left unquantized.
    unquantized_patterns: tuple[str, ...] = ()

    method = "gptq"

    def quantizes(self, module: str) -> bool:
        # the dataclass's slots make a copy of the class, which zero-argument super() does not know
        return AwqConfig.quantizes(self, module) and not any(re.match(p, module) for p in self.unquantized_patterns)


def parse_quantization_config(raw: dict | None) -> QuantizationConfig | None:
    """config.json's quantization_config: None where there is none; an error that says why for
    any scheme but fp8 blocks of 128 x 128 with dynamic activations, AutoAWQ's 4-bit "gemm" and
    GPTQ's 4-bit layout."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"config.json: quantization_config must be an object, got {raw!r}")
    method = raw.get("quant_method")
    if method == "awq":
        return parse_awq_config(raw)
    if method == "gptq":
        return parse_gptq_config(raw)
    if method != "fp8":
        raise ValueError(f"config.json: quantization_config's quant_method {method!r} is not supported; "
                         f"mini_engine runs fp8 checkpoints (Qwen3-*-FP8), AWQ ones (Qwen3-*-AWQ) and GPTQ ones "
                         f"(Qwen3-*-GPTQ-Int4), or quantizes a bf16 one with quantization='fp8'")
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
    return AwqConfig(modules_not_converted(raw), parse_group_size(group_size, "AWQ"))


def parse_gptq_config(raw: dict) -> GptqConfig:
    """AutoGPTQ's and GPTQModel's quantization_config ({"bits": 4, "group_size": 128, "desc_act":
    false, "sym": true, "checkpoint_format": "gptq"}; sym only says how the zero points were chosen,
    which are stored either way). desc_act (act-order) passes here: each module's g_idx is checked
    as it loads, and only groups of consecutive input rows in order run (model/gptq_repack.py)."""
    if raw.get("bits") != 4:
        raise ValueError(f"config.json: GPTQ with {raw.get('bits')!r} bits is not supported (4 is)")
    checkpoint_format = raw.get("checkpoint_format") or "gptq"
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"config.json: GPTQ checkpoint_format {checkpoint_format!r} is not supported ('gptq' "
                         f"and 'gptq_v2' are)")
    for flag in ("sym", "desc_act", "lm_head"):
        if not isinstance(raw.get(flag, False), bool):
            raise ValueError(f"config.json: GPTQ's {flag} must be true or false, got {raw[flag]!r}")
    if raw.get("lm_head"):
        raise ValueError("config.json: GPTQ with a quantized lm_head (lm_head true) is not supported: only the "
                         "decoder's projections are")
    if raw.get("pack_dtype", "int32") != "int32":
        raise ValueError(f"config.json: GPTQ pack_dtype {raw['pack_dtype']!r} is not supported (int32 is)")
    return GptqConfig(modules_not_converted(raw), parse_group_size(raw.get("group_size", 128), "GPTQ"),
                      zeros_stored_less_one=checkpoint_format == "gptq",
                      unquantized_patterns=unquantized_patterns(raw.get("dynamic")))


def parse_group_size(group_size, method: str) -> int:
    """The input rows that share a scale and zero point: 0 for config.json's -1 (the whole input)."""
    if not isinstance(group_size, int) or isinstance(group_size, bool) or not (group_size == -1 or group_size >= 16
                                                                               and group_size % 16 == 0):
        raise ValueError(f"config.json: {method} group_size must be -1 (the whole input) or a multiple of 16, "
                         f"got {group_size!r}")
    return max(group_size, 0)


def unquantized_patterns(dynamic) -> tuple[str, ...]:
    """GPTQModel's per-module overrides, {regex: {field: value}}: a "-:" regex names modules left
    unquantized; any other entry ("+:" or bare) changes bits, group_size or desc_act for the
    modules it matches, which this engine does not read (one layout for every projection)."""
    if dynamic is None:
        return ()
    if not isinstance(dynamic, dict):
        raise ValueError(f"config.json: GPTQ's dynamic must be an object of regex -> overrides, got {dynamic!r}")
    overrides = [key for key in dynamic if not key.startswith("-:")]
    if overrides:
        raise ValueError(f"config.json: GPTQ's dynamic overrides {overrides} change the quantization of the modules "
                         f"they match, which is not supported: mini_engine reads one bits and group_size for every "
                         f"projection, and takes only '-:' entries (modules left unquantized)")
    patterns = tuple(key.removeprefix("-:") for key in dynamic)
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"config.json: GPTQ's dynamic entry {'-:' + pattern!r} is not a regex ({e})") from None
    return patterns


def modules_not_converted(raw: dict) -> tuple[str, ...]:
    ignored = raw.get("modules_to_not_convert") or raw.get("ignored_layers") or []
    if not isinstance(ignored, list) or not all(isinstance(name, str) for name in ignored):
        raise ValueError(f"config.json: modules_to_not_convert must be a list of names, got {ignored!r}")
    return tuple(ignored)
