"""Speculative decoding's draft model (speculative_config {"method": "draft_model", "model": ...},
vLLM's): a smaller Qwen3 of the target's vocabulary (Qwen3-0.6B beside Qwen3-8B) drafts each
sequence's next k tokens, greedily, and the target verifies them in one step (speculative.py).

The draft runs on a ModelRunner of its own, with a KV cache of its own laid out in the target's
blocks: the same number of blocks of the same size, so that a sequence's block table, which the
target's block manager keeps, says where the draft's K and V of each position lie too. Nothing else
is shared, and the target's steps never run the draft. Under tensor parallelism the draft runs whole
on rank 0's device, in the engine's process (vLLM's draft_tensor_parallel_size 1): the other ranks
see its drafts only as the verifying step's rows, and the pool, the smallest rank's, is rank 0's.

The draft catches up lazily, when it drafts. Sequence.num_draft_computed counts the positions
whose draft K and V are the sequence's; a proposal first runs the draft over the tokens past them
(a whole prompt, the first time: chunks of at most max_num_batched_tokens tokens), the last of
which, the token the target is about to compute, gives the first draft. Then each further draft
is one decode step of the draft over the one before, so that the draft writes the K and V of the
sequence's last token and of its first k - 1 drafts; those steps follow one another on the device
without the host in between. After the target's step, the drafts it
rejected are no longer the sequence's: the engine's resolve_drafts cuts num_draft_computed to the
target's num_computed_tokens there and then, since later steps without drafts (disable_by_batch_size,
no rows to spare) move num_computed_tokens past the rejected drafts' positions; and a proposal
takes the smaller of the two, for a step that never verified its drafts. A sequence
that is preempted starts again from nothing (Scheduler.preempt), since the blocks it takes back
may be another sequence's cached prefix, whose draft K and V the draft may never have written.

A verifying step waits for its tokens before the next step is scheduled, and the host's turn then
(resolving the step, scheduling the next, building the draft's rows) would leave the device idle.
So behind the verifying step the next proposal's catch-up starts at once on a guess, that the
step accepts every draft (launch_ahead): the draft over the last draft and the target's token after
it, both taken from the step's samples on the device. A proposal whose sequences all accepted every
draft starts from it (LaunchedAhead); any other catches up itself, and the guess's K and V, past
the accepted tokens, are written over before anything reads them.

Drafting greedily, the draft gives each position one token and no probabilities: the target keeps
it with the probability its own sampling gives it (speculative.py), so outputs keep the target's
distribution whatever the draft proposes, and only the acceptance rate depends on the draft."""
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from mini_engine.config import EngineConfig
from mini_engine.engine.sequence import Sequence
from mini_engine.host_to_device import to_device
from mini_engine.runner.batch import BatchRow, StepHandle
from mini_engine.runner.cuda_graph import CUDAGraphRunner
from mini_engine.runner.model_runner import GREEDY_ONE_TOKEN, ModelRunner


