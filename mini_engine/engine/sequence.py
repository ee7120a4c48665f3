"""A request's state as the engine moves it through waiting, running and finished."""
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, auto

import numpy as np
import torch

from mini_engine.lora import LoRARequest
from mini_engine.pooling_params import PoolingParams
from mini_engine.sampling_params import SamplingParams


# Stands in token_ids for a token sampled by a step still running on the device: the engine
# schedules the next step before it knows the token (the runner feeds it from the device).
PENDING_TOKEN = -1


def check_cache_salt(cache_salt) -> None:
    """A ValueError for a cache_salt that is not a string (nor None), before the request is queued:
    hashing an unhashable one would fail the step that first looks up its blocks."""
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt must be a string, got {cache_salt!r}")


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    token_ids: list[int] = field(default_factory=list)    # prompt, then output tokens
    # Tokens whose k/v are in the cache. After a decode step this is num_tokens - 1: the token
    # just sampled is computed in the next step. Preemption resets it to 0.
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0          # of those, found in the prefix cache at the last admission
    # time.perf_counter() at its first admission (the server's queue and prefill times; on Linux
    # the API process reads the same clock).
    first_scheduled_time: float | None = None
    block_table: list[int] = field(default_factory=list)
    # The same table as a fixed-width array padded with -1, kept in step by the block manager, so
    # that a step copies each row's table as one array slice, not block by block from the list.
    block_table_array: np.ndarray | None = field(default=None, repr=False)
    block_hashes: list[int] = field(default_factory=list)  # chained hash of each full block
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None    # "stop", "length" or "abort"
    num_preemptions: int = 0
    pending_sample_index: int = -1      # where the in-flight step's samples hold this seq's token
    logprobs: list = field(default_factory=list)    # a SampleLogprobs per output token, if asked
    grammar: object | None = None       # with structured outputs: its OutputGrammar, once compiled
    # With structured outputs, until the grammar is compiled: the compile (a Future), while the
    # scheduler leaves the sequence waiting.
    grammar_compiling: object | None = None
    # With a reasoning parser: the output is in its thought, which its grammar does not hold; or
    # (may_think) the output's first token may open one instead of starting the grammar.
    thinking: bool = False
    may_think: bool = False
    bad_words_ids: list[list[int]] | None = None    # its bad words as token ids (engine/bad_words.py)
    # Ended "stop" with no stop token of its own: its grammar allowed nothing the request permits
    # (min_tokens' banned stop tokens, allowed_token_ids), and that last draw was dropped.
    grammar_dead_end: bool = False
    # Where prompt_logprobs asks: a SampleLogprobs per prompt position, filled as its chunks run
    # (by position, so a chunk computed again after a preemption writes the same values); [0] stays None.
    prompt_logprobs: list | None = None
    # A penalised request's row of the runner's penalty counts while it runs (-1: none), given by
    # the scheduler at admission; filled from token_ids at the first step that samples in it.
    penalty_row: int = -1
    penalty_row_filled: bool = False
    # The "priority" scheduling policy's order: a lower priority value first, then the earlier arrival.
    priority: int = 0
    arrival: int = 0
    # An embedding request's (runner "pooling"; its sampling_params are then a placeholder, never
    # sampled): its PoolingParams and the engine's pooling type, each pooled chunk's share by its
    # start (layers/pooler.py) and, once the whole prompt is computed, its embedding (a
    # cross-encoder's: its classifier tokens' probabilities).
    pooling_params: PoolingParams | None = None
    pooling_type: str | None = None
    pooled_shares: dict = field(default_factory=dict)
    embedding: list[float] | None = None
    # With speculative decoding: the drafts proposed for this step (mini_engine/speculative.py), which
    # the scheduler may cut to what the step has room for; the engine clears them when they resolve.
    spec_token_ids: list[int] = field(default_factory=list)
    ngram_index: object | None = field(default=None, repr=False)   # the proposer's (speculative.NgramIndex)
    # With a draft model: the positions whose draft K and V it has written (runner/draft_model.py),
    # and, while this step's drafts are on the device only, where the verifying step takes each
    # (its row's prev_token_index: a place in the proposal's tokens; -1: spec_token_ids holds it).
    num_draft_computed: int = 0
    draft_places: list[int] = field(default_factory=list)
    # With enable_lora: the adapter it runs with, or None (the base model).
    lora_request: LoRARequest | None = None
    # A prompt given as its embeddings (enable_prompt_embeds): [num_prompt_tokens, hidden] on the
    # host, its token ids placeholders; and what each block's prefix-cache key holds beside its ids
    # (prompt_embeds.BlockDigests: block i -> its rows' digest, None past the prompt).
    prompt_embeds: torch.Tensor | None = field(default=None, repr=False)
    block_extra: Callable[[int], str | None] | None = field(default=None, repr=False)
    # vLLM's cache_salt: its prefix-cache blocks serve only requests of the same salt, so that one
    # tenant cannot learn from hit timings what another's prompts hold. None (or empty, as in
    # vLLM): the blocks every unsalted request shares.
    cache_salt: str | None = None
    # With custom logits processors: what they are told of it (logits_processors.LogitsRequest).
    logits_request: object | None = field(default=None, repr=False)

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id, 0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def cache_root(self) -> int | None:
        """What its first block's hash chains from (BlockManager), so every later block's differs
        too: None for the base model, unsalted; an adapter's own root, since the same tokens under
        another adapter have other K and V; a salt's, from that, as vLLM mixes cache_salt into the
        first block's hash alone. Each kind is tagged, so that a salt never stands for an adapter
        (vLLM's untagged extra keys let a LoRA name equal to a salt share blocks: its issue 44701)."""
        root = None if self.lora_request is None else hash(("lora", self.lora_request.lora_int_id))
        return hash(("cache_salt", root, self.cache_salt)) if self.cache_salt else root

    def __post_init__(self):
        check_cache_salt(self.cache_salt)
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def ended_on_stop_token(self) -> bool:
        """The output's last token is a stop token (stop_token_ids or EOS), whose text, as in
        vLLM, is not part of the output: the engine's only "stop" but a grammar's dead end."""
        return self.finish_reason == "stop" and not self.grammar_dead_end

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Does some prompt position still lack its log-probabilities (so the prefix cache may not
        serve this sequence's prompt)?"""
        return self.prompt_logprobs is not None and None in self.prompt_logprobs[1:]

    @property
    def computes_whole_prompt(self) -> bool:
        """Must every prompt token be computed, none served by the prefix cache? (Its prompt
        log-probabilities, or a MEAN embedding, read every position's hidden state.)"""
        return self.needs_prompt_logprobs or self.pooling_type == "MEAN"

    def prompt_logprob_targets(self, start: int, num_tokens: int) -> np.ndarray:
        """The prompt tokens that positions [start, start + num_tokens) predict (start before the
        prompt's last position): token_ids[start + 1 : ...] up to the prompt's end."""
        end = min(start + num_tokens, self.num_prompt_tokens - 1)
        return np.asarray(self.token_ids[start + 1:end + 1], dtype=np.int64)

    def scheduling_key(self) -> tuple[int, int]:
        return self.priority, self.arrival

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def tokens_before_newest(self) -> np.ndarray:
        """token_ids[:-1] as an int64 array: every token but the newest, which a step in flight
        may still be sampling (only the newest can be)."""
        tokens = np.asarray(self.token_ids[:-1], dtype=np.int64)
        if (tokens == PENDING_TOKEN).any():
            raise RuntimeError(f"request {self.request_id}: a token before the newest is still in flight")
        return tokens
