"""Configuration: the model's shape (read from config.json) and the engine's knobs."""
import math
import numbers
import os
from dataclasses import dataclass, field, fields, replace

import torch

from mini_engine.compilation_config import CompilationConfig
from mini_engine.distributed import check_divisible
from mini_engine.json_files import read_json_file
from mini_engine.kernels.fp8_linear import BLOCK
from mini_engine.layers.rope_scaling import YarnScaling, parse_rope_scaling, rope_parameters
from mini_engine.logits_processors import load_logits_processors
from mini_engine.pooling_params import PROBLEM_TYPES, PoolerConfig, classifier_activation
from mini_engine.quantization import (QUANTIZATION_METHODS, AwqConfig, QuantizationConfig,
                                      parse_quantization_config)
from mini_engine.reasoning import REASONING_PARSERS
from mini_engine.sampling_params import SamplingParams
from mini_engine.tokenizer import tokenizer_eos_id
from mini_engine.speculative import SpeculativeConfig


@dataclass(slots=True)
class ModelConfig:
    """The subset of a Hugging Face Qwen3 (or Qwen3-MoE) `config.json` that the decoder needs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...] = ()
    rope_scaling: YarnScaling | None = None     # YaRN's parameters, where config.json asks for it
    # An embedding model trained for Matryoshka cuts (vLLM reads config.json's is_matryoshka, or the
    # cuts it allows, matryoshka_dimensions): PoolingParams.dimensions may ask for a shorter vector.
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    # A cross-encoder reranker run as a pooling model, as vLLM converts Qwen3-Reranker (hf_overrides
    # {"classifier_from_token": ["no", "yes"]}): its score is the second token's probability against
    # the first's, from the lm_head's two logits at the last token of the query and document.
    classifier_from_token: tuple[str, ...] | None = None
    # Qwen3-MoE (transformers' Qwen3MoeForCausalLM, e.g. Qwen3-30B-A3B): num_experts 0 is the dense
    # Qwen3. A sparse layer's MLP is num_experts experts of moe_intermediate_size columns, of which
    # a router picks num_experts_per_tok a token (their weights renormalised to sum to 1 with
    # norm_topk_prob); the layers in mlp_only_layers, and all but every decoder_sparse_step-th, keep
    # a dense MLP of intermediate_size columns (layers/moe.py).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # A quantized checkpoint's quantization_config (Qwen3-*-FP8, Qwen3-*-AWQ, Qwen3-*-GPTQ-Int4:
    # mini_engine/quantization.py), or None.
    quantization: QuantizationConfig | None = None
    # A sequence classifier (architectures Qwen3ForSequenceClassification or its MoE twin: fine-tuned
    # classifiers, reward models such as Skywork-Reward-V2-Qwen3): the decoder and a `score` head of
    # num_labels rows, read at the last token; 0 for a generative model. labels: config.json's id2label
    # in index order; problem_type: transformers', which sets the logits' activation.
    num_labels: int = 0
    labels: tuple[str, ...] = ()
    problem_type: str | None = None

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer`'s MLP is a mixture of experts (transformers' rule)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def max_positions(self) -> int:
        """The longest context its positions serve: with YaRN original x factor (131,072 for
        Qwen3's 32,768 x 4, as vLLM derives it), else max_position_embeddings."""
        return self.max_position_embeddings if self.rope_scaling is None else self.rope_scaling.max_positions

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        archs = raw.get("architectures") or []
        model_type = raw.get("model_type")
        classifier = any(arch in SEQUENCE_CLASSIFIERS for arch in archs)
        moe = model_type == "qwen3_moe" or "Qwen3MoeForCausalLM" in archs or "Qwen3MoeForSequenceClassification" in archs
        # A Qwen3 with another head (Qwen3ForTokenClassification, ...ForQuestionAnswering) is named
        # here, not at its first unexpected tensor.
        other_heads = [arch for arch in archs if arch not in IMPLEMENTED_ARCHITECTURES]
        if other_heads or (not moe and model_type != "qwen3" and "Qwen3ForCausalLM" not in archs and not classifier):
            raise ValueError(
                f"config.json: unsupported architecture (model_type={model_type!r}, "
                f"architectures={archs!r}); mini_engine implements {', '.join(IMPLEMENTED_ARCHITECTURES)}")
        rope_scaling = parse_rope_scaling(raw)
        _, params = rope_parameters(raw)
        quantization = parse_quantization_config(raw.get("quantization_config"))
        if isinstance(quantization, AwqConfig) and moe:
            raise ValueError(f"config.json: {quantization.method} Qwen3-MoE checkpoints are not supported (their "
                             "experts would need a 4-bit grouped GEMM); the dense Qwen3-*-AWQ and -GPTQ-Int4 ones are, "
                             "and fp8 Qwen3-MoE (Qwen3-30B-A3B-FP8)")
        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "rms_norm_eps", "max_position_embeddings"]
        for name in required:
            if name not in raw:
                raise ValueError(f"config.json: missing field {name!r}")
        rope_theta = params.get("rope_theta", raw.get("rope_theta"))        # the dict's first, as transformers
        if rope_theta is None:
            raise ValueError("config.json: missing field 'rope_theta'")
        if raw.get("use_sliding_window"):
            raise ValueError("config.json: use_sliding_window=true is not supported")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act {raw['hidden_act']!r} is not supported")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        num_heads = raw["num_attention_heads"]
        # transformers' Qwen3Config: a field left out takes its default (head_dim 128, 32 KV heads);
        # one given as null falls back to hidden_size / heads and to one KV head a query head.
        num_kv_heads = raw.get("num_key_value_heads", 32) or num_heads
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"config.json: num_attention_heads={num_heads} is not a multiple of "
                             f"num_key_value_heads={num_kv_heads}")
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=raw.get("head_dim", 128) or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw["rms_norm_eps"],
            rope_theta=float(rope_theta),
            max_position_embeddings=raw["max_position_embeddings"],
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", False),
            eos_token_ids=eos_ids,
            rope_scaling=rope_scaling,
            is_matryoshka=bool(raw.get("is_matryoshka") or raw.get("matryoshka_dimensions")),
            matryoshka_dimensions=tuple(raw["matryoshka_dimensions"]) if raw.get("matryoshka_dimensions") else None,
            classifier_from_token=tuple(raw["classifier_from_token"]) if raw.get("classifier_from_token") else None,
            quantization=quantization,
            **(moe_fields(raw) if moe else {}),
            **(classifier_fields(raw) if classifier else {}),
        )

    @classmethod
    def from_pretrained(cls, path: str, overrides: dict | None = None) -> "ModelConfig":
        """overrides: config.json's fields that these replace (EngineConfig.hf_overrides)."""
        raw = read_json_file(os.path.join(path, "config.json"))
        if raw is None:
            raise FileNotFoundError(f"{path}: no config.json (is this a Hugging Face checkpoint folder?)")
        config = cls.from_dict(raw | (overrides or {}))
        eos = read_generation_config(path).get("eos_token_id")
        if eos is not None:
            config.eos_token_ids = tuple(eos) if isinstance(eos, list) else (eos,)
        return config


