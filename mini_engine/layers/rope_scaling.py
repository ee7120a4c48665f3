"""YaRN, the RoPE scaling Qwen3 takes for contexts past its 32k (Qwen's model cards: rope_type
"yarn", factor 4, original_max_position_embeddings 32768, for 131,072 tokens). Frequencies that
turn many times within the original context keep their speed, those that turn less than once are
slowed by `factor`, with a linear ramp between; cos and sin are scaled by an attention factor
(0.1 ln(factor) + 1). The formulas are transformers' (_compute_yarn_parameters) and vLLM's."""
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class YarnScaling:
    factor: float
    original_max_position_embeddings: int
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @property
    def max_positions(self) -> int:
        """The positions the scaled RoPE serves: original x factor, as vLLM derives max_model_len."""
        return int(self.original_max_position_embeddings * self.factor)

    def attention_scaling(self) -> float:
        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim)
        return mscale(self.factor)

    def inverse_frequencies(self, head_dim: int, theta: float, device=None) -> torch.Tensor:
        """RoPE's inverse frequencies (one per pair of dimensions), scaled."""
        speeds = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
        def correction_dim(rotations: float) -> float:
            # The dimension whose frequency turns `rotations` times over the original context.
            return head_dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi)) \
                / (2 * math.log(theta))
        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=device) - low)
                / (high - low if high != low else 0.001)).clamp(0, 1)
        return 1.0 / (self.factor * speeds) * ramp + 1.0 / speeds * (1 - ramp)


def parse_rope_scaling(raw: dict) -> YarnScaling | None:
    """config.json's rope_scaling, or transformers 5's rope_parameters: None for plain RoPE, or
    YaRN's parameters; anything else is refused."""
    for key in ("rope_scaling", "rope_parameters"):
        value = raw.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ValueError(f"config.json: {key} {value!r} is not an object")
        kind = value.get("rope_type", value.get("type")) or "default"
        if kind == "default":
            continue
        if kind != "yarn":
            raise ValueError(f"config.json: {key} {value!r} is not supported (rope_type default or yarn)")
        original = value.get("original_max_position_embeddings") or raw.get("max_position_embeddings")
        factor = value.get("factor")
        if factor is None and original:       # transformers' rule where factor is left out
            factor = raw.get("max_position_embeddings", 0) / original
        numbers = {name: value.get(name) for name in ("attention_factor", "beta_fast", "beta_slow", "mscale",
                                                      "mscale_all_dim") if value.get(name) is not None}
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor < 1 \
                or not isinstance(original, int) or original < 1 \
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers.values()):
            raise ValueError(f"config.json: {key} {value!r}: YaRN needs a factor >= 1, an integer "
                             "original_max_position_embeddings and numbers for its other fields")
        return YarnScaling(float(factor), original, truncate=bool(value.get("truncate", True)),
                           **{name: float(v) for name, v in numbers.items()})
    return None