class DraftModel:
    def __init__(self, config: EngineConfig):
        """The draft's weights, and a pool of one block until share_pool gives it the target's:
        started before the target, so that the target's pool is sized with the draft's weights
        already on the device (kv_bytes_per_token: what each of the target's slots costs the draft)."""
        # Eager until share_pool: graphs captured over the one-block pool would be captured again.
        self.config = config.draft_model_config()
        self.num_speculative_tokens = config.speculative_config.num_speculative_tokens
        self.runner = ModelRunner(self.config)
        self.kv_bytes_per_token = self.runner.kv_bytes_per_token
        self.use_cuda_graphs = (self.runner.device.type == "cuda" and not config.enforce_eager
                                and bool(config.cuda_graph_sizes) and "attention" in self.runner.kernels)
        self.guessed_right = False     # did the last proposal find launch_ahead's guess right (every draft accepted)
        # What went ahead and what a proposal then started from (benchmarks/spec_decode_check.py).
        self.ahead_counts = Counter()
        # Set aside when the target's pool is sized: the draft's graphs' static logits buffer (74 MiB
        # at 256 rows of Qwen3's vocabulary in bf16). Their private pool of activations is not
        # measured (the draft's steps never run before the target's pool is sized): a decode step's,
        # 22 MiB for a 0.6B draft at 64 rows on the H200 (benchmarks/NOTES.md entry 62), comes out
        # of what gpu_memory_utilization leaves.
        self.reserved_bytes = (CUDAGraphRunner.buffer_bytes(config.cuda_graph_sizes, self.runner.model_config.vocab_size,
                                                            self.runner.dtype) if self.use_cuda_graphs else 0)

    def share_pool(self, num_blocks: int) -> None:
        """A KV pool of the target's num_blocks, and the draft's CUDA graphs over it (unless the
        target runs eager)."""
        self.runner.use_cuda_graphs = self.use_cuda_graphs
        self.runner.reallocate_kv_cache(num_blocks)

    def propose(self, seqs: list[Sequence], num_drafts: list[int], ahead: "LaunchedAhead | None" = None) -> "Proposal":
        """num_drafts[i] greedy drafts for seqs[i], whose next num_drafts[i] + 1 positions have
        slots in its block table (Scheduler.grant_drafts), launched and not waited for. The
        catch-up's last step gives each sequence its first draft, and each further draft is one
        step of the draft over the one before. All are launched one after another: each step takes
        its input tokens from the step before's samples on the device (BatchRow.prev_token_index,
        as the engine's asynchronous decode steps do), and behind each, one gather copies its drafts
        into the proposal's tokens, where the target's verifying step, launched next, takes them
        (ModelRunner.launch's prev_tokens). The host reads them once that step has run
        (Proposal.read), so the device goes from drafting to verifying without waiting for it.
        ahead: the catch-up that the verifying step before was followed by (launch_ahead); where it
        guessed every sequence's tokens right, it is this proposal's catch-up, already run."""
        self.guessed_right = ahead is not None and ahead.guessed_right(seqs)
        if self.guessed_right and ahead.handle is not None:
            handle, first_of, known = ahead.handle, {i: ahead.first_draft[seq] for i, seq in enumerate(seqs)}, {}
            self.ahead_counts["catch-ups used"] += 1
        else:
            handle, first_of, known = self.catch_up(seqs)
        # Step j's samples (j >= 1): each sequence still drafting, in order.
        later = [{i: n for n, i in enumerate(i for i in range(len(seqs)) if num_drafts[i] > j)}
                 for j in range(1, max(num_drafts))]
        proposal = Proposal.place(num_drafts, known, [first_of, *later], self.runner.device)
        # (The catch-up's last step always samples: it reaches the last token of every sequence it has.)
        self.runner.take_prev_tokens(proposal.tokens, proposal.gathers[0], handle.samples)
        launched, before = [handle], first_of
        for j, sample_of in enumerate(later, start=1):
            # (A known first draft is the row's token; any other is the step before's sample.)
            rows = [self.row([known.get(i, 0)], seqs[i].num_tokens - 1 + j, seqs[i], sample=True,
                             prev_token_index=before.get(i, -1)) for i in sample_of]
            launched.append(self.runner.launch(rows))
            self.runner.take_prev_tokens(proposal.tokens, proposal.gathers[j], launched[-1].samples)
            before = sample_of
        proposal.handles = launched
        for seq, n in zip(seqs, num_drafts):
            seq.num_draft_computed = seq.num_tokens - 1 + n     # its last token and its first n - 1 drafts
        return proposal

    def catch_up(self, seqs: list[Sequence]) -> tuple[StepHandle, dict[int, int], dict[int, int]]:
        """Runs the draft over each sequence's tokens past its valid draft positions, up to and
        including its last token, in steps of at most max_num_batched_tokens tokens (a row only
        samples in the step that reaches its last token). Returns the last step's handle, where
        among its samples lies the first draft of each sequence that step reached the end of, and
        the first drafts of those an earlier step did (read on the host: a catch-up of more than
        one step is a prompt's, once).

        A catch-up of a few tokens (the steady state: the drafts the target accepted and its own
        token after them) goes in as decode rows, one a token at its own position over the
        sequence's block table, as the target verifies drafts: a step of them replays a CUDA graph,
        where a row of several tokens would run the model eagerly (benchmarks/NOTES.md entry 62).
        Each of those rows samples (a graph samples every row); only the last one's is a draft."""
        short = self.num_speculative_tokens + 1         # a step after k accepted drafts: 2 tokens
        done = [min(seq.num_draft_computed, seq.num_computed_tokens) for seq in seqs]
        handle, sample_of, known = None, {}, {}
        while True:
            budget, spans = self.config.max_num_batched_tokens, []
            for i, seq in enumerate(seqs):
                n = min(seq.num_tokens - done[i], budget)
                if n > 0:
                    spans.append((i, done[i], done[i] + n))
                    done[i], budget = done[i] + n, budget - n
            if not spans:
                return handle, sample_of, known
            # Decode rows only where all of them fit the runner's max_num_seqs rows (its samples'
            # size; up to its largest captured size a step of them replays a graph); else each
            # sequence's tokens go in as one row.
            splits = [end - start <= short and end == seqs[i].num_tokens for i, start, end in spans]
            num_rows = sum(end - start if split else 1 for (_, start, end), split in zip(spans, splits))
            if num_rows > self.config.max_num_seqs:
                splits = [False] * len(spans)
            singles, chunks = [], []
            for (i, start, end), split in zip(spans, splits):
                seq = seqs[i]
                if split:
                    singles += [(i, self.row([seq.token_ids[p]], p, seq, sample=True)) for p in range(start, end)]
                else:
                    chunks.append((i, self.row(seq.token_ids[start:end], start, seq, sample=end == seq.num_tokens)))
            if handle is not None:                  # the step before reached some sequences' last tokens
                tokens, _ = handle.result()
                known |= {i: tokens[n] for i, n in sample_of.items()}
            rows = singles + chunks                 # single tokens first
            samplers = [i for i, row in rows if row.sample]
            # A sequence's first draft is its last sampling row's sample.
            sample_of = {i: n for n, i in enumerate(samplers)}
            handle = self.runner.launch([row for _, row in rows])

    def launch_ahead(self, seqs: list[Sequence], num_tokens: list[int], last_samples: list[int],
                     samples: torch.Tensor) -> "LaunchedAhead":
        """The next proposal's catch-up, launched behind the verifying step on the guess that it
        accepts every draft, so that the device runs it while the host resolves that step and
        schedules the next (otherwise the device waits through that: benchmarks/NOTES.md entry 64).
        For seqs[i]: num_tokens[i], its length if every draft is accepted; last_samples[i], its
        last verifying row's index among the step's samples (samples: where the device holds them).

        Then the catch-up is two tokens a sequence, its last draft and the target's sample after
        it: the verifying step's last two samples, which the rows take on the device
        (ModelRunner.launch's prev_tokens). Where the guess is wrong, the rows wrote K and V past
        the sequence's accepted tokens, which nothing reads before a later step writes them again
        (num_draft_computed is not moved), and the next proposal catches up as before. A wrong
        guess costs a draft step, so the catch-up goes ahead only after a right one; and never
        where a row would fall past the sequence's blocks (the next step grants them, later)."""
        ahead = LaunchedAhead(dict(zip(seqs, num_tokens)))
        if not (self.guessed_right and len(samples) <= self.config.max_num_seqs
                and all(n - 1 < len(seq.block_table) * self.runner.block_size for seq, n in zip(seqs, num_tokens))):
            return ahead
        rows = []
        for seq, n, last in zip(seqs, num_tokens, last_samples):
            rows += [self.row([0], n - 2, seq, sample=True, prev_token_index=last - 1),
                     self.row([0], n - 1, seq, sample=True, prev_token_index=last)]
            ahead.first_draft[seq] = len(rows) - 1
        ahead.handle = self.runner.launch(rows, prev_tokens=samples)
        self.ahead_counts["catch-ups launched"] += 1
        return ahead

    @staticmethod
    def row(token_ids: list[int], start: int, seq: Sequence, sample: bool, prev_token_index: int = -1) -> BatchRow:
        """(With prev_token_index, token_ids' one token stands in for the sample the device fills in.)"""
        return BatchRow(token_ids, start, seq.block_table, sample, GREEDY_ONE_TOKEN if sample else None,
                        block_table_array=seq.block_table_array, prev_token_index=prev_token_index)