# transformers' sequence classifiers over the Qwen3 decoders: the decoder, then `score` at the last token.
SEQUENCE_CLASSIFIERS = ("Qwen3ForSequenceClassification", "Qwen3MoeForSequenceClassification")
# config.json's architectures this engine runs (Qwen3Model: the bare decoder an embedding
# checkpoint, Qwen3-Embedding's layout, may name).
IMPLEMENTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3Model", "Qwen3MoeModel",
                             *SEQUENCE_CLASSIFIERS)


def classifier_fields(raw: dict) -> dict:
    """A sequence classifier's labels, as transformers reads config.json: id2label's names (in index
    order), or num_labels' LABEL_i; neither: transformers' default of two. Both, disagreeing: refused
    (transformers 4 then takes id2label's count, 5 num_labels)."""
    id2label, num_labels = raw.get("id2label"), raw.get("num_labels")
    if num_labels is not None and (not isinstance(num_labels, int) or isinstance(num_labels, bool) or num_labels < 1):
        raise ValueError(f"config.json: num_labels must be an integer >= 1, got {num_labels!r}")
    labels = None
    if id2label is not None:
        if not isinstance(id2label, dict) or not id2label:
            raise ValueError(f"config.json: id2label must map each label's index to its name, got {id2label!r}")
        by_index = {str(index): str(name) for index, name in id2label.items()}
        if set(by_index) != {str(i) for i in range(len(by_index))}:
            raise ValueError(f"config.json: id2label's indices must be 0 to {len(by_index) - 1}, "
                             f"got {sorted(by_index)}")
        labels = tuple(by_index[str(i)] for i in range(len(by_index)))
        if num_labels is not None and num_labels != len(labels):
            raise ValueError(f"config.json: num_labels={num_labels} but id2label names {len(labels)} labels")
    if labels is None:
        labels = tuple(f"LABEL_{i}" for i in range(2 if num_labels is None else num_labels))
    problem_type = raw.get("problem_type")
    if problem_type not in (None, *PROBLEM_TYPES):
        raise ValueError(f"config.json: problem_type must be one of {PROBLEM_TYPES} or null, got {problem_type!r}")
    return dict(num_labels=len(labels), labels=labels, problem_type=problem_type)


