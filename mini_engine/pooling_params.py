"""Embeddings: what a request asks for (vLLM's PoolingParams), and how an engine started with
runner="pooling" turns a prompt's final hidden states into one vector (vLLM's PoolerConfig, read from
a Sentence Transformers checkpoint's modules.json as vLLM reads it).

Qwen3-Embedding is Qwen3 with no lm_head: its embedding is the final hidden state (after the
last RMSNorm) of the prompt's last token, which its tokenizer makes <|endoftext|>, L2-normalised.
MEAN averages every prompt token's hidden state instead."""
import dataclasses
import json
import os
from dataclasses import dataclass

from mini_engine.json_files import read_json_file

# CLS, the first token's state, is left out: on a causal decoder it has seen nothing but itself.
POOLING_TYPES = ("LAST", "MEAN")

# Sentence Transformers' pooling modes (1_Pooling/config.json) that have a pooling type here.
SENTENCE_TRANSFORMERS_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN"}


@dataclass(slots=True)
class PoolingParams:
    """dimensions: a Matryoshka model's embedding cut to its first `dimensions` values (before it
    is normalised), as OpenAI's `dimensions`; only for a checkpoint trained for it (config.json's
    is_matryoshka or matryoshka_dimensions). normalize: L2-normalise the vector; None, as the
    engine's pooler config says. truncate_prompt_tokens: embed only the prompt's last k tokens
    (-1: the last max_model_len), where a longer prompt is otherwise refused."""
    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self):
        if self.dimensions is not None and (not _is_int(self.dimensions) or self.dimensions < 1):
            raise ValueError(f"dimensions must be an integer >= 1, got {self.dimensions!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true, false or None, got {self.normalize!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or (k < 1 and k != -1)):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1, or -1 (max_model_len), got {k!r}")


def truncate_prompt(prompt_token_ids: list[int], params: PoolingParams, max_model_len: int) -> list[int]:
    """The prompt's last params.truncate_prompt_tokens tokens (-1: the last max_model_len), as vLLM
    truncates an embedding request's prompt (from the left); the prompt as it is without it."""
    k = params.truncate_prompt_tokens
    if k is None:
        return prompt_token_ids
    return prompt_token_ids[-(max_model_len if k == -1 else k):]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """How the engine pools: which hidden states (pooling_type, one of POOLING_TYPES) and whether a
    request that leaves `normalize` unset gets an L2-normalised vector. classifier_token_ids: a
    cross-encoder's (ModelConfig.classifier_from_token, as token ids): it scores its prompt, a query
    and a document together, by the softmax of those tokens' logits at the last token (LAST)."""
    pooling_type: str = "LAST"
    normalize: bool = True
    classifier_token_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}"
                             + (" (the first token of a causal decoder has seen only itself)"
                                if self.pooling_type == "CLS" else ""))
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")
        if self.classifier_token_ids is not None and self.pooling_type != "LAST":
            raise ValueError(f"a cross-encoder (classifier_from_token) scores the last token: pooling_type "
                             f"{self.pooling_type!r} does not apply")

    @property
    def is_cross_encoder(self) -> bool:
        return self.classifier_token_ids is not None

    @classmethod
    def resolve(cls, folder: str, given: "PoolerConfig | dict | None",
                classifier_from_token: tuple[str, ...] | None = None) -> "PoolerConfig":
        """The engine's pooler: the fields `given` sets (EngineConfig.pooler_config, vLLM's
        --pooler-config), then the checkpoint's Sentence Transformers modules, then embed's
        defaults, LAST and normalised (vLLM's for a causal LM run as an embedding model); a
        cross-encoder's classifier tokens as the checkpoint's tokenizer numbers them."""
        if classifier_from_token:
            given = (dataclasses.asdict(given) if isinstance(given, PoolerConfig) else dict(given or {})) | {
                "classifier_token_ids": classifier_token_ids(folder, classifier_from_token)}
        if isinstance(given, PoolerConfig):
            return given
        if given is not None and not isinstance(given, dict):
            raise ValueError(f"pooler_config must be a dict of pooling_type and normalize, got {given!r}")
        unknown = set(given or {}) - {"pooling_type", "normalize", "classifier_token_ids"}
        if unknown:
            raise ValueError(f"pooler_config: unknown fields {sorted(unknown)} (it takes pooling_type and normalize)")
        given = dict(given or {})
        if isinstance(given.get("pooling_type"), str):
            given["pooling_type"] = given["pooling_type"].upper()      # vLLM's names are upper case
        try:
            cls(**given)                        # its own fields first, so that an error names the right source
        except ValueError as e:
            raise ValueError(f"pooler_config: {e}") from None
        try:
            return cls(**(sentence_transformers_pooling(folder) | given))
        except ValueError as e:
            raise ValueError(f"{folder}/modules.json's Pooling module: {e}") from None


def classifier_token_ids(folder: str, tokens: tuple[str, ...]) -> tuple[int, ...]:
    """classifier_from_token's token strings (vLLM's: ["no", "yes"] for Qwen3-Reranker) as ids of
    the checkpoint's vocabulary: two, each one token."""
    from mini_engine.tokenizer import load_tokenizer
    if len(tokens) != 2:
        raise ValueError(f"classifier_from_token must name two tokens (the score is the second's probability "
                         f"against the first's), got {list(tokens)}")
    tokenizer = load_tokenizer(folder)
    if tokenizer is None:
        raise ValueError("classifier_from_token needs the checkpoint's tokenizer.json, which it does not have")
    ids = tuple(tokenizer.token_to_id(t) for t in tokens)
    if None in ids:
        raise ValueError(f"classifier_from_token: {[t for t, i in zip(tokens, ids) if i is None]} is not one token "
                         "of the vocabulary")
    return ids


def sentence_transformers_pooling(folder: str) -> dict:
    """pooling_type and normalize as a Sentence Transformers checkpoint's modules.json gives them
    (its Pooling module's config.json and whether a Normalize module follows), or {} without one."""
    modules_file = os.path.join(folder, "modules.json")
    modules = read_json_file(modules_file, list, "a list of modules")
    if modules is None:
        return {}
    types = [str(m.get("type", "")) for m in modules if isinstance(m, dict)]
    fields = {"normalize": any(t.endswith(".Normalize") for t in types)}
    for module in modules:
        if isinstance(module, dict) and str(module.get("type", "")).endswith(".Pooling"):
            config_file = os.path.join(folder, str(module.get("path", "")), "config.json")
            if not os.path.isfile(config_file):
                raise ValueError(f"{modules_file}: its Pooling module has no {config_file}")
            with open(config_file) as f:
                modes = [mode for mode, on in json.load(f).items() if mode.startswith("pooling_mode_") and on]
            # A mode with no pooling type here stays as it is named, for PoolerConfig to refuse.
            fields["pooling_type"] = "+".join(SENTENCE_TRANSFORMERS_MODES.get(mode, mode) for mode in modes)
    return fields