@dataclass
class LaunchedAhead:
    """DraftModel.launch_ahead's guess, each sequence's num_tokens if its verifying step accepts
    every draft, and the catch-up launched on it (handle, None where none was; first_draft: each
    sequence's first draft's sample in it)."""
    num_tokens: dict[Sequence, int]
    handle: StepHandle | None = None
    first_draft: dict[Sequence, int] = field(default_factory=dict)

    def guessed_right(self, seqs: list[Sequence]) -> bool:
        """Did every one of seqs accept all its drafts, and its draft K and V stay as the guess
        left them (a preempted sequence starts again from nothing)? Then the catch-up covers them.
        A sequence the guess left out never counts as guessed right."""
        return all(seq in self.num_tokens and seq.num_tokens == self.num_tokens[seq]
                   and seq.num_computed_tokens == seq.num_tokens - 1
                   and seq.num_draft_computed == seq.num_tokens - 2 for seq in seqs)


@dataclass
class Proposal:
    """A proposal's drafts, launched and not waited for. Draft d of sequence i is known[i] on the
    host where d is 0 and an earlier catch-up step read it (a prompt's catch-up of several steps),
    else tokens[offsets[i] + d] on the device once the draft's steps have run. gathers[s]: for each
    place in tokens, which sample of the proposal's step s fills it (-1: another step's);
    sample_of[s]: each sequence's sample in step s. read() waits for the drafts on the host."""
    num_drafts: list[int]
    known: dict[int, int]
    sample_of: list[dict[int, int]]
    offsets: list[int]
    tokens: torch.Tensor
    gathers: torch.Tensor
    handles: list[StepHandle] = field(default_factory=list)

    @classmethod
    def place(cls, num_drafts: list[int], known: dict[int, int], sample_of: list[dict[int, int]],
              device: torch.device) -> "Proposal":
        offsets = np.cumsum([0, *num_drafts[:-1]]).tolist()
        gathers = np.full((len(sample_of), sum(num_drafts)), -1, dtype=np.int64)
        for s, samples in enumerate(sample_of):
            for i, n in samples.items():
                gathers[s, offsets[i] + s] = n
        return cls(num_drafts, known, sample_of, offsets,
                   torch.zeros(sum(num_drafts), dtype=torch.int64, device=device),    # a known draft's place stays 0
                   to_device(torch.from_numpy(gathers), device))

    def token(self, i: int, d: int) -> tuple[int, int]:
        """Draft d of sequence i as a verifying row takes it: (token, -1) where the host knows
        it, else (a placeholder, its place in tokens)."""
        if d == 0 and i in self.known:
            return self.known[i], -1
        return 0, self.offsets[i] + d

    def read(self) -> list[list[int]]:
        """Every sequence's drafts on the host (waits for the draft's steps)."""
        drafts = [[self.known[i]] if i in self.known else [] for i in range(len(self.num_drafts))]
        for handle, samples in zip(self.handles, self.sample_of):
            tokens, _ = handle.result()
            for i, n in samples.items():
                drafts[i].append(tokens[n])
        return drafts
