"""The step loop: requests in, one scheduled batch through the model per step, tokens out."""
import atexit
import concurrent.futures
import gc
import itertools
import logging
import os
import time
import warnings
from dataclasses import dataclass

import torch

from mini_engine.config import EngineConfig
from mini_engine.engine.bad_words import bad_word_bans, bad_words_token_ids, check_bad_words
from mini_engine.engine.block_manager import BlockManager
from mini_engine.engine.prompt_embeds import PLACEHOLDER_TOKEN, BlockDigests, check_prompt_embeds
from mini_engine.engine.request_limits import RequestLimits
from mini_engine.engine.scheduler import Scheduler, SchedulerOutput
from mini_engine.engine.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from mini_engine.layers.pooler import chunk_chain, finish_pooled
from mini_engine.layers.sampler import SampleLogprobs
from mini_engine.logits_processors import LogitsRequest, OutputTokens
from mini_engine.lora import LoRARequest
from mini_engine.pooling_params import PoolingParams, truncate_prompt
from mini_engine.reasoning import ThinkTokens
from mini_engine.runner.batch import BatchRow, StepHandle
from mini_engine.runner.draft_model import DraftModel, LaunchedAhead, Proposal
from mini_engine.runner.model_runner import ModelRunner
from mini_engine.runner.sleep_mode import SLEEP_TAGS
from mini_engine.sampling_params import SamplingParams
from mini_engine.speculative import NgramIndex, SpecDecodeStats, ngram_drafts, num_accepted
from mini_engine.structured_outputs import GrammarCompiler
from mini_engine.tokenizer import encode_prompt, load_tokenizer

# Engines freeze the heap they start with (LLMEngine.__init__); unfrozen at exit, so that the
# interpreter's shutdown still frees it (Triton's bindings report leaked objects otherwise).
atexit.register(gc.unfreeze)

logger = logging.getLogger("mini_engine.engine")

# An embedding request's Sequence.sampling_params: the scheduler reads a request's, and this one is
# never sampled (a pooling engine has no lm_head).
POOLING_PLACEHOLDER = SamplingParams(temperature=0.0, max_tokens=1)

# After a step whose proposer found no drafts, the steps that skip the proposer (and so keep async
# scheduling) before it looks again: 1, then twice as many each time it finds none, at most this
# many. Looking costs a synchronous step, 25-35% of a small batch's time on the H200 where the
# drafts give nothing (benchmarks/NOTES.md, entry 54); a repetition that starts is found this many
# steps late at worst.
MAX_DRAFT_BACKOFF_STEPS = 16


@dataclass
class InFlightStep:
    """A launched step: the sequences whose tokens it samples, in the runner's row order, and
    where in each sequence's token_ids the token goes. (A sequence with drafts, seq.spec_token_ids,
    has a sample for its last token and one for each draft, in its rows' order.)"""
    handle: StepHandle
    samples: list[tuple[Sequence, int]]
    # The sequences whose prompt log-probabilities it computes, in the runner's row order, and the
    # prompt position of each one's first.
    prompt_logprob_rows: list[tuple[Sequence, int]]
    # The embedding requests that pool in it, in the runner's row order, and their chunks' (start, end).
    pooled_rows: list[tuple[Sequence, int, int]]

    def first_samples(self) -> list[tuple[Sequence, int, int]]:
        """Each sequence, where its token goes, and the index of its first sample among the step's."""
        out, first = [], 0
        for seq, position in self.samples:
            out.append((seq, position, first))
            first += 1 + len(seq.spec_token_ids)
        return out


@dataclass
class StepOutput:
    seq: Sequence
    new_token_ids: list[int]
    finished: bool
    logprobs: list[SampleLogprobs] | None = None    # one per new token, where the request asked

    @property
    def ended_on_stop_token(self) -> bool:
        """The last new token is a stop token (stop_token_ids or EOS): the engine's only "stop"."""
        return self.finished and self.seq.ended_on_stop_token