def moe_fields(raw: dict) -> dict:
    """A Qwen3-MoE config.json's expert fields; one left out takes transformers' Qwen3MoeConfig
    default (transformers 5 writes num_experts as num_local_experts)."""
    num_experts = raw.get("num_experts", raw.get("num_local_experts", 128))
    fields = dict(num_experts=num_experts, num_experts_per_tok=raw.get("num_experts_per_tok", 8),
                  moe_intermediate_size=raw.get("moe_intermediate_size", 768),
                  norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                  decoder_sparse_step=raw.get("decoder_sparse_step", 1),
                  mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()))
    for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
        if not isinstance(fields[name], int) or fields[name] < 1:
            raise ValueError(f"config.json: {name} must be an integer >= 1, got {fields[name]!r}")
    if fields["num_experts_per_tok"] > num_experts:
        raise ValueError(f"config.json: num_experts_per_tok={fields['num_experts_per_tok']} is more than "
                         f"num_experts={num_experts}")
    return fields


# The fields of a generation_config.json that set a request's defaults, as vLLM reads them.
# max_new_tokens is SamplingParams' max_tokens offline, and on the server a cap on every request's
# (vLLM's: a request that asks for more quietly gets that many).
GENERATION_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "repetition_penalty", "min_p", "max_new_tokens")
# generation_config's values for SamplingParams' own defaults: ours, and vLLM's name for them.
OWN_SAMPLING_DEFAULTS = ("none", "vllm")


def as_sampling_fields(fields: dict) -> dict:
    """generation_config's fields under SamplingParams' names: max_new_tokens is max_tokens."""
    return {("max_tokens" if name == "max_new_tokens" else name): value for name, value in fields.items()}


def read_generation_config(folder: str) -> dict:
    """A checkpoint folder's generation_config.json, or {} where it has none."""
    return read_json_file(os.path.join(folder, "generation_config.json")) or {}


# kv_cache_dtype's names, vLLM's: None is the model's dtype.
KV_CACHE_DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn,
                   "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@dataclass(slots=True)
