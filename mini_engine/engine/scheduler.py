"""Continuous batching in vLLM v1's style: no prefill or decode phase. Each step every running
sequence gets the tokens it needs to catch up (one for a decode, a chunk of its prompt for a
prefill), under one token budget; then waiting sequences are admitted in FCFS order, or, with
the "priority" policy (vLLM's), by (priority, arrival): a lower value first. When the pool runs
short the last of the running is preempted: the newest under FCFS, the least urgent by priority."""
import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from mini_engine.engine.block_manager import BlockManager
from mini_engine.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)   # tokens each seq computes this step
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, block_manager: BlockManager,
                 max_model_len: int, policy: str = "fcfs", max_loras: int = 0, long_prefill_token_threshold: int = 0):
        self.max_num_seqs = max_num_seqs
        # vLLM's long_prefill_token_threshold: the most prompt tokens one request computes in a step
        # (0: the whole budget), so that a long prompt shares its steps with short ones.
        self.max_chunk = long_prefill_token_threshold or max_num_batched_tokens
        self.max_loras = max_loras          # the LoRA adapters the running requests may use at once
        self.by_priority = policy == "priority"
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        # In admission order (FCFS: the last is the newest) or by priority (the last is the least
        # urgent), so that a step schedules from the front and preempts from the back.
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Rows of the runner's penalty counts (PenaltyState): one for each running penalised
        # request, and at most max_num_seqs run.
        self.free_penalty_rows = list(range(max_num_seqs - 1, -1, -1))

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.place(self.waiting, seq, self.waiting.append)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, with_drafts: bool = False) -> SchedulerOutput:
        """with_drafts: the engine's proposer has set this step's drafts (Sequence.spec_token_ids),
        which grant_drafts fits into what the step leaves."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self.reached_length(seq):
                i += 1                # its last token is still on the device: it ends when that arrives
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget, self.max_chunk)
            while not bm.allocate_slots(seq, n):
                victim = self.running.pop()       # the newest; never one scheduled already
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.seqs.append(seq)
                out.num_new_tokens.append(n)
                budget -= n
                i += 1

        # A step that had to preempt admits nobody: the pool is already short. A request whose
        # grammar still compiles, or whose LoRA adapter would be one too many, stays where it
        # waits, and those behind it go first (as vLLM's).
        skipped = []
        # The running requests' adapters (not gathered without LoRA: this runs every step).
        adapters = set()
        if self.max_loras:
            adapters = {s.lora_int_id for s in self.running if s.lora_request is not None}
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.grammar_compiling is not None or not self.admits_lora(seq, adapters):
                skipped.append(self.waiting.popleft())
                continue
            cached = [] if seq.computes_whole_prompt else bm.find_cached_prefix(seq)
            num_computed = len(cached) * bm.block_size
            n = min(seq.num_tokens - num_computed, budget, self.max_chunk)
            if not bm.allocate_slots(seq, n, cached):
                break
            bm.count_prefix_lookup(seq, cached)
            self.waiting.popleft()
            seq.num_computed_tokens = seq.num_cached_tokens = num_computed
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.perf_counter()
            if seq.sampling_params.penalized:
                seq.penalty_row, seq.penalty_row_filled = self.free_penalty_rows.pop(), False
            self.place(self.running, seq, self.running.append)
            if seq.lora_request is not None:
                adapters.add(seq.lora_int_id)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        if with_drafts:
            self.grant_drafts(out, budget)
        return out

    def admits_lora(self, seq: Sequence, adapters: set[int]) -> bool:
        """Whether seq may run beside the running requests' adapters (their ids): it takes none, its
        own is among them, or they leave room for one more under max_loras."""
        return seq.lora_request is None or seq.lora_int_id in adapters or len(adapters) < self.max_loras

    def grant_drafts(self, out: SchedulerOutput, budget: int) -> None:
        """Each scheduled decode's drafts (Sequence.spec_token_ids, from the engine's proposer),
        cut to what the step leaves: its token budget, max_num_seqs rows (a draft is a row of the
        step, engine.build_rows) and the free blocks. Drafts never preempt nor keep a request waiting.
        A running sequence the step left out loses its drafts: they were for this step, and a later
        one that proposes none (asynchronous) must not verify them."""
        scheduled = set(out.seqs)             # (a Sequence hashes by identity)
        for seq in self.running:
            if seq not in scheduled:
                seq.spec_token_ids.clear()
        rows = len(out.seqs)
        for i, seq in enumerate(out.seqs):
            if not seq.spec_token_ids:
                continue
            room = min(len(seq.spec_token_ids), budget, self.max_num_seqs - rows)
            if out.num_new_tokens[i] != 1 or seq.num_computed_tokens != seq.num_tokens - 1:
                room = 0                        # not a decode: a prompt chunk, or a recomputation
            while room > 0 and not self.block_manager.allocate_slots(seq, 1 + room):
                room -= 1
            del seq.spec_token_ids[room:]
            out.num_new_tokens[i] += room
            budget -= room
            rows += room

    def reached_length(self, seq: Sequence) -> bool:
        if seq.pooling_type is not None:        # an embedding request: its whole prompt, nothing after
            return seq.num_computed_tokens == seq.num_tokens
        return (seq.num_output_tokens >= seq.sampling_params.max_tokens
                or seq.num_tokens >= self.max_model_len)

    def preempt(self, seq: Sequence) -> None:
        """Free seq's blocks and send it back to wait, to be recomputed (its prefix, prompt and
        output alike, may come back from the prefix cache): at the head of the queue under FCFS,
        by (priority, arrival) under priority, which puts it before the later arrivals of its
        priority."""
        self.block_manager.free(seq)
        self.release_penalty_row(seq)
        seq.num_computed_tokens = seq.num_draft_computed = 0
        seq.spec_token_ids.clear()
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.place(self.waiting, seq, self.waiting.appendleft)

    def place(self, queue, seq: Sequence, fcfs_insert) -> None:
        """seq into queue (waiting or running): at its (priority, arrival) place under the priority
        policy, where fcfs_insert puts it under FCFS."""
        if self.by_priority:
            bisect.insort(queue, seq, key=Sequence.scheduling_key)
        else:
            fcfs_insert(seq)

    def release_penalty_row(self, seq: Sequence) -> None:
        if seq.penalty_row >= 0:
            self.free_penalty_rows.append(seq.penalty_row)
            seq.penalty_row = -1

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)
        self.release_penalty_row(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
