"""YaRN, the RoPE scaling Qwen3 takes for contexts past its 32k (Qwen's model cards: rope_type
"yarn", factor 4, original_max_position_embeddings 32768, for 131,072 tokens). Frequencies that
turn many times within the original context keep their speed, those that turn less than once are
slowed by `factor`, with a linear ramp between; cos and sin are scaled by an attention factor
(0.1 ln(factor) + 1). The formulas, and how config.json's fields are read, are transformers'
(_compute_yarn_parameters, standardize_rope_params); the longest context is vLLM's rule."""
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class YarnScaling:
    factor: float
    original_max_position_embeddings: int
    max_positions: int          # the positions it serves (max_model_len's limit)
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

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
        kept = 1 - ramp             # the share of each frequency left at its own speed (as transformers rounds it)
        return 1.0 / (self.factor * speeds) * (1 - kept) + 1.0 / speeds * kept


def rope_parameters(raw: dict) -> tuple[str, dict]:
    """The RoPE dict config.json gives, and its key, as transformers reads it: rope_scaling (the
    old name) when it has anything, else transformers 5's rope_parameters."""
    for key in ("rope_scaling", "rope_parameters"):
        value = raw.get(key)
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"config.json: {key} {value!r} is not an object")
    key = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    return key, raw.get(key) or {}


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def parse_rope_scaling(raw: dict) -> YarnScaling | None:
    """None for plain RoPE, or YaRN's parameters; any other scaling, or a YaRN field that is not
    a number in range, is refused."""
    key, params = rope_parameters(raw)
    where = f"config.json: {key} {params!r}"
    kind = params.get("rope_type", params.get("type")) or "default"
    if kind == "default":
        return None
    if kind != "yarn":
        raise ValueError(f"{where} is not supported (rope_type default or yarn)")
    max_position = raw.get("max_position_embeddings")
    original = params.get("original_max_position_embeddings", max_position)
    factor = params.get("factor")
    numbers = {name: params[name] for name in ("attention_factor", "beta_fast", "beta_slow", "mscale",
                                                "mscale_all_dim") if params.get(name) is not None}
    if "factor" not in params:      # transformers refuses it too (a null factor is its ratio rule, below)
        raise ValueError(f"{where}: YaRN needs a factor")
    if not (isinstance(original, int) and not isinstance(original, bool) and original >= 1) \
            or not (factor is None or (is_number(factor) and factor >= 1)) \
            or not all(is_number(v) and v >= 0 for v in numbers.values()):
        raise ValueError(f"{where}: YaRN needs an integer "
                         "original_max_position_embeddings >= 1, a factor >= 1 and finite numbers >= 0 for "
                         "its other fields")
    if factor is None:          # transformers' rule for a null factor: the ratio of the two lengths
        if not isinstance(max_position, int) or max_position < original:
            raise ValueError(f"{where}: YaRN without a factor needs "
                             "max_position_embeddings >= original_max_position_embeddings")
        factor, max_positions = max_position / original, max_position
    else:
        max_positions = int(original * factor)       # vLLM's max_model_len for YaRN
    # transformers takes a beta of 0 for its default (`or`), as it does a missing one.
    defaults = {"beta_fast": 32.0, "beta_slow": 1.0}
    values = {name: float(v) for name, v in numbers.items()} | \
        {name: float(numbers.get(name) or default) for name, default in defaults.items()}
    return YarnScaling(float(factor), original, max_positions, truncate=bool(params.get("truncate", True)), **values)
