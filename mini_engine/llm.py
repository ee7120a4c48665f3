"""LLM: the offline entry point, shaped like vLLM's."""
import dataclasses
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from mini_engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence, run_beam_search
from mini_engine.config import EngineConfig
from mini_engine.detokenizer import IncrementalDetokenizer
from mini_engine.engine.engine import LLMEngine, StepOutput
from mini_engine.engine.sequence import Sequence, check_cache_salt
from mini_engine.layers.pooler import cosine_similarity, task_output
from mini_engine.lora import LoRARequest
from mini_engine.outputs import (ClassificationOutput, ClassificationRequestOutput, CompletionOutput, EmbeddingOutput,
                                 EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput, RequestOutput,
                                 ScoringOutput, ScoringRequestOutput)
from mini_engine.pooling_params import PoolingParams, check_task_parameters, resolve_pooling_task
from mini_engine.sampling_params import SamplingParams
from mini_engine.tokenizer import encode_pair, load_transformers_tokenizer


def unwrap_prompt(prompt):
    """vLLM's prompt dicts, {"prompt": text} and {"prompt_token_ids": ids} (TextPrompt, TokensPrompt),
    each with an optional "cache_salt" (prompt_cache_salt), as the text or ids they hold. Other keys
    (multi_modal_data, ...) ask for what this engine does not do, so they are refused; so is
    {"prompt_embeds": ...} (EmbedsPrompt) where it reaches here: only generate takes it (prompt_embeds_of)."""
    if not isinstance(prompt, dict):
        return prompt
    content = prompt.keys() - {"cache_salt"}
    if content in ({"prompt"}, {"prompt_token_ids"}):
        return prompt[content.pop()]
    if content == {"prompt_embeds"}:
        raise ValueError("a prompt given as embeddings ({'prompt_embeds': ...}) is taken by LLM.generate alone")
    raise ValueError(f"a prompt dict holds 'prompt' (text), 'prompt_token_ids' or 'prompt_embeds', and may hold "
                     f"'cache_salt'; got keys {sorted(prompt)}")


def prompt_embeds_of(prompt):
    """vLLM's EmbedsPrompt, {"prompt_embeds": [n, hidden] tensor} (with enable_prompt_embeds): the
    tensor; None for any other prompt."""
    if isinstance(prompt, dict) and prompt.keys() - {"cache_salt"} == {"prompt_embeds"}:
        return prompt["prompt_embeds"]
    return None


def prompt_cache_salt(prompt) -> str | None:
    """A prompt dict's cache_salt (vLLM's): its prefix-cache blocks serve only prompts of the same
    salt. As in vLLM, an empty one is none."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    check_cache_salt(salt)
    return salt or None


@dataclass
class Admission:
    """What LLM.generate knows of the prompts it has added: the block hashes of their prompts
    (a later prompt that starts the same way hits those blocks once they are admitted) and what
    each was estimated to cost a step's budget."""
    shared_blocks: set[int] = field(default_factory=set)
    prompt_costs: dict[str, int] = field(default_factory=dict)
    # The prompt added last: its token ids, which its other completions share (and its embeddings,
    # where it was given as them: its ids are then placeholders).
    last_prompt_ids: list[int] = field(default_factory=list)
    last_prompt_embeds: object | None = None
    # Each prompt's request id (drawn in the prompts' order, as vLLM's, whatever order they are
    # added in), priority and LoRA adapter (None: the base model).
    request_ids: list[str] = field(default_factory=list)
    priorities: list[int] = field(default_factory=list)
    loras: list = field(default_factory=list)


