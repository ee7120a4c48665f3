"""fp8 weights: a checkpoint's `quantization_config` (Qwen3-*-FP8: quant_method "fp8", e4m3 in
128 x 128 blocks, activations quantized as they arrive), or quantization="fp8" over a bf16
checkpoint, whose projections the engine quantizes to the same blocks as it loads them. The
products are kernels/fp8_linear.py's; the layers that hold fp8 weights, layers/linear.py's."""
import re
from dataclasses import dataclass

from mini_engine.kernels.fp8_linear import BLOCK

# EngineConfig.quantization's values, as vLLM's --quantization names them.
QUANTIZATION_METHODS = ("fp8",)


@dataclass(frozen=True, slots=True)
class Fp8Config:
    """What a checkpoint's quantization_config says that this engine reads."""
    # modules_to_not_convert: the modules kept in the model's dtype (the embedding, lm_head and
    # norms always are: only the decoder's projections are ever fp8).
    modules_to_not_convert: tuple[str, ...] = ()

    def quantizes(self, module: str) -> bool:
        """Whether the checkpoint's module `module` ("model.layers.0.self_attn.q_proj") is fp8, by
        transformers' rule: a pattern matches from the start up to a module boundary, as a regex
        with the same boundary, or as a suffix."""
        boundary = r"(?:(?<=\.)|(?=\.|$))"
        return not any(re.match(rf"(?:{key}){boundary}", module) or module.endswith(key)
                       for key in self.modules_to_not_convert)


def parse_quantization_config(raw: dict | None) -> Fp8Config | None:
    """config.json's quantization_config: None where there is none; an error that says why for
    any scheme but fp8 blocks of 128 x 128 with dynamic activations."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"config.json: quantization_config must be an object, got {raw!r}")
    method = raw.get("quant_method")
    if method != "fp8":
        raise ValueError(f"config.json: quantization_config's quant_method {method!r} is not supported; "
                         f"mini_engine runs fp8 checkpoints (Qwen3-*-FP8), or quantizes a bf16 one with "
                         f"quantization='fp8'")
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
    ignored = raw.get("modules_to_not_convert") or raw.get("ignored_layers") or []
    if not isinstance(ignored, list) or not all(isinstance(name, str) for name in ignored):
        raise ValueError(f"config.json: modules_to_not_convert must be a list of names, got {ignored!r}")
    return Fp8Config(tuple(ignored))