class EngineConfig:
    model: str
    device: str | None = None          # None: CUDA when available, else CPU
    dtype: str | None = None           # None: bfloat16 on CUDA, float32 on CPU; a name or a torch.dtype
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    # As vLLM's: the most prompt tokens one request computes in a step (0: as many as the step's
    # budget leaves), so that a long prompt's chunks leave room for short prompts and decode rows.
    long_prefill_token_threshold: int = 0
    max_model_len: int | None = None   # None: the positions the checkpoint's RoPE serves (ModelConfig.max_positions)
    # None: 64 on CUDA, 16 on CPU. On the H200 a decode tile of 64 tokens then comes from one block
    # instead of four scattered ones: decode attention ~1.4% faster at 64-256 rows, the benchmark
    # -0.03 s (benchmarks/NOTES.md, entry 42). The CPU keeps vLLM's 16, which the tests' pools assume.
    block_size: int | None = None
    num_kv_blocks: int | None = None   # None: sized from GPU memory (CUDA) or cpu_kv_blocks
    # As vLLM's: the KV pool's bytes on each GPU (each tensor-parallel rank: its heads' share), in
    # place of what gpu_memory_utilization leaves; on the CPU too. A draft model's slots count in it.
    kv_cache_memory_bytes: int | None = None
    cpu_kv_blocks: int = 1024
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # As vLLM's: GiB of host memory (pinned on CUDA) for a second tier of the prefix cache, where
    # blocks the KV pool evicts are kept and loaded back from (engine/host_block_pool.py); summed
    # over tensor-parallel ranks. None: no host tier. The backend: "native" alone (vLLM's own).
    kv_offloading_size: float | None = None
    kv_offloading_backend: str = "native"
    # The KV cache's element type, as vLLM's kv_cache_dtype: "auto", the model's dtype; "bfloat16";
    # "fp8" (or "fp8_e4m3"), float8_e4m3fn; "fp8_e5m2", float8_e5m2 (one mantissa bit fewer, a
    # range to +-57344). fp8 is half the bytes a token: twice the tokens in the pool and half what
    # decode attention reads. K and V are stored unscaled (vLLM's k_scale = v_scale = 1.0 when a
    # checkpoint has none), rounded to nearest and saturated at the format's largest value.
    kv_cache_dtype: str = "auto"
    # Which fused kernels replace the eager PyTorch path: "auto" (all of them on CUDA when Triton
    # is importable, none on CPU), "none", or a comma-separated subset of kernels.KERNEL_NAMES.
    kernels: str = "auto"
    enforce_eager: bool = False        # True: never use CUDA graphs
    # As vLLM's: which steps are captured as CUDA graphs, and at which sizes (mini_engine/compilation_config.py):
    # compilation_config's cudagraph_mode ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "PIECEWISE" or
    # "NONE"), cudagraph_capture_sizes and max_cudagraph_capture_size; the last two may be given on
    # their own instead (vLLM's --cudagraph-capture-sizes and --max-cudagraph-capture-size). A step
    # larger than the largest captured size runs eager.
    compilation_config: dict | CompilationConfig | int | None = None
    # vLLM's optimization level (-O0 to -O3), as far as it sets cudagraph_mode: 0 "NONE", 1
    # "PIECEWISE", 2 and 3 "FULL_AND_PIECEWISE"; compilation_config's own cudagraph_mode wins over it.
    # None: level 2's.
    optimization_level: int | None = None
    cudagraph_capture_sizes: list[int] | None = None
    max_cudagraph_capture_size: int | None = None
    # Schedule step n+1 while the device runs step n (see LLMEngine.step). False: every step
    # waits for its own tokens first.
    async_scheduling: bool = True
    seed: int = 0
    # As vLLM's: "fcfs", or "priority" (requests carry a priority; a lower value is admitted first
    # and preempted last, ties by arrival).
    scheduling_policy: str = "fcfs"
    # The most top tokens a request's logprobs or prompt_logprobs may ask for, as vLLM's
    # max_logprobs (each is a Python object on the host, per token).
    max_logprobs: int = 20
    # Where a request's unset sampling parameters come from, as vLLM's --generation-config: "auto",
    # the checkpoint's generation_config.json (Qwen3's asks for temperature 0.6, top_p 0.95, top_k
    # 20); "none" (vLLM's "vllm"), SamplingParams' own defaults; or a folder with a generation_config.json.
    generation_config: str = "auto"
    # As vLLM's --tokenizer: a folder whose tokenizer.json (and tokenizer_config.json's chat template
    # and special tokens, or its chat_template.jinja) the engine and server read in place of the
    # model folder's; None, the model's own (tokenizer_path).
    tokenizer: str | None = None
    # As vLLM's --override-generation-config: sampling defaults that replace generation_config's
    # (or, with "none", the only ones), e.g. {"temperature": 0.7}; GENERATION_SAMPLING_FIELDS only.
    override_generation_config: dict | None = None
    # As vLLM's reasoning_parser (`--reasoning-parser qwen3`): None, or "qwen3", with which
    # structured outputs hold only what follows the output's thought (mini_engine/reasoning.py).
    reasoning_parser: str | None = None
    # As vLLM's hf_overrides: fields that replace config.json's, e.g. Qwen's YaRN for 131k tokens,
    # {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}.
    hf_overrides: dict | None = None
    # As vLLM's (-tp): the model's heads, MLP columns and vocabulary split over this many processes,
    # one GPU each (cuda:0 .. cuda:N-1; gloo between CPU processes): mini_engine/distributed.py.
    tensor_parallel_size: int = 1
    # As vLLM's --runner: "generate", or "pooling", an embedding model (LLM.embed, the server's
    # /v1/embeddings) or a sequence classifier (LLM.classify, /classify): each prompt's final hidden
    # states pooled into one vector, no lm_head, no sampling (mini_engine/pooling_params.py); "auto"
    # (vLLM's default), "pooling" for a checkpoint whose architecture is a sequence classifier, else
    # "generate". pooler_config (vLLM's): its pooling_type, "LAST" or "MEAN", and normalize, over
    # what the checkpoint's Sentence Transformers files say (and a cross-encoder's
    # classifier_token_ids, ids where config.json's classifier_from_token names them); a
    # classifier's use_activation (the default of its requests').
    runner: str = "auto"
    pooler_config: dict | PoolerConfig | None = None
    # As vLLM's: speculative decoding, {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_max": ..., "prompt_lookup_min": ..., "disable_by_batch_size": ...}
    # (mini_engine/speculative.py), or {"method": "draft_model", "model": path, "num_speculative_tokens":
    # k} (runner/draft_model.py). Steps that propose drafts run synchronously.
    speculative_config: dict | SpeculativeConfig | None = None
    # As vLLM's --quantization: None, whatever the checkpoint is (an FP8 checkpoint runs in fp8,
    # an AWQ or GPTQ one in 4-bit); "fp8", which also quantizes a bf16 checkpoint's projections to fp8
    # blocks as it loads them (mini_engine/quantization.py): half the weights' bytes, fp8 tensor
    # cores for prefill; or "awq" or "gptq", which only an AWQ or GPTQ checkpoint can be (its 4-bit
    # weights come from a calibration the engine does not run).
    quantization: str | None = None
    # As vLLM's: LoRA adapters (mini_engine/lora.py). enable_lora gives every decoder projection
    # max_loras slots of rank up to max_lora_rank (the adapters one step may mix); max_cpu_loras
    # (None: max_loras) adapters stay read on the host.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # As vLLM's: LLM.sleep(level) gives the device memory of the weights and of the KV pool back
    # between generations (an RL trainer's turn on the GPU), and wake_up() takes it again
    # (runner/sleep_mode.py).
    enable_sleep_mode: bool = False
    # As vLLM's: a prompt may be given as its embeddings, {"prompt_embeds": [n, hidden] tensor}, in
    # place of token ids (engine.prompt_embeds).
    enable_prompt_embeds: bool = False
    # As vLLM's: custom logits processors (mini_engine/logits_processors.py), classes or their
    # qualified names ("pkg.module:Class"), loaded here into a tuple of classes. While any is
    # loaded, every step samples outside the CUDA graphs and waits for the step before it.
    logits_processors: list | tuple | None = None
    model_config: ModelConfig | None = field(default=None, repr=False)
    pooler: PoolerConfig | None = field(init=False, repr=False, default=None)    # resolved, for "pooling"
    # The sampling parameters generation_config sets (GENERATION_SAMPLING_FIELDS, max_new_tokens as
    # max_tokens).
    sampling_defaults: dict = field(init=False, repr=False, default_factory=dict)
    # The decode batch sizes captured as CUDA graphs, ascending (where graphs run at all: CUDA, the
    # Triton attention kernel, not enforce_eager).
    cuda_graph_sizes: tuple[int, ...] = field(init=False, repr=False, default=())
    # The token counts captured as piecewise CUDA graphs, ascending (runner/piecewise_graph.py).
    piecewise_graph_sizes: tuple[int, ...] = field(init=False, repr=False, default=())

    def __post_init__(self):
        if self.block_size is None:
            self.block_size = 64 if self.resolved_device().type == "cuda" else 16
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be an integer >= 0, got {self.long_prefill_token_threshold!r}")
        if self.max_num_seqs > 65535:      # the decode attention kernel puts sequences on CUDA's grid z
            raise ValueError(f"max_num_seqs must be <= 65535, got {self.max_num_seqs}")
        compilation = (CompilationConfig.resolve(self.compilation_config, self.optimization_level)
                       .merged(self.cudagraph_capture_sizes, self.max_cudagraph_capture_size))
        # A decode step's rows are tokens too: no more than either bound, and no graph is captured
        # above it (vLLM caps its sizes by both).
        self.cuda_graph_sizes = compilation.capture_sizes(*min((self.max_num_seqs, "max_num_seqs"),
                                                               (self.max_num_batched_tokens, "max_num_batched_tokens")))
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        memory = self.kv_cache_memory_bytes
        if memory is not None and (isinstance(memory, bool) or not isinstance(memory, numbers.Integral) or memory < 1):
            raise ValueError(f"kv_cache_memory_bytes must be an integer number of bytes >= 1, got {memory!r}")
        if memory is not None and self.num_kv_blocks is not None:
            raise ValueError("give num_kv_blocks or kv_cache_memory_bytes, not both: each sizes the KV pool")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an integer >= 0, got {self.max_logprobs!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS} or None, got {self.reasoning_parser!r}")
        if self.cpu_kv_blocks < 1:
            raise ValueError(f"cpu_kv_blocks must be >= 1, got {self.cpu_kv_blocks}")
        if self.tokenizer == "":        # as vLLM reads an empty --tokenizer: the model's own
            self.tokenizer = None
        if self.tokenizer is not None and not os.path.isfile(os.path.join(self.tokenizer, "tokenizer.json")):
            raise ValueError(f"tokenizer {self.tokenizer!r}: no tokenizer.json there (a folder holding one, as a "
                             "Hugging Face checkpoint's)")
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ValueError(f"hf_overrides must be a dict of config.json's fields, got {self.hf_overrides!r}")
        if self.model_config is None:
            self.model_config = ModelConfig.from_pretrained(self.model, self.hf_overrides)
            if not self.model_config.eos_token_ids and (eos := tokenizer_eos_id(self.tokenizer_path)) is not None:
                # Neither config.json nor generation_config.json names one: the tokenizer's, as vLLM
                # stops at the tokenizer's eos_token.
                self.model_config.eos_token_ids = (eos,)
        elif self.hf_overrides:
            raise ValueError("hf_overrides change config.json as it is read: give them or a model_config, not both")
        if self.quantization not in (None, *QUANTIZATION_METHODS):
            raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS} or None, got {self.quantization!r}")
        checkpoint = self.model_config.quantization
        if checkpoint is not None and self.quantization not in (None, checkpoint.method):
            raise ValueError(f"quantization={self.quantization!r}, but the checkpoint is {checkpoint.method} "
                             f"(config.json's quantization_config): leave quantization unset")
        if checkpoint is not None:
            self.quantization = checkpoint.method
        elif self.quantization in ("awq", "gptq"):
            article = "an" if self.quantization == "awq" else "a"
            raise ValueError(f"quantization={self.quantization!r} needs {article} {self.quantization.upper()} "
                             f"checkpoint (config.json's quantization_config with quant_method "
                             f"{self.quantization!r}); this one has none")
        for name in ("enable_sleep_mode", "enable_prompt_embeds"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        mc = self.model_config
        check_divisible({"num_attention_heads": mc.num_attention_heads, "num_key_value_heads": mc.num_key_value_heads,
                         "intermediate_size": mc.intermediate_size}
                        | ({"moe_intermediate_size": mc.moe_intermediate_size} if mc.num_experts else {}),
                        self.tensor_parallel_size)
        self.check_fp8_experts()
        if self.tensor_parallel_size > 1 and self.device not in (None, "cuda", "cpu"):
            raise ValueError(f"with tensor_parallel_size > 1, rank r runs on cuda:r: give device 'cuda' or 'cpu', "
                             f"not {self.device!r}")
        limit = self.model_config.max_positions
        if self.max_model_len is None:
            self.max_model_len = limit
        elif not 1 <= self.max_model_len <= limit:
            raise ValueError(f"max_model_len must be in [1, {limit}] for this checkpoint, got {self.max_model_len}")
        # No step has more tokens than its budget, nor than max_num_seqs rows of max_model_len each.
        most_tokens = min((self.max_num_batched_tokens, "max_num_batched_tokens"),
                          (self.max_num_seqs * self.max_model_len, "max_num_seqs x max_model_len"))
        self.piecewise_graph_sizes = compilation.piecewise_sizes(self.max_num_seqs, *most_tokens)
        self.sampling_defaults = self.read_sampling_defaults()
        self.resolve_runner()
        if self.runner == "pooling":
            activation = classifier_activation(mc.num_labels, mc.problem_type) if mc.num_labels else None
            self.pooler = PoolerConfig.resolve(self.model, self.pooler_config, mc.classifier_from_token, activation,
                                               self.tokenizer_path)
            if self.reasoning_parser is not None:
                raise ValueError("reasoning_parser is for generation: a pooling runner samples nothing")
            ids = self.pooler.classifier_token_ids
            if ids is not None and (len(ids) != 2 or not all(0 <= i < mc.vocab_size for i in ids)):
                raise ValueError(f"classifier_token_ids must be two token ids in [0, {mc.vocab_size}), got {ids}")
        elif mc.classifier_from_token:
            raise ValueError("classifier_from_token (a cross-encoder reranker) needs runner='pooling'")
        elif self.pooler_config is not None:
            raise ValueError("pooler_config needs runner='pooling'")
        self.check_lora()
        self.logits_processors = load_logits_processors(self.logits_processors)
        if self.logits_processors:
            # vLLM refuses the first two alike; the other ranks would need the processors' state.
            for refused, why in ((self.runner == "pooling", "a pooling runner samples nothing"),
                                 (self.speculative_config is not None, "not with speculative decoding"),
                                 (self.tensor_parallel_size > 1, "not with tensor parallelism")):
                if refused:
                    raise ValueError(f"logits_processors: {why}")
        if self.speculative_config is not None:
            if self.runner == "pooling":
                raise ValueError("speculative_config is for generation: a pooling runner samples nothing")
            self.speculative_config = SpeculativeConfig.resolve(self.speculative_config)
            if self.speculative_config.method == "draft_model":
                self.check_draft_model()
        self.check_kv_offloading()

    def check_kv_offloading(self) -> None:
        """The host tier keeps the prefix cache's blocks: there must be one, and K and V that only
        the target model's pool holds (a draft model's own would not come back with them)."""
        if self.kv_offloading_backend != "native":
            raise ValueError(f"kv_offloading_backend must be 'native' (vLLM's 'lmcache' needs LMCache, which this "
                             f"engine does not run), got {self.kv_offloading_backend!r}")
        size = self.kv_offloading_size
        if size is None:
            return
        if isinstance(size, bool) or not isinstance(size, numbers.Real) or not 0 < size < math.inf:
            raise ValueError(f"kv_offloading_size must be a finite number of GiB > 0 (or None: no offloading), "
                             f"got {size!r}")
        self.kv_offloading_size = float(size)
        if not self.enable_prefix_caching:
            raise ValueError("kv_offloading_size keeps the prefix cache's blocks in host memory: it needs "
                             "enable_prefix_caching")
        if self.runner == "pooling":
            raise ValueError("kv_offloading_size: a pooling runner's prompts take nothing from the prefix cache")
        if self.speculative_config is not None and self.speculative_config.method == "draft_model":
            raise ValueError("kv_offloading_size: not with a draft model, whose own K and V the host tier "
                             "would not keep")

    def check_draft_model(self) -> None:
        """A draft model (speculative_config's "draft_model") drafts tokens the target reads by id,
        so both must share one vocabulary, and it must reach max_model_len; it runs whole beside
        the target's rank 0, in the target's KV blocks (runner/draft_model.py)."""
        spec = self.speculative_config
        try:
            draft = ModelConfig.from_pretrained(spec.model)
        except (OSError, ValueError) as e:
            raise ValueError(f"speculative_config: the draft model {spec.model!r} cannot be read: {e}") from None
        if draft.vocab_size != self.model_config.vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocab_size {draft.vocab_size} differs from the "
                             f"target's {self.model_config.vocab_size}: its drafts would be other tokens")
        if draft.max_positions < self.max_model_len:
            raise ValueError(f"speculative_config: the draft model reaches {draft.max_positions} positions, fewer "
                             f"than max_model_len={self.max_model_len}; lower max_model_len")
        if draft.num_labels:
            raise ValueError("speculative_config: the draft model is a sequence classifier: it cannot draft tokens")
        try:
            self.draft_model_config(draft)
        except ValueError as e:
            raise ValueError(f"speculative_config: the draft model: {e}") from None

    def draft_model_config(self, model_config: ModelConfig | None = None) -> "EngineConfig":
        """The draft model's own configuration (runner/draft_model.py): this engine's, on the draft's
        checkpoint, with its quantization, generating greedily on one device, without adapters,
        parsers or graphs until it shares the target's pool; num_kv_blocks 1 until then.
        model_config: the draft's config.json, where the caller has read it already."""
        spec = self.speculative_config
        return replace(
            self, model=spec.model, model_config=model_config, hf_overrides=None, num_kv_blocks=1,
            kv_cache_memory_bytes=None, kv_offloading_size=None, speculative_config=None,
            quantization=spec.quantization, enable_lora=False, reasoning_parser=None, runner="generate",
            pooler_config=None, generation_config="none", override_generation_config=None, enforce_eager=True,
            logits_processors=None,
            tensor_parallel_size=1)

    def check_fp8_experts(self) -> None:
        """fp8 Qwen3-MoE experts need each rank's share of an expert's gate and up rows in whole
        128 x 128 blocks (layers.moe.FusedExperts.hold_fp8_weight): said here, before any weight loads.
        Qwen3-30B-A3B's 768 columns make 1, 2 or 3 ranks (at 4, vLLM fails too: vllm-project/vllm#25292)."""
        mc, n = self.model_config, self.tensor_parallel_size
        if self.quantization != "fp8" or not mc.num_experts or (mc.moe_intermediate_size // n) % BLOCK == 0:
            return
        share = f" / tensor_parallel_size {n} = {mc.moe_intermediate_size // n}" if n > 1 else ""
        raise ValueError(f"fp8 Qwen3-MoE experts need each rank's share of an expert's gate and up projections in "
                         f"whole {BLOCK}-row blocks (one fp8 scale a {BLOCK} x {BLOCK} block): moe_intermediate_size "
                         f"{mc.moe_intermediate_size}{share} rows is not" + ("; use fewer ranks" if n > 1 else ""))

    def resolve_runner(self) -> None:
        """runner "auto" as vLLM resolves it: a sequence classifier's checkpoint pools, any other generates. A
        classifier has no lm_head to generate with, so "generate" is refused for it (as vLLM's
        "This model does not support `--runner generate`")."""
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"runner must be 'auto', 'generate' or 'pooling', got {self.runner!r}")
        mc = self.model_config
        if self.runner == "auto":
            self.runner = "pooling" if mc.num_labels else "generate"
        elif self.runner == "generate" and mc.num_labels:
            raise ValueError("this checkpoint is a sequence classifier (config.json's architectures: "
                             f"{' or '.join(SEQUENCE_CLASSIFIERS)}): it has a score head and no lm_head, so it cannot "
                             "generate; run it with runner='pooling' (or 'auto', which picks it): LLM.classify")
        if mc.num_labels and mc.classifier_from_token:
            raise ValueError("classifier_from_token reads a generative model's lm_head as a cross-encoder; this "
                             "checkpoint is a sequence classifier, whose score head is its own")

    def check_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif not isinstance(self.max_cpu_loras, int) or self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), "
                             f"got {self.max_cpu_loras!r}")
        if self.enable_lora and self.runner == "pooling":
            raise ValueError("enable_lora is for generation here: a pooling runner takes no adapters")

    def read_sampling_defaults(self) -> dict:
        overrides = self.override_generation_config or {}
        if not isinstance(overrides, dict):
            raise ValueError(f"override_generation_config must be a dict, got {type(overrides).__name__}")
        if unknown := sorted(set(overrides) - set(GENERATION_SAMPLING_FIELDS)):
            raise ValueError(f"override_generation_config sets {unknown}; it takes the sampling defaults "
                             f"{list(GENERATION_SAMPLING_FIELDS)}")
        overrides = as_sampling_fields(overrides)
        try:
            SamplingParams(**overrides)
        except (ValueError, TypeError) as e:
            raise ValueError(f"override_generation_config: {e}") from None
        if self.generation_config in OWN_SAMPLING_DEFAULTS:
            return overrides
        if self.generation_config == "auto":
            folder = self.model
        elif os.path.isdir(self.generation_config):
            folder = self.generation_config
        else:
            raise ValueError(f"generation_config must be 'auto', 'none' (or vLLM's 'vllm') or a folder, got "
                             f"{self.generation_config!r}")
        raw = read_generation_config(folder)
        defaults = as_sampling_fields({name: raw[name] for name in GENERATION_SAMPLING_FIELDS if raw.get(name) is not None})
        try:        # merged first: an override may replace a value of the file's that would not do
            SamplingParams(**(defaults | overrides))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{folder}/generation_config.json: {e}") from None
        return defaults | overrides

    def default_sampling_params(self, **given) -> SamplingParams:
        """SamplingParams with what `given` sets, and the rest from generation_config where it
        sets it (vLLM's LLM.get_default_sampling_params, and what its server does for each request)."""
        return SamplingParams(**(self.sampling_defaults | given))

    def check_priority(self, priority: int) -> None:
        """A request's priority: any integer, and other than 0 only under the "priority" policy."""
        if not isinstance(priority, numbers.Integral) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority and self.scheduling_policy != "priority":
            raise ValueError(f"priority {priority} needs scheduling_policy='priority' "
                             "(--scheduling-policy priority); the engine schedules first come, first served")

    @property
    def max_new_tokens(self) -> int | None:
        """generation_config's max_new_tokens: the server's cap on a request's max_tokens, or None."""
        return self.sampling_defaults.get("max_tokens")

    @property
    def tokenizer_path(self) -> str:
        """The folder the tokenizer and chat template come from: tokenizer, or the model's."""
        return self.tokenizer or self.model

    def resolved_device(self) -> torch.device:
        """The device named, or CUDA when one is available, else the CPU."""
        return torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineConfig":
        known = {f.name for f in fields(cls) if f.init}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown engine options: {sorted(unknown)}")
        return cls(model=model, **kwargs)