class LLM:
    def __init__(self, model: str, **kwargs):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **kwargs))
        self.chat_template = None       # the checkpoint's, read on the first chat()
        self._hf_tokenizer = None       # get_tokenizer's

    def shutdown(self) -> None:
        """With tensor_parallel_size > 1: stops the other ranks' processes (they stop at exit too)."""
        self.engine.shutdown()

    @property
    def tokenizer(self):
        """The checkpoint's tokenizer.json, as the `tokenizers` library loads it (None without one):
        what the engine encodes prompts and decodes outputs with."""
        return self.engine.tokenizer

    def get_tokenizer(self):
        """vLLM's LLM.get_tokenizer: the checkpoint's tokenizer as transformers loads it
        (AutoTokenizer: encode, decode, apply_chat_template, eos_token_id, ...), which its users
        build prompts with. Loaded once, on the first call; needs transformers, which the engine
        itself does not."""
        if self._hf_tokenizer is None:
            self._hf_tokenizer = load_transformers_tokenizer(self.engine.config.tokenizer_path,
                                                             self.engine.tokenizer is not None, "LLM")
        return self._hf_tokenizer

    def start_profile(self, profile_dir: str | None = None) -> None:
        """vLLM's LLM.start_profile: torch.profiler records the engine's process (CPU and, on a GPU,
        CUDA activity) until stop_profile, which writes a Chrome trace (chrome://tracing, Perfetto)
        into profile_dir, or into $VLLM_TORCH_PROFILER_DIR as vLLM's does (LLMEngine.start_profile)."""
        self.engine.start_profile(profile_dir)

    def stop_profile(self) -> str:
        """Ends start_profile's recording and returns the trace's path."""
        return self.engine.stop_profile()

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() samples with when given no SamplingParams: the checkpoint's
        generation_config.json temperature, top_k, top_p, repetition_penalty and min_p where it
        sets them (EngineConfig's generation_config), SamplingParams' own defaults for the rest."""
        return self.engine.config.default_sampling_params()

    # ---- between generations: what RL trainers ask of vLLM's LLM ----

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """New weights written into the running model in place, as RL trainers update vLLM's between
        steps (TRL, verl and OpenRLHF call its model's load_weights): Hugging Face checkpoint names and
        tensors, a whole state dict or any part of it (hf_model.named_parameters(),
        state_dict().items(), one tensor a call), in any floating dtype, on any device. They are
        packed, cut for tensor parallelism and cast as the loader does, then folded into the norms'
        projections and quantized to fp8 as loading does (mini_engine/runner/weight_updates.py), into
        the parameters' own memory, so the CUDA graphs stay valid; then the prefix cache is reset.
        An unknown name, a wrong shape or dtype, or a value that is not finite raises ValueError
        with nothing written; requests still unfinished, RuntimeError. Returns the tensors written."""
        return self.engine.load_weights(weights)

    def reset_prefix_cache(self, reset_connector: bool = False) -> bool:
        """vLLM's: drops every cached prefix block, so that no later prompt reuses K and V computed
        before (by older weights); the host tier's (kv_offloading_size) only with reset_connector,
        as vLLM's. False, with a warning and nothing dropped, while unfinished requests hold blocks
        (never between two generate() calls). load_weights and sleep reset it themselves."""
        return self.engine.reset_prefix_cache(reset_connector)

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (LLM(..., enable_sleep_mode=True)): gives back the device memory of the
        weights and of the KV cache, whose contents (and the prefix cache) are dropped. Level 1 keeps
        a host copy of the weights, which wake_up() restores; level 2 discards them, and
        load_weights must give all of them again before the next generation."""
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's: allocates the memory sleep() gave back, for tags "weights" and "kv_cache" (None:
        both); e.g. the weights alone, to load new ones before the KV cache takes its memory."""
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        """vLLM's: True from sleep() until every tag is awake again."""
        return self.engine.is_sleeping()

    @staticmethod
    def prompt_list(prompts) -> list:
        """One prompt (text, token ids, or vLLM's prompt dict) as a list of one; a list as it is."""
        if isinstance(prompts, np.ndarray) and prompts.ndim == 1:
            return [prompts]                      # one prompt's token ids
        if isinstance(prompts, (str, dict)) or (len(prompts) and isinstance(prompts[0], (int, np.integer))):
            return [prompts]
        return prompts

    def generate(self, prompts: str | dict | list[str | dict] | list[int] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """priority: one for each prompt, with scheduling_policy "priority" (vLLM's): a lower value
        is scheduled first. lora_request (vLLM's, with enable_lora): the LoRA adapter every prompt
        runs with, or one for each prompt (None: the base model)."""
        if self.engine.config.runner == "pooling":
            raise ValueError(f"this LLM runs {self.pooling_model_kind()} (runner='pooling'); generation needs "
                             "runner='generate'")
        prompts = self.prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(priority)} priorities")
        for value in priority:
            self.engine.config.check_priority(value)
        loras = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(loras)} LoRA requests")
        for lora in dict.fromkeys(loras):         # each adapter read and checked once, before any request runs
            self.engine.check_lora(lora)
        seqs, completion_of, stoppers = self.run_requests(prompts, sampling_params, priority, use_tqdm, "Generating",
                                                          loras)
        groups: list[list[tuple[int, Sequence]]] = [[] for _ in prompts]
        for seq in seqs:
            i, k = completion_of[seq.request_id]
            groups[i].append((k, seq))
        return [self.to_output(prompt, group, stoppers) for prompt, group in zip(prompts, groups)]

    def beam_search(self, prompts: str | dict | list[str | dict] | list[int] | list[list[int]],
                    params: BeamSearchParams, lora_request: LoRARequest | list[LoRARequest | None] | None = None,
                    use_tqdm: bool = False, concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: each prompt's best params.beam_width sequences, best first, each
        one-token step a generate() of every live beam (mini_engine/beam_search.py). Prompts (a
        dict's cache_salt kept by every step of its beams) and lora_request as generate's. Each step
        asks 2 x beam_width logprobs, which max_logprobs bounds (as in vLLM, a wider beam is refused:
        start the LLM with a larger max_logprobs).
        concurrency_limit (vLLM's): search that many prompts at a time, None all at once."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        if self.engine.config.runner == "pooling":
            raise ValueError(f"this LLM runs {self.pooling_model_kind()} (runner='pooling'); beam search needs "
                             "runner='generate'")
        max_logprobs = self.engine.config.max_logprobs
        if params.num_candidates > max_logprobs:
            raise ValueError(f"beam_width={params.beam_width} asks for {params.num_candidates} candidate tokens a step "
                             f"(2 x beam_width), more than max_logprobs={max_logprobs}: start the LLM with "
                             f"max_logprobs={params.num_candidates} or more")
        prompts = self.prompt_list(prompts)
        loras = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(loras)} LoRA requests")
        for lora in dict.fromkeys(loras):
            self.engine.check_lora(lora)
        step_params = params.step_params()
        # Every beam grows from its prompt to max_tokens more tokens: checked whole now, as generate's
        # requests are, so that no step fails half-way through the search.
        whole = dataclasses.replace(step_params, max_tokens=params.max_tokens)
        prompt_token_ids, cache_salts = [], []
        for i, prompt in enumerate(prompts):
            try:
                ids = [int(t) for t in self.engine.tokenize(unwrap_prompt(prompt))]
                cache_salts.append(prompt_cache_salt(prompt))
                self.engine.validate(ids, whole)
            except (ValueError, TypeError) as e:
                raise type(e)(f"prompt {i}: {e}") from None
            prompt_token_ids.append(ids)

        def run_step(beams: list[BeamSearchSequence]) -> list[RequestOutput]:
            step_prompts = [{"prompt_token_ids": beam.tokens, "cache_salt": beam.cache_salt} for beam in beams]
            return self.generate(step_prompts, step_params, use_tqdm=False,
                                 lora_request=[beam.lora_request for beam in beams])

        return run_beam_search(prompt_token_ids, loras, params, self.engine.eos_token_ids, run_step,
                               self.decode_with_special_tokens, use_tqdm, concurrency_limit, cache_salts)

    def decode_with_special_tokens(self, token_ids: list[int]) -> str:
        """A beam's text, as vLLM's tokenizer.decode gives it: special tokens (a chat template's) kept."""
        tokenizer = self.engine.tokenizer
        return tokenizer.decode(token_ids, skip_special_tokens=False) if tokenizer is not None else ""

    def embed(self, prompts: str | dict | list[str | dict] | list[int] | list[list[int]],
              pooling_params: PoolingParams | list[PoolingParams] | None = None, use_tqdm: bool = True,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """vLLM's LLM.embed, for an LLM started with runner="pooling": each prompt's embedding, its
        final hidden states pooled as the engine's pooler says (Qwen3-Embedding: the last token's,
        normalised; mini_engine/pooling_params.py). Text gets the tokenizer's special tokens.
        truncate_prompt_tokens: embed each prompt's last k tokens (PoolingParams' own, for all)."""
        if self.engine.config.runner != "pooling":
            raise ValueError("LLM.embed needs an embedding model: LLM(path, runner='pooling')")
        if self.engine.config.pooler.is_cross_encoder:
            raise ValueError("this model is a cross-encoder (classifier_from_token): it scores pairs, LLM.score")
        if self.engine.config.pooler.is_classifier:
            raise ValueError("this model is a sequence classifier (Qwen3ForSequenceClassification), not an embedding "
                             "model: LLM.classify gives its labels' probabilities, LLM.reward its raw scores")
        return self.pool(prompts, pooling_params, use_tqdm, truncate_prompt_tokens, "embed")

    def encode(self, prompts: str | dict | list[str | dict] | list[int] | list[list[int]],
               pooling_params: PoolingParams | list[PoolingParams] | None = None, use_tqdm: bool = True,
               truncate_prompt_tokens: int | None = None,
               pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """vLLM's LLM.encode, the generic call of a pooling model: each prompt's pooled output,
        `outputs.data`. pooling_task (vLLM's): "embed", an embedding model's embedding (as LLM.embed);
        "classify", a sequence classifier's labels' probabilities (as LLM.classify; the raw logits with
        PoolingParams(use_activation=False)) or a cross-encoder's score, one value (as vLLM's one-label
        conversion of Qwen3-Reranker gives it). None: the model's own task, as vLLM picks it (which
        vLLM's latest makes the caller name); one the model cannot do, or a per-token one
        ("token_embed", "token_classify": this engine pools one output a prompt), is a ValueError."""
        if self.engine.config.runner != "pooling":
            raise ValueError("LLM.encode needs a pooling model: LLM(path, runner='pooling')")
        pooler = self.engine.config.pooler
        task = resolve_pooling_task(pooling_task, pooler)
        return [PoolingRequestOutput(out.request_id, out.prompt_token_ids,
                                     PoolingOutput(task_output(out.outputs.embedding, pooler)))
                for out in self.pool(prompts, pooling_params, use_tqdm, truncate_prompt_tokens, task, "Encoding")]

    def pool(self, prompts, pooling_params: PoolingParams | list[PoolingParams] | None, use_tqdm: bool,
             truncate_prompt_tokens: int | None, task: str, desc: str = "Embedding") -> list[EmbeddingRequestOutput]:
        """Runs a pooling engine's prompts: each one's pooled output (an embedding, a cross-encoder's
        classifier probabilities, or a sequence classifier's outputs). task: "embed" or "classify",
        whose parameters the requests may set (check_task_parameters)."""
        prompts = self.prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling_params = [pooling_params or PoolingParams()] * len(prompts)
        if len(pooling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(pooling_params)} pooling params")
        for params in pooling_params:
            check_task_parameters(params, task, self.engine.config.pooler)
        if truncate_prompt_tokens is not None:
            pooling_params = [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens)
                              for p in pooling_params]
        seqs, completion_of, _ = self.run_requests(prompts, pooling_params, [0] * len(prompts), use_tqdm, desc)
        by_prompt = {completion_of[seq.request_id][0]: seq for seq in seqs}
        return [EmbeddingRequestOutput(seq.request_id, seq.prompt_token_ids, EmbeddingOutput(seq.embedding))
                for seq in (by_prompt[i] for i in range(len(prompts)))]

    def score(self, data_1: str | dict | list[int] | list, data_2: str | dict | list[int] | list,
              use_tqdm: bool = True, truncate_prompt_tokens: int | None = None) -> list[ScoringRequestOutput]:
        """vLLM's LLM.score, for a pooling model: each pair of data_1's text (one against many) and
        data_2's, or of the pairs two lists of one length make. An embedding model's score is the
        cosine similarity of the two embeddings (all the texts embedded in one call); a
        cross-encoder's (classifier_from_token: Qwen3-Reranker) is its second classifier token's
        probability, the two texts read as one prompt (in Qwen3-Reranker's template, which the
        caller writes around them, as vLLM's example does); a sequence classifier of one label's
        (as vLLM's, only num_labels == 1) is its sigmoid, the two texts read as one prompt as the
        tokenizer encodes a pair."""
        pooler = self.engine.config.pooler
        if self.engine.config.runner != "pooling":
            raise ValueError("LLM.score needs a pooling model: LLM(path, runner='pooling')")
        num_labels = self.engine.config.model_config.num_labels
        if pooler.is_classifier and num_labels != 1:
            raise ValueError(f"LLM.score needs a classifier of one label (vLLM's Score API: num_labels == 1); this one "
                             f"has {num_labels}: LLM.classify")
        first, second = self.prompt_list(data_1), self.prompt_list(data_2)
        if len(first) != 1 and len(first) != len(second):
            raise ValueError(f"data_1 holds {len(first)} prompts and data_2 {len(second)}: give one data_1, or as "
                             "many as data_2")
        if pooler.is_cross_encoder or pooler.is_classifier:
            pairs = [encode_pair(self.tokenizer, unwrap_prompt(first[0 if len(first) == 1 else i]), unwrap_prompt(b))
                     for i, b in enumerate(second)]
            return [ScoringRequestOutput(out.request_id, out.prompt_token_ids, ScoringOutput(out.outputs.embedding[-1]))
                    for out in self.pool(pairs, None, use_tqdm, truncate_prompt_tokens, "classify", "Scoring")]
        outputs = self.embed(list(first) + list(second), use_tqdm=use_tqdm, truncate_prompt_tokens=truncate_prompt_tokens)
        left, right = outputs[:len(first)], outputs[len(first):]
        pairs = [(left[0 if len(left) == 1 else i], out) for i, out in enumerate(right)]
        return [ScoringRequestOutput(f"{a.request_id}_{b.request_id}", a.prompt_token_ids + b.prompt_token_ids,
                                     ScoringOutput(cosine_similarity(a.outputs.embedding, b.outputs.embedding)))
                for a, b in pairs]

    def classify(self, prompts: str | dict | list[str | dict] | list[int] | list[list[int]],
                 pooling_params: PoolingParams | list[PoolingParams] | None = None, use_tqdm: bool = True,
                 truncate_prompt_tokens: int | None = None) -> list[ClassificationRequestOutput]:
        """vLLM's LLM.classify, for a sequence classifier (config.json's architectures
        Qwen3ForSequenceClassification, which runner "auto" runs as a pooling model): each prompt's
        labels' probabilities, `outputs.probs`: the score head's logits at the prompt's last token
        (as transformers reads them) through a softmax, or a sigmoid for one label (vLLM's rule,
        pooling_params.classifier_activation); PoolingParams(use_activation=False): the raw logits.
        The labels' names are config.json's id2label (llm.engine.config.model_config.labels)."""
        self.check_classifier("LLM.classify")
        outputs = self.pool(prompts, pooling_params, use_tqdm, truncate_prompt_tokens, "classify", "Classifying")
        return [ClassificationRequestOutput(out.request_id, out.prompt_token_ids,
                                            ClassificationOutput(out.outputs.embedding)) for out in outputs]

    def reward(self, prompts: str | dict | list[str | dict] | list[int] | list[list[int]],
               pooling_params: PoolingParams | list[PoolingParams] | None = None, use_tqdm: bool = True,
               truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """A reward model's scores (a sequence classifier such as Skywork-Reward-V2-Qwen3, one label):
        each prompt's score-head logits at its last token, `outputs.data`, raw, as transformers'
        `logits` (the reward such models' cards read), unless a request's PoolingParams set
        use_activation. vLLM's LLM.reward (deprecated there) runs "token_classify", every token's
        activated logits; for a sequence reward model its docs point to classify, whose default
        is the activated score: LLM.classify here."""
        self.check_classifier("LLM.reward")
        prompts = self.prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling_params = [pooling_params or PoolingParams()] * len(prompts)
        raw = [p if p.use_activation is not None else dataclasses.replace(p, use_activation=False)
               for p in pooling_params]
        return [PoolingRequestOutput(out.request_id, out.prompt_token_ids, PoolingOutput(out.outputs.embedding))
                for out in self.pool(prompts, raw, use_tqdm, truncate_prompt_tokens, "classify", "Rewarding")]

    def pooling_model_kind(self) -> str:
        """What a pooling model is, and what it answers."""
        pooler = self.engine.config.pooler
        if pooler.is_classifier:
            return "a sequence classifier: use LLM.classify (or LLM.reward)"
        if pooler.is_cross_encoder:
            return "a cross-encoder: use LLM.score"
        return "an embedding model: use LLM.embed"

    def check_classifier(self, method: str) -> None:
        """A ValueError where this LLM's model is not a sequence classifier, saying what it is."""
        config = self.engine.config
        if config.runner == "pooling" and config.pooler.is_classifier:
            return
        what = ("a generative model (runner='generate')" if config.runner != "pooling" else
                "a cross-encoder (classifier_from_token): LLM.score" if config.pooler.is_cross_encoder else
                "an embedding model: LLM.embed")
        raise ValueError(f"{method} needs a sequence classifier (config.json's architectures "
                         f"Qwen3ForSequenceClassification, run by runner='pooling' or 'auto'); this LLM runs {what}")

    def run_requests(self, prompts: list, params: list[SamplingParams | PoolingParams], priority: list[int],
                     use_tqdm: bool, desc: str, loras: list[LoRARequest | None] | None = None
                     ) -> tuple[list[Sequence], dict[str, tuple[int, int]], dict[str, IncrementalDetokenizer]]:
        """Runs the prompts to the end: their sequences (n of a prompt whose SamplingParams ask for
        n), each one's (prompt, completion) index by request id, and the stop-string matchers of
        those with stop strings. loras: each prompt's LoRA adapter, or None."""
        engine = self.engine
        # A sequence for each completion: n of a prompt whose SamplingParams ask for n.
        num_completions = [p.n if isinstance(p, SamplingParams) else 1 for p in params]
        requests = [(i, k, n, prompt, p.completion(k) if n > 1 else p)
                    for i, (prompt, p, n) in enumerate(zip(prompts, params, num_completions))
                    for k in range(n)]
        # All arrive at once: added in priority order (stable, so ties keep theirs), the requests
        # reach the scheduler as its priority queue would take them.
        requests = iter(sorted(requests, key=lambda r: priority[r[0]]))
        seqs: list[Sequence] = []
        completion_of: dict[str, tuple[int, int]] = {}      # request id -> (prompt, completion)
        # Stop strings are matched on the text as it grows, so that a request that hits one is
        # aborted (its blocks freed) before the engine spends another step on it.
        stoppers: dict[str, IncrementalDetokenizer] = {}
        bar = tqdm(total=sum(num_completions), desc=desc, dynamic_ncols=True, disable=not use_tqdm)
        prefill_tokens = decode_tokens = 0
        start = time.perf_counter()
        try:
            # Requests are validated and added only as the scheduler can take them: before each
            # step, enough that the step is the one it would have been with every request waiting
            # (FCFS admission stops at the token budget or at max_num_seqs; a prompt's prefix-cache
            # hits cost no budget, and add_requests counts them). The first step launches
            # after the host work of its own requests alone, and the rest is done after each
            # launch, while the device runs it: all at once, the host work of the benchmark's 256
            # prompts (~10-20 ms here, about twice that on the H200's host) kept the device waiting
            # before the first step and again before the second (benchmarks/NOTES.md, entries 37
            # and 41). A bad request aborts those already added and fails the call: it still costs
            # the others nothing, and leaves the engine as it found it.
            budget = engine.config.max_num_batched_tokens
            admission = Admission(request_ids=[str(next(engine.request_counter)) for _ in prompts],
                                  priorities=priority, loras=loras or [None] * len(prompts))
            pending = self.add_requests(requests, seqs, completion_of, stoppers, budget, admission)
            while pending or engine.has_unfinished_requests():
                outputs = engine.step()
                if pending:
                    pending = self.add_requests(requests, seqs, completion_of, stoppers, budget, admission)
                prefill_tokens += engine.last_step_prefill_tokens
                decode_tokens += engine.last_step_decode_tokens
                elapsed = time.perf_counter() - start
                bar.set_postfix_str(f"prefill {prefill_tokens / elapsed:.0f} tok/s, "
                                    f"decode {decode_tokens / elapsed:.0f} tok/s", refresh=False)
                done = sum(o.finished for o in outputs)
                if stoppers:
                    done += sum(self.hit_stop_string(o, stoppers) for o in outputs)
                bar.update(done)
        finally:
            bar.close()
            for seq in seqs:           # on an exception (e.g. KeyboardInterrupt) free what is left
                if not seq.is_finished:
                    engine.abort_request(seq.request_id)
        return seqs, completion_of, stoppers

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None,
             lora_request: LoRARequest | list[LoRARequest | None] | None = None,
             chat_template: str | None = None, continue_final_message: bool = False) -> list[RequestOutput]:
        """vLLM's LLM.chat: a conversation (OpenAI's messages), or a list of them, rendered by the
        checkpoint's chat template (as the server's chat endpoint renders it: tools, earlier tool
        calls and reasoning included; chat_template_kwargs such as Qwen3's enable_thinking), then
        generated (lora_request as generate's); each RequestOutput's prompt is the rendered text.
        chat_template (vLLM's): a Jinja template in place of the checkpoint's (also a file's path,
        as the server's --chat-template takes it). continue_final_message (vLLM's): the final
        message is left open and the outputs continue it (a prefilled answer; each output's text is
        the continuation alone); not with add_generation_prompt, which is True unless set False.
        A template that fails to compile or to render, ValueError."""
        try:
            from mini_engine.chat_template import ChatTemplate, load_chat_template, template_message
            from mini_engine.chat_template import continue_final_message as left_open
        except ModuleNotFoundError as e:        # jinja2 comes with the server's extra
            raise ImportError(f"LLM.chat renders chat templates with jinja2: pip install jinja2 ({e})") from None
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be True: the first "
                             "continues the final message, the second starts a new one (pass "
                             "add_generation_prompt=False)")
        model = self.engine.config.tokenizer_path
        if chat_template is not None:
            template = ChatTemplate.from_pretrained(model, load_chat_template(chat_template))
        else:
            if self.chat_template is None:
                self.chat_template = ChatTemplate.from_pretrained(model)
            if self.chat_template is None:
                raise ValueError("this checkpoint has no chat template (tokenizer_config.json's chat_template): "
                                 "give chat_template, or use generate()")
            template = self.chat_template
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        kwargs = dict(chat_template_kwargs or {}) | ({"tools": tools} if tools else {})
        prompts = []
        for conversation in conversations:
            conversation = [template_message(m) for m in conversation]
            text = template.render(conversation, add_generation_prompt, **kwargs)
            prompts.append(left_open(text, conversation) if continue_final_message else text)
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def add_requests(self, requests: Iterator[tuple[int, int, int, object, SamplingParams]], seqs: list[Sequence],
                     completion_of: dict[str, tuple[int, int]], stoppers: dict[str, IncrementalDetokenizer],
                     max_tokens: int, admission: "Admission") -> bool:
        """Validates and adds the next (prompt index, completion index, completions, prompt,
        params) of requests, into seqs and completion_of (and stoppers, where params have stop strings),
        until the engine's waiting requests hold max_tokens tokens to compute or as many requests
        as a step can run. A prompt counts the tokens past the prefix it shares with the cache or
        with a prompt added before it (a prompt's second completion, all but its last block): many
        prompts with one long prefix fill a step as they would with all of them waiting. A bad
        one raises, naming its index. Returns whether requests are left."""
        engine = self.engine
        num_waiting, tokens = engine.waiting_load(admission.prompt_costs)
        while tokens < max_tokens and num_waiting < engine.config.max_num_seqs:
            request = next(requests, None)
            if request is None:
                return False
            i, k, n, prompt, params = request
            try:
                if k == 0:                       # a prompt's completions share its token ids (or embeddings)
                    embeds = prompt_embeds_of(prompt)
                    if embeds is None:
                        admission.last_prompt_ids = engine.tokenize(unwrap_prompt(prompt), params)
                    else:
                        admission.last_prompt_ids, embeds = engine.embeds_prompt(embeds, params)
                    admission.last_prompt_embeds = embeds
                ids = admission.last_prompt_ids
                cache_salt = prompt_cache_salt(prompt)
                engine.validate(ids, params)
            except (ValueError, TypeError) as e:
                for seq in seqs:
                    engine.abort_request(seq.request_id)
                engine.wait_in_flight()          # a launched step, if any: its tokens are dropped
                raise type(e)(f"prompt {i}: {e}") from None
            # One completion takes its prompt's request id; several, vLLM's ids for its children.
            request_id = admission.request_ids[i] if n == 1 else f"{k}_{admission.request_ids[i]}"
            seq = engine.add_request(ids, params, request_id, validated=True, priority=admission.priorities[i],
                                     lora_request=admission.loras[i], cache_salt=cache_salt,
                                     prompt_embeds=admission.last_prompt_embeds)
            completion_of[seq.request_id] = (i, k)
            seqs.append(seq)
            if isinstance(params, SamplingParams) and params.stop:
                stoppers[seq.request_id] = IncrementalDetokenizer.for_request(engine.tokenizer, params)
            cost = engine.block_manager.prompt_cost(ids, admission.shared_blocks, seq.cache_root, seq.block_extra)
            if seq.computes_whole_prompt:       # the cache serves it nothing (prompt_logprobs, a MEAN embedding)
                cost = len(ids)
            # With long_prefill_token_threshold a step computes at most that much of it.
            cost = min(cost, engine.scheduler.max_chunk)
            admission.prompt_costs[seq.request_id] = cost
            tokens += cost
            num_waiting += 1
        return True

    def hit_stop_string(self, out: StepOutput, stoppers: dict[str, IncrementalDetokenizer]) -> bool:
        """Feeds a step's tokens to the request's stop-string matcher; True when a stop string
        ends a request that was still running (it is then aborted, with finish reason "stop")."""
        stopper = stoppers.get(out.seq.request_id)
        if stopper is None or stopper.stopped:
            return False
        _, used = stopper.update_until_stop(out.new_token_ids, out.finished, out.ended_on_stop_token)
        if not stopper.stopped:
            return False
        # A later output of the same step may have ended it or brought it more tokens (a step with
        # drafts runs synchronously, and returns the step in flight's token too): all dropped.
        running = not out.seq.is_finished
        if running:
            self.engine.abort_request(out.seq.request_id)
        # The tokens up to the one that completed the stop string: those the matcher took (and the
        # stop token it leaves out of the text, where this output ended on one and took it).
        kept = len(stopper.token_ids) + (out.ended_on_stop_token and used == len(out.new_token_ids)
                                         and not stopper.include_stop)
        self.engine.drop_last_tokens(out.seq, out.seq.num_output_tokens - kept)
        out.seq.finish_reason = "stop"
        return running

    def to_output(self, prompt, completions: list[tuple[int, Sequence]],
                  stoppers: dict[str, IncrementalDetokenizer]) -> RequestOutput:
        """A prompt's output: its completions in index order (each one sequence)."""
        completions = sorted(completions, key=lambda c: c[0])
        first = completions[0][1]
        embedded = first.prompt_embeds is not None
        prompt = None if embedded else unwrap_prompt(prompt)
        return RequestOutput(
            request_id=first.request_id if len(completions) == 1 else first.request_id.split("_", 1)[1],
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=None if embedded else first.prompt_token_ids,    # none: placeholders stood in
            outputs=[self.to_completion(k, seq, stoppers.get(seq.request_id)) for k, seq in completions],
            finished=True,
            num_cached_tokens=max(seq.num_cached_tokens for _, seq in completions),
            num_preemptions=sum(seq.num_preemptions for _, seq in completions),
            prompt_logprobs=first.prompt_logprobs,
        )

    def to_completion(self, index: int, seq: Sequence, stopper: IncrementalDetokenizer | None) -> CompletionOutput:
        # The text ends before the stop string or stop token (after it, with
        # include_stop_str_in_output); the token ids keep the token that completed it. Without a
        # stopper the engine's stop token is the only "stop", and one decode gives the text (as
        # skip_special_tokens says; none with detokenize=False).
        if stopper is None:
            stopper = IncrementalDetokenizer.for_request(self.engine.tokenizer, seq.sampling_params)
            stopper.update(seq.output_token_ids, finished=True, stop_token=seq.ended_on_stop_token)
        text = stopper.text
        logprobs = seq.logprobs if seq.sampling_params.logprobs is not None else None
        return CompletionOutput(index, text, seq.output_token_ids, seq.finish_reason, logprobs,
                                None if logprobs is None else sum(lp.logprob for lp in logprobs))