class LLMEngine:
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None):
        """`runner` lets tests drive the scheduling logic with a stand-in for the model."""
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer_path)
        if self.tokenizer is not None:
            # The largest id, not the count: a vocabulary may have gaps.
            largest = max(self.tokenizer.get_vocab(with_added_tokens=True).values())
            if largest >= config.model_config.vocab_size:
                raise ValueError(f"the tokenizer at {config.tokenizer_path} has token id {largest}, past the model's "
                                 f"vocab_size of {config.model_config.vocab_size}")
        # With a reasoning parser, a grammar holds only what follows the output's thought. (Before
        # the runner starts: a tensor-parallel one's processes and group would outlive this error.)
        self.think_tokens = ThinkTokens.from_tokenizer(self.tokenizer) if config.reasoning_parser else None
        # A draft model starts first: the target's KV pool is sized with the draft's weights on the
        # device and each slot's draft K and V counted (runner/draft_model.py).
        spec = config.speculative_config
        self.draft = DraftModel(config) if runner is None and spec is not None and spec.method == "draft_model" else None
        self.runner = runner or ModelRunner(config, kv_bytes_beside=self.draft.kv_bytes_per_token if self.draft else 0,
                                            bytes_beside=self.draft.reserved_bytes if self.draft else 0)
        if self.draft is not None:
            self.draft.share_pool(self.runner.num_kv_blocks)
        # The runner's custom logits processors (None without; a test's stand-in runner has none).
        self.logits_processors = getattr(self.runner, "logits_processors", None)
        if self.logits_processors is not None:
            self.logits_processors.before_update = self.fill_in_flight_tokens
        # (A test's stand-in runner keeps no host tier.)
        num_host_blocks = getattr(self.runner, "num_host_kv_blocks", 0)
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.block_size, config.enable_prefix_caching,
                                          max_blocks_per_seq=-(-config.max_model_len // config.block_size),
                                          num_host_blocks=num_host_blocks)
        if num_host_blocks:
            logger.info("KV offloading: %d blocks of %d tokens in host memory (%.2f GiB a rank), %.1fx the KV pool",
                        num_host_blocks, config.block_size,
                        sum(slot.nbytes for slot in self.runner.host_kv_slots) / 2**30,
                        num_host_blocks / self.runner.num_kv_blocks)
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, self.block_manager,
                                   config.max_model_len, config.scheduling_policy,
                                   config.max_loras if config.enable_lora else 0, config.long_prefill_token_threshold)
        mc = config.model_config
        self.limits = RequestLimits(mc.vocab_size, config.max_model_len, config.block_size,
                                    self.block_manager.num_blocks, self.tokenizer is not None, config.max_logprobs,
                                    tuple(mc.eos_token_ids), config.runner == "pooling", mc.hidden_size,
                                    mc.is_matryoshka, mc.matryoshka_dimensions,
                                    self.runner.dtype if config.enable_prompt_embeds else None,
                                    config.logits_processors)
        if config.num_kv_blocks is None and self.limits.max_sequence_tokens() < config.max_model_len:
            # vLLM refuses to start here; requests that fit the pool still run, so this one warns,
            # and each request the pool can never hold is refused with its own error.
            sized_by = ("kv_cache_memory_bytes" if config.kv_cache_memory_bytes is not None
                        else "gpu_memory_utilization (cpu_kv_blocks on CPU)")
            warnings.warn(f"the KV pool holds {self.block_manager.num_blocks} blocks of {config.block_size} tokens, "
                          f"fewer than one max_model_len={config.max_model_len} sequence: longer requests will "
                          f"be refused. Raise {sized_by} or lower max_model_len")
        self.in_flight: InFlightStep | None = None
        self.grammar_compiler: GrammarCompiler | None = None     # made at the first structured request
        self.compiling: set[str] = set()        # the requests whose grammars are compiling
        # The unfinished requests whose next row needs the token in flight, which the host must
        # know (the runner feeds it to the model, not to host-side logic): a grammar's, or a bad
        # word's of several tokens.
        self.needs_last_token: set[str] = set()
        self.eos_token_ids = frozenset(config.model_config.eos_token_ids)
        self.requests: dict[str, Sequence] = {}
        self.request_counter = itertools.count()
        self.arrivals = itertools.count()
        self.last_step_prefill_tokens = 0    # prompt tokens (prompt or recomputed) the last step ran
        self.last_step_decode_tokens = 0     # tokens the last step generated from decode rows
        self.spec_decode_stats = SpecDecodeStats()     # with speculative_config: its drafts' fate
        self.proposal: tuple[list[Sequence], Proposal] | None = None   # a draft model's, on the device
        self.draft_ahead: LaunchedAhead | None = None      # the next proposal's start, on a guess
        self.profiler, self.profile_dir = None, None       # start_profile's
        # vLLM's pause_generation (server/engine_process.py EngineLoop): no step runs, and weights
        # may change under the requests it froze.
        self.paused = False
        self.draft_backoff = 0              # steps left that skip the proposer (MAX_DRAFT_BACKOFF_STEPS)
        self.next_draft_backoff = 1
        # Everything alive now (imported modules, the model, compiled kernels) lives as long as the
        # engine. Frozen, it is left out of the garbage collector's full passes, which otherwise
        # scanned it all and stalled the step loop for 120-170 ms each (seen mid-run on the H200).
        # vLLM does the same after start-up.
        gc.collect()
        gc.freeze()

    def shutdown(self) -> None:
        """Stops the other tensor-parallel ranks' processes and leaves their process group (they
        stop at exit too); then this process may start another tensor-parallel engine."""
        for runner in self.runners():
            runner.shutdown()

    # ---- requests ----

    def tokenize(self, prompt: str | list[int], params: SamplingParams | PoolingParams | None = None) -> list[int]:
        """An embedding engine's text gets the tokenizer's special tokens (Qwen3-Embedding's
        <|endoftext|>, whose state it pools), as vLLM's embedding path adds them; a request's
        truncate_prompt_tokens (PoolingParams' or SamplingParams') keeps the prompt's last tokens,
        before the request is validated."""
        ids = encode_prompt(self.tokenizer, prompt, add_special_tokens=self.config.runner == "pooling")
        return ids if params is None else truncate_prompt(ids, params, self.config.max_model_len)

    def embeds_prompt(self, prompt_embeds, params) -> tuple[list[int], torch.Tensor]:
        """A prompt given as its embeddings: its placeholder token ids and the embeddings as the
        engine keeps them (engine/prompt_embeds.py), cut to the request's truncate_prompt_tokens."""
        embeds = check_prompt_embeds(prompt_embeds, params, self.config.model_config.hidden_size,
                                     self.config.max_model_len, self.limits.prompt_embeds_dtype)
        return [PLACEHOLDER_TOKEN] * embeds.shape[0], embeds

    def detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer else ""

    def validate(self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams) -> None:
        """Raises ValueError for a request that could never run; it then touches no engine state."""
        self.limits.validate(prompt_token_ids, params)

    def add_request(self, prompt: str | list[int], params: SamplingParams | PoolingParams,
                    request_id: str | None = None, validated: bool = False, priority: int = 0,
                    lora_request: LoRARequest | None = None, cache_salt: str | None = None,
                    prompt_embeds: torch.Tensor | None = None) -> Sequence:
        """params: SamplingParams, or an embedding engine's PoolingParams. validated: the caller
        has already passed these token ids and params to validate() (a batch is validated whole
        before any of it is added), so the prompt is not checked twice. priority: with
        scheduling_policy "priority", a lower value is scheduled first (vLLM's). lora_request:
        the LoRA adapter it runs with (enable_lora), None for the base model. cache_salt (vLLM's):
        its prefix-cache blocks serve only requests of the same salt (Sequence.cache_salt).
        prompt_embeds: the prompt as its embeddings (engine/prompt_embeds.py, enable_prompt_embeds),
        in place of prompt (then ignored), checked and truncated by embeds_prompt unless validated."""
        if prompt_embeds is not None:
            if not validated:
                prompt, prompt_embeds = self.embeds_prompt(prompt_embeds, params)
            prompt_token_ids = list(prompt)
        else:
            prompt_token_ids = self.tokenize(prompt, params)
        if not validated:
            self.validate(prompt_token_ids, params)
        self.config.check_priority(priority)
        self.check_lora(lora_request)
        request_id = request_id if request_id is not None else str(next(self.request_counter))
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(params, PoolingParams):
            seq = Sequence(request_id, prompt_token_ids, POOLING_PLACEHOLDER, priority=int(priority),
                           arrival=next(self.arrivals), pooling_params=params,
                           pooling_type=self.config.pooler.pooling_type, cache_salt=cache_salt)
            self.requests[request_id] = seq
            self.scheduler.add(seq)
            return seq
        seq = Sequence(request_id, prompt_token_ids, params, priority=int(priority), arrival=next(self.arrivals),
                       lora_request=lora_request, cache_salt=cache_salt, prompt_embeds=prompt_embeds,
                       block_extra=None if prompt_embeds is None else BlockDigests(prompt_embeds, self.config.block_size))
        self.draft_backoff, self.next_draft_backoff = 0, 1     # the proposer looks at a new prompt at once
        stop_token_ids = self.stop_token_ids(params)
        if params.bad_words:            # before anything of the engine's changes: it may raise
            seq.bad_words_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
            check_bad_words(seq.bad_words_ids, params, stop_token_ids)
        if params.structured_outputs is not None:
            if self.grammar_compiler is None:
                self.grammar_compiler = GrammarCompiler(self.tokenizer, self.config.model_config.vocab_size,
                                                        sorted(self.eos_token_ids))
            seq.grammar_compiling = self.grammar_compiler.compile(params.structured_outputs)
            if self.think_tokens is not None:
                tag = self.think_tokens.prompt_tag(self.tokenizer, prompt_token_ids)
                seq.thinking, seq.may_think = tag == self.think_tokens.start, tag is None
            self.compiling.add(request_id)
            self.needs_last_token.add(request_id)
        if seq.bad_words_ids and any(len(ids) > 1 for ids in seq.bad_words_ids):
            self.needs_last_token.add(request_id)
        if self.config.logits_processors:
            seq.logits_request = LogitsRequest(request_id, params,
                                               None if prompt_embeds is not None else seq.prompt_token_ids,
                                               OutputTokens(seq))
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def stop_token_ids(self, params: SamplingParams) -> frozenset[int]:
        """The tokens that end a request: EOS and its own stop_token_ids."""
        return self.eos_token_ids | frozenset(params.stop_token_ids)

    def check_lora(self, lora_request: LoRARequest | None) -> None:
        """A ValueError, before the request touches the engine, for an adapter the engine cannot
        run: LoRA not enabled, or the adapter's files (read here once, then kept: AdapterCache)."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {lora_request!r}")
        if not self.config.enable_lora:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r}: start the engine with enable_lora=True "
                             "(--enable-lora)")
        self.runner.lora.check(lora_request)

    def waiting_load(self, prompt_costs: dict[str, int]) -> tuple[int, int]:
        """The waiting requests, and the tokens of theirs the next step could compute: a request never
        run yet counts prompt_costs[its id] where that has it (its prompt less the prefix the cache
        was to hold for it, BlockManager.prompt_cost), one preempted all it must recompute; each at
        most long_prefill_token_threshold."""
        waiting = self.scheduler.waiting
        tokens = 0
        for seq in waiting:
            left = seq.num_tokens - seq.num_computed_tokens
            cost = prompt_costs.get(seq.request_id, left) if seq.num_preemptions == 0 else left
            tokens += min(cost, self.scheduler.max_chunk)      # what a step can give it
        return len(waiting), tokens

    def abort_request(self, request_id: str) -> None:
        seq = self.requests.pop(request_id, None)
        self.needs_last_token.discard(request_id)
        self.stop_compiling(request_id, seq)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, "abort")
            while seq.token_ids[-1] == PENDING_TOKEN:     # tokens still in flight are dropped
                seq.token_ids.pop()

    @staticmethod
    def drop_last_tokens(seq: Sequence, count: int) -> None:
        """Cuts a finished sequence's last count output tokens (and their logprobs): those a step
        of speculative decoding made after a stop string ended the output."""
        if count > 0:
            del seq.token_ids[-count:]
            if seq.sampling_params.logprobs is not None:
                del seq.logprobs[-count:]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self.in_flight is not None

    # ---- the step ----

    def step(self) -> list[StepOutput]:
        """Schedules and launches step n, then waits for step n-1's tokens and returns them.

        With async_scheduling the host's work for step n (scheduling, block allocation, input
        tensors) overlaps the device's step n-1: a token step n-1 samples is a PENDING_TOKEN on
        the host until it arrives, and the device feeds it to step n itself. A sequence that step
        n-1 ends by a stop token has computed one token too many in step n, which is dropped; one
        that reaches its length is not scheduled again. Without async_scheduling each step waits
        for its own tokens before returning, and so does a step with speculative decoding's drafts:
        they follow each sequence's newest token, and the step after follows from how many of them
        were accepted."""
        self.last_step_prefill_tokens = self.last_step_decode_tokens = 0
        ahead, self.draft_ahead = self.draft_ahead, None       # for this step's proposal only
        try:
            early = self.wait_for_last_tokens() + self.start_compiled_grammars()
            speculating = self.speculates()
            if speculating:
                early += self.wait_in_flight()
                self.propose_drafts()
            batch = self.scheduler.schedule(with_drafts=speculating)
            self.move_kv()
            if self.config.enable_lora:
                early += self.read_adapters(batch)
            if speculating and self.draft is not None:
                self.draft_tokens(batch, ahead)
            if batch.is_empty and self.in_flight is None and self.compiling and not early:
                self.wait_for_a_grammar()
            launched = self.launch(batch) if not batch.is_empty else None
            early += self.end_refused_requests()
            if self.proposal is not None and launched is not None:
                self.draft_ahead = self.launch_ahead(launched)
            previous, self.in_flight = self.in_flight, launched
            outputs = early + (self.resolve(previous) if previous else [])
            if (not self.config.async_scheduling or speculating) and launched is not None:
                self.in_flight = None
                self.read_drafts()
                outputs += self.resolve(launched)
        except BaseException:
            self.block_manager.reset_prefix_cache()     # what the failed step hashed may hold no KV
            self.proposal = self.draft_ahead = None
            for seq in self.scheduler.running:          # drafts (or a draft model's places) never verified
                seq.spec_token_ids.clear()
                seq.draft_places.clear()
            raise
        return outputs

    def speculates(self) -> bool:
        """Does this step propose drafts? With speculative_config, unless more requests are running
        or waiting than its disable_by_batch_size (vLLM's): a large batch keeps the device busy
        without drafts, and its steps keep async scheduling. Nor while the proposer backs off, after
        finding none (MAX_DRAFT_BACKOFF_STEPS)."""
        spec = self.config.speculative_config
        if spec is None or (spec.method == "draft_model" and self.draft is None):    # (a test's stand-in runner)
            return False
        limit = spec.disable_by_batch_size
        if limit is not None and len(self.scheduler.running) + len(self.scheduler.waiting) > limit:
            return False
        if self.draft_backoff > 0:
            self.draft_backoff -= 1
            return False
        return True

    def propose_drafts(self) -> None:
        """Each running decode's drafts for the next step (mini_engine/speculative.py), as many as
        its request may still take, while the step has rows to spare: each draft is a row. A request
        whose next tokens depend on the ones before in ways a row cannot see gets none: penalties
        (counts on the device), a grammar's or a bad word's state (needs_last_token); nor does a
        prompt given as embeddings, whose placeholder ids a proposer would read as its tokens. Where it
        looked and found none, the proposer backs off (MAX_DRAFT_BACKOFF_STEPS)."""
        spec = self.config.speculative_config
        spare_rows = self.config.max_num_seqs - len(self.scheduler.running)
        looked = found = False
        for seq in self.scheduler.running:
            room = self.draft_room(seq, seq.num_tokens, spare_rows)
            if (room <= 0 or seq.num_computed_tokens != seq.num_tokens - 1 or seq.sampling_params.penalized
                    or seq.request_id in self.needs_last_token or seq.prompt_embeds is not None):
                seq.spec_token_ids = []
                continue
            if self.draft is not None:
                # Places for the draft model's tokens: it drafts once the step has granted them slots.
                seq.spec_token_ids = [PENDING_TOKEN] * room
            else:
                if seq.ngram_index is None:
                    seq.ngram_index = NgramIndex()
                seq.spec_token_ids = ngram_drafts(seq.token_ids, seq.ngram_index, spec.prompt_lookup_min,
                                                  spec.prompt_lookup_max, room)
            spare_rows -= len(seq.spec_token_ids)
            looked, found = True, found or bool(seq.spec_token_ids)
        if found:
            self.next_draft_backoff = 1
        elif looked:
            self.draft_backoff = self.next_draft_backoff
            self.next_draft_backoff = min(2 * self.next_draft_backoff, MAX_DRAFT_BACKOFF_STEPS)

    def draft_room(self, seq: Sequence, num_tokens: int, spare_rows: int) -> int:
        """How many drafts seq may take at num_tokens tokens: the most speculative_config gives, as
        many as its request may still take, while the step has rows to spare."""
        spec = self.config.speculative_config
        return min(spec.num_speculative_tokens, spare_rows,
                   seq.sampling_params.max_tokens - (num_tokens - seq.num_prompt_tokens) - 1,
                   self.config.max_model_len - num_tokens - 1)

    def launch_ahead(self, verifying: InFlightStep) -> LaunchedAhead | None:
        """The draft model's next catch-up started behind the verifying step, on the guess that it
        accepts every draft (DraftModel.launch_ahead), for the proposal's sequences that would draft
        again (draft_room: not one that the step ends at max_tokens or max_model_len, nor past the
        rows to spare): each one's length then, and its last verifying sample. (The rows are an
        estimate: a sequence left out that drafts after all makes the next proposal catch up
        itself.) Only a head start: where it fails, the next proposal catches up as it would have
        (and the step, launched, must still be resolved)."""
        seqs, proposal = self.proposal
        where = {seq: (position, first) for seq, position, first in verifying.first_samples()}
        guess = []
        spare_rows = self.config.max_num_seqs - len(self.scheduler.running)
        for seq, drafts in zip(seqs, proposal.num_drafts):
            position, first = where[seq]
            num_tokens = position + drafts + 1
            room = self.draft_room(seq, num_tokens, spare_rows)
            if room > 0:
                guess.append((seq, num_tokens, first + drafts))
                spare_rows -= room
        if not guess:
            return None
        try:
            return self.draft.launch_ahead(*map(list, zip(*guess)), verifying.handle.samples)
        except Exception as e:
            logger.warning("the draft model's launch ahead of the next proposal failed (%s: %s); the next "
                           "proposal catches up instead", type(e).__name__, e)
            return None

    def draft_tokens(self, batch: SchedulerOutput, ahead: LaunchedAhead | None) -> None:
        """The draft model's tokens for the places the step granted (propose_drafts, then
        Scheduler.grant_drafts, which gave them slots), launched: the verifying step takes them on
        the device (Sequence.draft_places), and the host reads them when it resolves that step
        (read_drafts). Under tensor parallelism the host reads them first: the other ranks take
        them as the rows' tokens. ahead: the catch-up launched behind the step before, on the
        guess that it accepted every draft (DraftModel.launch_ahead)."""
        seqs = [seq for seq in batch.seqs if seq.spec_token_ids]
        if not seqs:
            return
        proposal = self.draft.propose(seqs, [len(seq.spec_token_ids) for seq in seqs], ahead)
        if self.runner.workers is not None:
            for seq, drafts in zip(seqs, proposal.read()):
                seq.spec_token_ids[:] = drafts
            return
        for i, seq in enumerate(seqs):
            placed = [proposal.token(i, d) for d in range(len(seq.spec_token_ids))]
            seq.spec_token_ids[:] = [token for token, _ in placed]     # placeholders but for a known first draft
            seq.draft_places = [place for _, place in placed]
        self.proposal = (seqs, proposal)

    def read_drafts(self) -> None:
        """The launched proposal's drafts, on the host (its verifying step has been launched)."""
        if self.proposal is None:
            return
        (seqs, proposal), self.proposal = self.proposal, None
        for seq, drafts in zip(seqs, proposal.read()):
            seq.spec_token_ids[:] = drafts
            seq.draft_places = []

    def wait_for_last_tokens(self) -> list[StepOutput]:
        """While a request that needs_last_token runs (structured outputs, bad words of several
        tokens), the step in flight's tokens first: its next row's mask or bans need the token in
        flight. One still waiting to run has no token in flight, and holds nobody up."""
        if self.in_flight is None or not any(self.requests[r].status == SequenceStatus.RUNNING
                                             for r in self.needs_last_token):
            return []
        return self.wait_in_flight()

    def fill_in_flight_tokens(self) -> None:
        """With custom logits processors, just before they run (the new step's forward already
        queued behind the step in flight): that step's tokens, waited for and written over their
        placeholders, so that a processor reads each request's output as it is, newest token
        included. vLLM's runner waits there too. The step is resolved as before, after the launch;
        the host only learns its tokens sooner, and scheduling still overlapped it."""
        step = self.in_flight
        if step is None:
            return
        tokens, _ = step.handle.result()
        for seq, position, first in step.first_samples():
            if position < len(seq.token_ids) and seq.token_ids[position] == PENDING_TOKEN:
                seq.token_ids[position] = tokens[first]

    def end_refused_requests(self) -> list[StepOutput]:
        """The requests whose admission a custom logits processor's update_state failed on
        (LogitsProcessors.find_refused): each ends "abort", with a warning, as a request whose LoRA
        adapter can no longer be read does; the step and the other requests go on."""
        if self.logits_processors is None or not self.logits_processors.failed:
            return []
        outputs = []
        for request_id, why in self.logits_processors.take_failed():
            seq = self.requests.get(request_id)
            if seq is None or seq.is_finished:
                continue
            logger.warning("request %s: a logits processor failed as it joined the batch (%s): it ends", request_id, why)
            self.abort_request(request_id)
            outputs.append(StepOutput(seq, [], True))
        return outputs

    def start_compiled_grammars(self) -> list[StepOutput]:
        """Each request whose grammar has compiled gets its matcher, and may be scheduled from now
        on. One whose grammar failed to compile (StructuredOutputsParams.check, which validate()
        runs, finds bad specs before this) ends "abort", and the others go on."""
        outputs = []
        for request_id in [r for r in self.compiling if self.requests[r].grammar_compiling.done()]:
            seq = self.requests[request_id]
            compiled, seq.grammar_compiling = seq.grammar_compiling, None
            self.compiling.discard(request_id)
            try:
                seq.grammar = self.grammar_compiler.matcher(compiled.result(),
                                                            sorted(self.stop_token_ids(seq.sampling_params)))
            except Exception as e:      # whatever it was, it ends this request only
                logger.warning("request %s: its grammar did not compile: %s", request_id, e)
                self.end(seq, "abort")
                outputs.append(StepOutput(seq, [], True))
        return outputs

    def read_adapters(self, batch: SchedulerOutput) -> list[StepOutput]:
        """Every LoRA adapter the batch runs, in a slot or in host memory before the step launches
        (LoRAAdapters.prepare: one that max_cpu_loras evicted since its requests were added is read
        again here), so that the runner's step reads no file. One that can no longer be read (its
        folder deleted or damaged) ends every request that runs it "abort", with a warning, and
        leaves the batch: the step, and every other request, go on as if they had never been sent."""
        failed = set()
        for request in {s.lora_int_id: s.lora_request for s in batch.seqs if s.lora_request is not None}.values():
            try:
                self.runner.lora.prepare(request)
            except Exception as e:      # whatever it was, it ends this adapter's requests only
                logger.warning("LoRA adapter %r (id %d, %s) can no longer be read, its requests end: %s",
                               request.lora_name, request.lora_int_id, request.lora_path, e)
                failed.add(request.lora_int_id)
        if not failed:
            return []
        kept = [i for i, seq in enumerate(batch.seqs) if seq.lora_int_id not in failed]
        batch.seqs = [batch.seqs[i] for i in kept]
        batch.num_new_tokens = [batch.num_new_tokens[i] for i in kept]
        outputs = []
        for seq in [seq for seq in self.requests.values() if seq.lora_int_id in failed]:
            # The blocks this schedule hashed for tokens that will now never be computed.
            self.block_manager.forget_uncomputed(seq)
            self.abort_request(seq.request_id)
            outputs.append(StepOutput(seq, [], True))
        return outputs

    def wait_for_a_grammar(self) -> None:
        """Nothing runs but grammars compile: waits until one is done, or briefly, so that a caller
        who adds requests between steps (the server's engine process) is not held up."""
        concurrent.futures.wait([self.requests[r].grammar_compiling for r in self.compiling], timeout=0.05,
                                return_when=concurrent.futures.FIRST_COMPLETED)

    def move_kv(self) -> None:
        """The host tier's copies that scheduling decided, queued at once: before anything that
        could end the step's requests and free their blocks (whose loads must still come before a
        later store of them)."""
        bm = self.block_manager
        if bm.kv_stores or bm.kv_loads:
            self.runner.move_kv(*bm.take_kv_transfers())

    def wait_in_flight(self) -> list[StepOutput]:
        """Waits for the step in flight, if one is, and returns its outputs."""
        step, self.in_flight = self.in_flight, None
        return self.resolve(step) if step else []

    def launch(self, batch: SchedulerOutput) -> InFlightStep:
        rows, order, owners = self.build_rows(batch)
        try:
            handle = (self.runner.launch(rows) if self.proposal is None
                      else self.runner.launch(rows, prev_tokens=self.proposal[1].tokens))
        except BaseException:
            # The failed launch may have recorded samples in penalty rows that never reach the
            # host: the retried step fills each row again from the host's tokens.
            for seq in batch.seqs:
                seq.penalty_row_filled = False
            raise
        samples, num_samples = [], 0
        prompt_logprob_rows = [(batch.seqs[i], row.start_position + 1) for i, row in zip(owners, rows)
                               if row.prompt_logprob_targets is not None]
        pooled_rows = [(batch.seqs[i], row.start_position, row.start_position + len(row.token_ids))
                       for i, row in zip(owners, rows) if row.pooling is not None]
        for i in order:
            seq, n = batch.seqs[i], batch.num_new_tokens[i]
            n -= len(seq.spec_token_ids) if n > 1 else 0   # the drafts' tokens count once accepted (resolve)
            is_decode = n == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens
            self.last_step_decode_tokens += is_decode
            self.last_step_prefill_tokens += 0 if is_decode else n
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens and seq.pooling_type is None:   # not a prefill chunk: it samples
                seq.penalty_row_filled = seq.penalty_row >= 0       # the launch filled it, if it was not
                # With drafts the next token is the accepted ones' successor, known on the host only:
                # such a step is resolved before the next is scheduled (step), so no row reads it here.
                seq.pending_sample_index = -1 if seq.spec_token_ids else num_samples
                num_samples += 1 + len(seq.spec_token_ids)
                samples.append((seq, seq.num_tokens))
                seq.token_ids.append(PENDING_TOKEN)
        return InFlightStep(handle, samples, prompt_logprob_rows, pooled_rows)

    def resolve(self, step: InFlightStep) -> list[StepOutput]:
        tokens, logprobs = step.handle.result()
        logprobs = logprobs or [None] * len(tokens)
        for (seq, position), values in zip(step.prompt_logprob_rows, step.handle.prompt_logprobs or []):
            seq.prompt_logprobs[position:position + len(values)] = values
        outputs = self.resolve_pooled(step) if step.pooled_rows else []
        for seq, position, first in step.first_samples():
            if seq.spec_token_ids:
                end = first + 1 + len(seq.spec_token_ids)
                outputs += self.resolve_drafts(seq, position, tokens[first:end], logprobs[first:end])
                continue
            token, lp = tokens[first], logprobs[first]
            if seq.is_finished:
                continue                          # aborted, or ended by the step before
            if seq.grammar is not None:
                opens_thought, seq.may_think = seq.may_think and token == self.think_tokens.start, False
                if seq.thinking or opens_thought:
                    seq.thinking = token != self.think_tokens.end       # the grammar holds what follows
                elif not seq.grammar.accept(token):
                    # Every token the grammar allowed was banned (min_tokens' stop tokens, or
                    # allowed_token_ids), so the draw is not one: it is dropped, and the output ends.
                    del seq.token_ids[position:]
                    seq.grammar_dead_end = True
                    self.end(seq, "stop")
                    outputs.append(StepOutput(seq, [], True, None))
                    continue
            seq.token_ids[position] = token
            if lp is not None:
                seq.logprobs.append(lp)
            reason = self.finish_reason(seq, token, position + 1)
            if seq.grammar is not None and not seq.thinking and seq.grammar.is_terminated:
                reason = reason or "stop"       # complete: it took a stop token, even one ignore_eos ignores
            if reason:
                del seq.token_ids[position + 1:]     # a token computed past a stop is dropped
                self.end(seq, reason)
            outputs.append(StepOutput(seq, [token], reason is not None, None if lp is None else [lp]))
        return outputs

    def resolve_drafts(self, seq: Sequence, position: int, sampled: list[int], logprobs: list) -> list[StepOutput]:
        """A verifying step's samples for seq (mini_engine/speculative.py): the drafts they confirm
        and the first sample that differs, or the last one, up to the first token that ends the
        request. The confirmed drafts' K and V, written by the step, are the sequence's from now on."""
        drafts, seq.spec_token_ids = seq.spec_token_ids, []
        if seq.is_finished:
            return []                             # aborted
        accepted = num_accepted(drafts, sampled)
        self.spec_decode_stats.record(len(drafts), accepted)
        new_tokens, reason = [], None
        for token in sampled[:accepted + 1]:
            new_tokens.append(token)
            reason = self.finish_reason(seq, token, position + len(new_tokens))
            if reason:
                break
        seq.token_ids[position:] = new_tokens
        seq.num_computed_tokens += accepted
        # A draft model's K and V past the accepted drafts are the rejected ones': not the
        # sequence's, even once later steps without drafts compute past them (runner/draft_model.py).
        seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed_tokens)
        kept = logprobs[:len(new_tokens)]
        if kept[0] is not None:
            seq.logprobs += kept
        if reason:
            self.end(seq, reason)
        return [StepOutput(seq, new_tokens, reason is not None, None if kept[0] is None else kept)]

    def resolve_pooled(self, step: InFlightStep) -> list[StepOutput]:
        """Each pooling row's share of its prompt's vector (layers/pooler.py): kept by its chunk's
        start under MEAN; the prompt's last chunk gives the request its embedding, and ends it."""
        outputs = []
        for (seq, start, end), share in zip(step.pooled_rows, step.handle.pooled):
            if seq.is_finished:
                continue                          # aborted
            if seq.pooling_type == "MEAN":
                seq.pooled_shares[start] = (end, share)
            if end < seq.num_prompt_tokens:
                continue
            pooled = share if seq.pooling_type == "LAST" else chunk_chain(seq.pooled_shares, end) / end
            seq.embedding = finish_pooled(pooled, seq.pooling_params, self.config.pooler)
            seq.pooled_shares = {}
            self.end(seq, "stop")
            outputs.append(StepOutput(seq, [], True))
        return outputs

    def end(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self.requests.pop(seq.request_id, None)
        self.needs_last_token.discard(seq.request_id)

    def stop_compiling(self, request_id: str, seq: Sequence | None) -> None:
        """A request that ends while its grammar compiles: the compile is called off if it has not
        started and no other request waits for it (GrammarCompiler.compile then queues it again for
        a later one)."""
        if request_id not in self.compiling:
            return
        self.compiling.discard(request_id)
        if seq is not None and not any(self.requests[r].grammar_compiling is seq.grammar_compiling
                                       for r in self.compiling):
            seq.grammar_compiling.cancel()

    def build_rows(self, batch: SchedulerOutput) -> tuple[list[BatchRow], list[int], list[int]]:
        """Rows in the runner's order, the batch indices in that order, and each row's batch index:
        single-token rows first, the longest context first. The decode attention kernel starts its
        programs in row order, so the longest contexts start first and the launch does not end on
        one of them (longest processing time first: benchmarks/NOTES.md entry 19). A sequence with
        drafts is a decode row and one more for each draft (draft_rows)."""
        seqs, num_new = batch.seqs, batch.num_new_tokens
        order = sorted(range(len(seqs)), reverse=True,
                       key=lambda i: seqs[i].num_computed_tokens if num_new[i] == 1 or seqs[i].spec_token_ids else -1)
        rows, owners = [], []
        for i in order:
            seq, n = seqs[i], num_new[i]
            start = seq.num_computed_tokens
            if seq.spec_token_ids and n > 1:
                rows += self.draft_rows(seq)
                owners += [i] * n
                continue
            owners.append(i)
            if seq.pooling_type is not None:      # an embedding request's chunk: it pools, never samples
                last = start + n == seq.num_tokens
                rows.append(BatchRow(seq.token_ids[start:start + n], start, seq.block_table, False,
                                     block_table_array=seq.block_table_array,
                                     pooling=seq.pooling_type if last or seq.pooling_type == "MEAN" else None))
                continue
            sample = start + n == seq.num_tokens
            p = seq.sampling_params
            seed = hash((p.seed, seq.num_output_tokens)) & 0x7FFFFFFF if sample and p.seed is not None else None
            row = BatchRow(seq.token_ids[start:start + n], start, seq.block_table, sample, p, seed,
                           seq.block_table_array, lora_request=seq.lora_request)
            if seq.prompt_embeds is not None and start < seq.num_prompt_tokens:
                # A copy, not a view: under tensor parallelism the row is pickled, a view with its
                # whole storage.
                row.prompt_embeds = seq.prompt_embeds[start:min(start + n, seq.num_prompt_tokens)].clone()
            if row.token_ids[-1] == PENDING_TOKEN:        # sampled by the step still in flight
                row.prev_token_index = seq.pending_sample_index
            if sample and p.penalized:
                row.penalty_row = seq.penalty_row
                if not seq.penalty_row_filled:
                    row.history, row.num_prompt_tokens = seq.tokens_before_newest(), seq.num_prompt_tokens
            if sample and p.min_tokens:
                row.num_output_tokens = seq.num_output_tokens
            if sample and seq.grammar is not None and not seq.thinking:
                assert row.token_ids[-1] != PENDING_TOKEN, "a grammar's row waits for its token (wait_for_last_tokens)"
                row.grammar_bitmask = seq.grammar.next_token_bitmask(
                    self.think_tokens.start if seq.may_think else None)
            if sample and seq.logits_request is not None:
                row.logits_request = seq.logits_request
            if sample and seq.bad_words_ids:
                row.banned_tokens = bad_word_bans(seq.bad_words_ids, seq.token_ids, seq.num_prompt_tokens)
            # Only a row inside the prompt predicts prompt tokens (and so a decode row never scans
            # the request's prompt log-probabilities).
            if start < seq.num_prompt_tokens - 1 and seq.needs_prompt_logprobs:
                row.prompt_logprob_targets = seq.prompt_logprob_targets(start, n)
                row.num_prompt_logprobs = p.prompt_logprobs
            rows.append(row)
        return rows, order, owners

    def draft_rows(self, seq: Sequence) -> list[BatchRow]:
        """A decode row for seq's last token and one for each draft, each a token at its own
        position over the same block table: row i attends up to its own position, so the drafts
        before it and none after (mini_engine/speculative.py). Row i samples the request's output
        token num_output_tokens + i, with that token's seed, min_tokens count and bad-word bans."""
        p, start = seq.sampling_params, seq.num_computed_tokens
        tokens = [seq.token_ids[-1], *seq.spec_token_ids]
        places = [-1, *seq.draft_places] if seq.draft_places else [-1] * len(tokens)
        rows = []
        for i, (token, place) in enumerate(zip(tokens, places)):
            output_index = seq.num_output_tokens + i
            seed = hash((p.seed, output_index)) & 0x7FFFFFFF if p.seed is not None else None
            row = BatchRow([token], start + i, seq.block_table, True, p, seed, seq.block_table_array,
                           num_output_tokens=output_index if p.min_tokens else 0, lora_request=seq.lora_request,
                           prev_token_index=place)
            if seq.bad_words_ids:
                # (Single-token bad words only: a longer one needs the last token, and so no drafts,
                # whose values the host may not know yet here.)
                row.banned_tokens = bad_word_bans(seq.bad_words_ids, seq.token_ids + tokens[1:i + 1],
                                                  seq.num_prompt_tokens)
            rows.append(row)
        return rows

    def finish_reason(self, seq: Sequence, token: int, num_tokens: int) -> str | None:
        """Why seq ends with token, its num_tokens-th (pending tokens after it don't count)."""
        p = seq.sampling_params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if num_tokens - seq.num_prompt_tokens >= p.max_tokens or num_tokens >= self.config.max_model_len:
            return "length"
        return None

    # ---- between generations: weights, the prefix cache, sleep mode ----

    def reset_prefix_cache(self, reset_connector: bool = False) -> bool:
        """vLLM's: forgets every cached prefix block, so that no later request reads K and V computed
        before (by older weights); with reset_connector, the host tier's too (kv_offloading_size),
        which vLLM's connector keeps otherwise. False, with a warning and nothing changed, while
        requests hold KV blocks, as vLLM's block pool refuses then."""
        held = self.block_manager.num_blocks - self.block_manager.num_free_blocks
        if held or self.in_flight is not None:
            logger.warning("the prefix cache was not reset: unfinished requests hold %d KV blocks", held)
            return False
        self.block_manager.reset_prefix_cache(host_tier=reset_connector)
        self.move_kv()          # the host tier's stores of the blocks the pool forgot
        return True

    def check_no_requests(self, what: str, frozen_ok: bool = False) -> None:
        """Weights change, and memory goes, only between generations: a request running across an
        update would mix the two models' KV, and its blocks would keep the prefix cache from resetting.
        frozen_ok: unless generation is paused (vLLM's pause_generation), whose frozen requests hold
        no KV block, or are meant to keep theirs across new weights (its clear_cache=False)."""
        if frozen_ok and self.paused and self.in_flight is None:
            return
        if self.has_unfinished_requests():
            raise RuntimeError(f"{what} while {len(self.requests)} requests are unfinished: let them finish, "
                               "abort them or pause generation first (LLM.generate returns with none left)")

    def preempt_running(self) -> list[StepOutput]:
        """vLLM's reset_running_requests: every running request back to wait, its blocks freed, to
        recompute its prompt and output when it runs again (after new weights, say). Waits for the
        step in flight first; returns its outputs."""
        outputs = self.wait_in_flight()
        for seq in reversed(self.scheduler.running):      # the newest first: they wait in their order
            self.scheduler.preempt(seq)
        self.scheduler.running.clear()
        self.proposal = self.draft_ahead = None
        return outputs

    def load_weights(self, weights) -> int:
        """Checkpoint-named tensors written into the model in place (runner/weight_updates.py); then
        the prefix cache is reset. Returns how many tensors were written."""
        self.check_no_requests("load_weights", frozen_ok=True)
        num_written = self.runner.load_weights(weights)
        # Every cached block is stale now, a frozen request's too (paused generation's): it always resets.
        self.block_manager.reset_prefix_cache()
        return num_written

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (runner/sleep_mode.py): level 1 offloads the weights to the host, level 2
        discards them; both discard the KV cache (and so the prefix cache). A draft model sleeps with
        the target, its weights offloaded at either level: load_weights gives the target's alone."""
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep mode is off: start the engine with enable_sleep_mode=True")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (weights offloaded to the host) or 2 (weights discarded), "
                             f"got {level!r}")
        if level == 2 and self.config.quantization in ("awq", "gptq"):
            raise ValueError(f"sleep(level=2) discards the weights for load_weights to give again, which "
                             f"{self.config.quantization.upper()}'s 4-bit weights cannot be: use level 1 (offloaded "
                             f"to the host)")
        if self.is_sleeping():
            logger.warning("the engine is already asleep")
            return
        # Paused, requests may wait through a sleep if none holds K and V, which it would lose.
        self.check_no_requests("sleep", frozen_ok=self.block_manager.num_free_blocks == self.block_manager.num_blocks)
        # Level 1's weights come back as they were: the host tier keeps the pool's blocks, and
        # takes them before the pool's memory goes.
        self.block_manager.reset_prefix_cache(host_tier=level == 2)
        self.move_kv()
        if self.draft is not None:
            self.draft.runner.sleep(1)
        try:
            self.runner.sleep(level)
        except BaseException:
            if self.draft is not None:      # (its host copy's allocation, say): both stay awake
                self.draft.runner.wake_up(list(SLEEP_TAGS))
            raise

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wakes the tags given ("weights", "kv_cache"; None: both), as vLLM's; a tag not asleep is
        left alone, with a warning."""
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep mode is off: start the engine with enable_sleep_mode=True")
        tags = list(SLEEP_TAGS if tags is None else tags)
        if unknown := [tag for tag in tags if tag not in SLEEP_TAGS]:
            raise ValueError(f"wake_up tags must be among {list(SLEEP_TAGS)}, got {unknown}")
        if awake := [tag for tag in tags if tag not in self.sleeping_tags()]:
            logger.warning("wake_up: %s not asleep", ", ".join(awake))
        # Each runner its own tags: a wake-up that failed part way (out of memory) can be called again.
        for runner in self.runners():
            woken = [tag for tag in SLEEP_TAGS if tag in tags and tag in runner.sleep_state.sleeping_tags]
            if woken:
                runner.wake_up(woken)

    def start_profile(self, profile_dir: str | None = None) -> None:
        """torch.profiler over this process (CPU, and CUDA on a GPU) until stop_profile (vLLM's
        start_profile): its trace goes into profile_dir, or $VLLM_TORCH_PROFILER_DIR as vLLM's.
        Under tensor parallelism, rank 0's process alone."""
        profile_dir = profile_dir or os.environ.get("VLLM_TORCH_PROFILER_DIR")
        if not profile_dir:
            raise ValueError("start_profile needs a folder for the trace: profile_dir, or VLLM_TORCH_PROFILER_DIR "
                             "in the environment (vLLM's)")
        if self.profiler is not None:
            raise RuntimeError("a profile is already running: stop_profile() first")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.runner.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        os.makedirs(profile_dir, exist_ok=True)
        profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        profiler.start()
        self.profiler, self.profile_dir = profiler, profile_dir

    def stop_profile(self) -> str:
        """Ends start_profile's recording; writes its Chrome trace (chrome://tracing, Perfetto) and
        returns the file's path."""
        if self.profiler is None:
            raise RuntimeError("no profile is running: start_profile() first")
        profiler, self.profiler = self.profiler, None
        profiler.stop()
        path = os.path.join(self.profile_dir, f"mini_engine_trace_{os.getpid()}_{time.time_ns()}.json")
        profiler.export_chrome_trace(path)
        return path

    def runners(self) -> list[ModelRunner]:
        """The target's runner, and the draft model's with one: what sleeps and wakes."""
        return [self.runner] if self.draft is None else [self.runner, self.draft.runner]

    def sleeping_tags(self) -> set[str]:
        return set().union(*(runner.sleep_state.sleeping_tags for runner in self.runners()))

    def is_sleeping(self) -> bool:
        """True from sleep() until every tag is awake again (the draft model's too)."""
        return bool(self.sleeping_tags())

    # ---- what it can report ----

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def prefix_cache_hit_tokens(self) -> int:
        return self.block_manager.prefix_cache_hit_tokens

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions
