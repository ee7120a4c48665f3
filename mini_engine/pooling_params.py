"""Embeddings and classifications: what a request asks for (vLLM's PoolingParams), and how an
engine started with runner="pooling" turns a prompt's final hidden states into one vector (vLLM's
PoolerConfig, read from a Sentence Transformers checkpoint's modules.json as vLLM reads it).

Qwen3-Embedding is Qwen3 with no lm_head: its embedding is the final hidden state (after the
last RMSNorm) of the prompt's last token, which its tokenizer makes <|endoftext|>, L2-normalised.
MEAN averages every prompt token's hidden state instead. A sequence classifier
(Qwen3ForSequenceClassification: fine-tuned classifiers, reward models) puts that state through its
score head and gives the logits' activation (CLASSIFIER_ACTIVATIONS)."""
import dataclasses
import json
import os
from dataclasses import dataclass

from mini_engine.json_files import read_json_file

# CLS, the first token's state, is left out: on a causal decoder it has seen nothing but itself.
POOLING_TYPES = ("LAST", "MEAN")

# Sentence Transformers' pooling modes (1_Pooling/config.json) that have a pooling type here.
SENTENCE_TRANSFORMERS_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN"}

# What a sequence classifier's logits go through (vLLM's PoolerClassify, PoolerMultiLabelClassify and
# PoolerIdentity): softmax over the labels, a sigmoid of each, or nothing.
CLASSIFIER_ACTIVATIONS = ("softmax", "sigmoid", "identity")

# transformers' problem_type values (config.json), which set a classifier's loss and so its activation.
PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")


def classifier_activation(num_labels: int, problem_type: str | None) -> str:
    """vLLM's rule (get_classification_act_fn, after transformers' ForSequenceClassificationLoss):
    a regression's logits as they are, a multi-label problem's each through a sigmoid; otherwise a
    softmax over the labels, or a sigmoid where there is one label (a reward model, a cross-encoder)."""
    if problem_type == "regression":
        return "identity"
    if problem_type == "multi_label_classification" or num_labels < 2:
        return "sigmoid"
    return "softmax"


@dataclass(slots=True)
class PoolingParams:
    """dimensions: a Matryoshka model's embedding cut to its first `dimensions` values (before it
    is normalised), as OpenAI's `dimensions`; only for a checkpoint trained for it (config.json's
    is_matryoshka or matryoshka_dimensions). normalize: L2-normalise the vector; None, as the
    engine's pooler config says. truncate_prompt_tokens: embed only the prompt's last k tokens
    (-1: the last max_model_len), where a longer prompt is otherwise refused. use_activation (vLLM's,
    for a sequence classifier): its logits through the activation (softmax, or sigmoid for one
    label); False: the raw logits; None, as the engine's pooler config says (True unless told)."""
    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None

    def __post_init__(self):
        if self.dimensions is not None and (not _is_int(self.dimensions) or self.dimensions < 1):
            raise ValueError(f"dimensions must be an integer >= 1, got {self.dimensions!r}")
        for name in ("normalize", "use_activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be true, false or None, got {value!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or (k < 1 and k != -1)):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1, or -1 (max_model_len), got {k!r}")


# The parameters each kind of pooling model takes, besides truncate_prompt_tokens (vLLM's
# PoolingParams.valid_parameters: an embedding's for "embed", a classifier's for "classify").
TASK_PARAMETERS = {"embed": ("dimensions", "normalize"), "classify": ("use_activation",)}


# vLLM's per-token pooling tasks (vllm/tasks.py): every position's output, where this engine pools
# one output per prompt.
PER_TOKEN_TASKS = ("token_embed", "token_classify")


def check_task_parameters(params: PoolingParams, task: str, pooler: "PoolerConfig | None" = None) -> None:
    """A ValueError for a parameter that `task` ignores (as vLLM refuses it): a classifier's
    request that asks for normalize or dimensions, an embedding's that asks for use_activation;
    and a cross-encoder's that asks for raw logits, as its pooled output is its tokens' probabilities."""
    ignored = [name for names in TASK_PARAMETERS.values() for name in names
               if name not in TASK_PARAMETERS[task] and getattr(params, name) is not None]
    if ignored:
        raise ValueError(f"{ignored[0]} does not apply to {task}: it takes {list(TASK_PARAMETERS[task])} "
                         "and truncate_prompt_tokens")
    if pooler is not None and pooler.is_cross_encoder and params.use_activation is False:
        raise ValueError("use_activation=False: a cross-encoder (classifier_from_token) gives its score as a "
                         "probability only")


def resolve_pooling_task(task: str | None, pooler: "PoolerConfig") -> str:
    """The task a generic pooling call (LLM.encode, the server's /pooling) runs: the one given, or
    the model's own (pooler.tasks[0], as vLLM's ModelConfig.get_pooling_task picks it). A
    ValueError, saying what the model does, for a task it cannot do."""
    if task is None or task in pooler.tasks:
        return pooler.tasks[0] if task is None else task
    if task in PER_TOKEN_TASKS and task.removeprefix("token_") in pooler.tasks:
        raise ValueError(f"pooling_task {task!r} asks for every token's output, and this engine pools one output "
                         f"a prompt: use {pooler.tasks[0]!r}"
                         + (" (a reward model's raw score: LLM.reward, or use_activation=False)"
                            if pooler.is_classifier else ""))
    if task in TASK_PARAMETERS or task in PER_TOKEN_TASKS:
        raise ValueError(f"pooling_task {task!r} is not one this model does: it is {pooler.kind}, whose task is "
                         f"{pooler.tasks[0]!r}")
    raise ValueError(f"unknown pooling_task {task!r}: this model ({pooler.kind}) runs {pooler.tasks[0]!r}")


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
    and a document together, by the softmax of those tokens' logits at the last token (LAST).
    activation: a sequence classifier's (ModelConfig.num_labels > 0), one of CLASSIFIER_ACTIVATIONS,
    which config.json's num_labels and problem_type set; use_activation: whether a request that
    leaves its own unset gets it (vLLM's pooler_config use_activation; False: raw logits, as a
    reward server may want)."""
    pooling_type: str = "LAST"
    normalize: bool = True
    classifier_token_ids: tuple[int, ...] | None = None
    activation: str | None = None
    use_activation: bool = True

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
        if self.activation not in (None, *CLASSIFIER_ACTIVATIONS):
            raise ValueError(f"activation must be one of {CLASSIFIER_ACTIVATIONS} or None, got {self.activation!r}")
        if not isinstance(self.use_activation, bool):
            raise ValueError(f"use_activation must be true or false, got {self.use_activation!r}")
        if self.activation is not None and self.classifier_token_ids is not None:
            raise ValueError("a sequence classifier (its own score head) takes no classifier_from_token")

    @property
    def is_cross_encoder(self) -> bool:
        """A generative model read as a cross-encoder (classifier_from_token: Qwen3-Reranker)."""
        return self.classifier_token_ids is not None

    @property
    def is_classifier(self) -> bool:
        """A sequence classifier (Qwen3ForSequenceClassification): its score head's logits."""
        return self.activation is not None

    @property
    def tasks(self) -> tuple[str, ...]:
        """The pooling tasks (vLLM's names) this pooler answers, the model's own first: a
        classifier's and a cross-encoder's "classify" (vLLM converts Qwen3-Reranker to a
        classifier of one label), an embedding model's "embed"."""
        return ("classify",) if self.is_classifier or self.is_cross_encoder else ("embed",)

    @property
    def kind(self) -> str:
        """What the model is, in a few words, for errors."""
        return ("a sequence classifier" if self.is_classifier else
                "a cross-encoder (classifier_from_token)" if self.is_cross_encoder else "an embedding model")

    @classmethod
    def resolve(cls, folder: str, given: "PoolerConfig | dict | None",
                classifier_from_token: tuple[str, ...] | None = None,
                activation: str | None = None, tokenizer_folder: str | None = None) -> "PoolerConfig":
        """The engine's pooler: the fields `given` sets (EngineConfig.pooler_config, vLLM's
        --pooler-config), then the checkpoint's Sentence Transformers modules, then embed's
        defaults, LAST and normalised (vLLM's for a causal LM run as an embedding model); a
        cross-encoder's classifier tokens as the checkpoint's tokenizer numbers them; a sequence
        classifier's activation (classifier_activation), LAST by default as transformers pools it.
        tokenizer_folder: where that tokenizer is (EngineConfig.tokenizer_path; default folder)."""
        if classifier_from_token:
            given = (dataclasses.asdict(given) if isinstance(given, PoolerConfig) else dict(given or {})) | {
                "classifier_token_ids": classifier_token_ids(tokenizer_folder or folder, classifier_from_token)}
        if isinstance(given, PoolerConfig):
            return dataclasses.replace(given, activation=activation)     # whether it classifies is the checkpoint's
        if given is not None and not isinstance(given, dict):
            raise ValueError(f"pooler_config must be a dict of pooling_type and normalize, got {given!r}")
        unknown = set(given or {}) - {"pooling_type", "normalize", "classifier_token_ids", "use_activation"}
        if unknown:
            raise ValueError(f"pooler_config: unknown fields {sorted(unknown)} (it takes pooling_type, normalize and, "
                             "for a sequence classifier, use_activation)")
        given = dict(given or {})
        if activation is not None and "normalize" in given:
            raise ValueError("pooler_config: normalize is for an embedding model; a sequence classifier's outputs "
                             "take use_activation")
        if activation is None and "use_activation" in given:
            raise ValueError("pooler_config: use_activation is for a sequence classifier "
                             "(Qwen3ForSequenceClassification)")
        if isinstance(given.get("pooling_type"), str):
            given["pooling_type"] = given["pooling_type"].upper()      # vLLM's names are upper case
        if activation is not None:
            given["activation"] = activation
        try:
            config = cls(**given)               # its own fields first, so that an error names the right source
        except ValueError as e:
            raise ValueError(f"pooler_config: {e}") from None
        if activation is not None:
            return config       # a classifier pools as transformers does (its last token), whatever modules.json says
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
