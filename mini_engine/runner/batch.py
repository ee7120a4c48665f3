"""What crosses between the engine and the runner each step: the rows of a batch going in (and
the device buffers their integer inputs travel to), and a handle on the sampled tokens coming out."""
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from mini_engine.lora import LoRARequest
from mini_engine.sampling_params import SamplingParams


@dataclass(slots=True)
class BatchRow:
    """One sequence's share of a step: its new tokens and where their context lives."""
    token_ids: list[int]        # the tokens computed this step
    start_position: int         # position of token_ids[0]
    block_table: list[int]
    sample: bool                # does this row produce a token (its last token is the newest)?
    params: SamplingParams | None = None
    seed: int | None = None     # this step's seed for the row, where the request gave one
    block_table_array: np.ndarray | None = None   # block_table padded with -1, if the caller keeps one
    prev_token_index: int = -1  # >= 0: the input token is sample [this] of the previous launch
    # For a sampling row with penalties: its request's row of the runner's PenaltyState and, at the
    # first step in that row, what fills it: the tokens before this step's newest (which the host
    # may not know yet), prompt then output, and how many are the prompt's.
    penalty_row: int = -1
    history: np.ndarray | None = None
    num_prompt_tokens: int = 0
    # For a sampling row whose request sets min_tokens: its output tokens before this step's sample.
    num_output_tokens: int = 0
    # Where the request asks for prompt_logprobs: the prompt tokens that this row's first tokens
    # predict (token_ids[1:], and the next chunk's first; only a prompt's), and how many top ones.
    prompt_logprob_targets: np.ndarray | None = None
    num_prompt_logprobs: int = 0
    # For a sampling row with structured outputs: the tokens its grammar allows next, as a bitmask
    # (structured_outputs.OutputGrammar's).
    grammar_bitmask: torch.Tensor | None = None
    # For a sampling row with bad words: the tokens that would complete one now.
    banned_tokens: list[int] | None = None
    # For an embedding request's row that pools this step (layers/pooler.py): its pooling type,
    # "LAST" (its prompt's last chunk) or "MEAN" (every chunk). It never samples.
    pooling: str | None = None
    # With enable_lora: the adapter the row's request runs with (None: the base model).
    lora_request: LoRARequest | None = None
    # For a row of a prompt given as embeddings (enable_prompt_embeds): the embeddings of its first
    # len(prompt_embeds) tokens, the prompt's, in place of their (placeholder) token ids.
    prompt_embeds: torch.Tensor | None = None
    # With custom logits processors: its request as they know it (logits_processors.LogitsRequest).
    logits_request: object | None = None


@dataclass(slots=True)
class StepTensors:
    """A step's inputs on the device: views into StepInputBuffers."""
    input_ids: torch.Tensor        # [T] int64 (where prev_index >= 0, filled on the device)
    positions: torch.Tensor        # [T] int64
    slot_mapping: torch.Tensor     # [T] int64, -1 where a token writes no KV (padding)
    prev_index: torch.Tensor       # [T] int64: >= 0, the input token is that sample of the previous launch
    seeds: torch.Tensor            # [N] int64: each sampling row's random stream for this step
    seq_lens: torch.Tensor         # [R] int32
    query_start_loc: torch.Tensor  # [R + 1] int32
    block_tables: torch.Tensor     # [R, W] int32
    temperatures: torch.Tensor     # [N] float32, 0 = greedy
    prefill_work: torch.Tensor     # [I, 4] int32: the varlen attention kernel's work items (eager steps with prefill)
    top_k: torch.Tensor            # [N] int32: the row's top_k where kernels/top_k_sampling.py draws it, else 0
    top_p: torch.Tensor            # [N] float32: that row's top_p
    lora_slots: torch.Tensor       # [T] int32: each token's LoRA adapter slot, -1 for none (and padding)
    logits_indices: torch.Tensor   # [S] int64: the token whose logits each sampling row uses


# StepTensors' fields in the order they lie in the buffer, with their dtypes. logits_indices is
# last: its length is the step's own count of sampling rows, which a CUDA graph's layout (N = its
# batch size, padding rows greedy) does not fix, so no other array's offset may depend on it.
# (prefill_work is empty in every decode step, so a graph's layout never moves with it either.)
STEP_FIELDS = (("input_ids", torch.int64), ("positions", torch.int64), ("slot_mapping", torch.int64),
               ("prev_index", torch.int64), ("seeds", torch.int64), ("seq_lens", torch.int32),
               ("query_start_loc", torch.int32), ("block_tables", torch.int32), ("temperatures", torch.float32),
               ("prefill_work", torch.int32), ("top_k", torch.int32), ("top_p", torch.float32),
               ("lora_slots", torch.int32), ("logits_indices", torch.int64))
_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}


class StepInputBuffers:
    """One device buffer for every step's inputs, reached by one host-to-device copy a step.

    The host packs a step's arrays (STEP_FIELDS, in that order, of three dtypes) into one pinned
    byte array, and it crosses in one asynchronous copy: one copy a step instead of one per array
    (each copy's latency is paid by the device, in front of the step's first kernel). The step's
    tensors are views at offsets that depend only on its sizes, so a CUDA graph captured on the
    views of a bs-row decode step reads the inputs of every later step laid out for bs where they
    land: no copy into separate graph buffers before a replay.

    The runner keeps two, one for each turn of its launches (consecutive launches take turns). With
    a copy stream the pack crosses on it while the step before (the other turn's) still runs, and the
    current stream waits for it; the copy first waits until the launch that last read this buffer
    is done (release()). So no copy sits between two steps on the device (benchmarks/NOTES.md,
    entry 41)."""

    # Each array starts on a 128-byte boundary. Triton specialises a kernel on whether each pointer
    # is 16-byte aligned: with offsets that moved with the step's sizes, a fresh machine compiled
    # new variants during the run (benchmarks/NOTES.md, entry 24).
    ALIGN_BYTES = 128

    def __init__(self, max_tokens: int, max_rows: int, max_blocks: int, max_work_items: int, device: torch.device,
                 copy_stream: torch.cuda.Stream | None = None):
        sizes = self.sizes(max_tokens, max_rows, max_blocks, max_rows, max_rows, max_work_items)
        self.data = torch.zeros(self.offsets(sizes)[-1], dtype=torch.uint8, device=device)
        self.copy_stream = copy_stream
        # copied: the last pack has landed; released: the steps queued before release() are done.
        self.copied = self.released = None
        if copy_stream is not None:
            self.copied, self.released = torch.cuda.Event(), torch.cuda.Event()

    def release(self) -> None:
        """The next pack may land once the work queued so far on the current stream is done."""
        if self.released is not None:
            self.released.record()

    @staticmethod
    def sizes(num_tokens: int, num_rows: int, table_width: int, num_sample_slots: int,
              num_samples: int, num_work_items: int) -> list[int]:
        """Each field's length, in STEP_FIELDS' order. num_sample_slots: the length of the seeds,
        temperatures, top_k and top_p (a graph's batch size, or the step's sampling rows);
        num_samples: logits_indices'."""
        t, r, n = num_tokens, num_rows, num_sample_slots
        return [t, t, t, t, n, r, r + 1, r * table_width, n, 4 * num_work_items, n, n, t, num_samples]

    @classmethod
    def offsets(cls, sizes: list[int]) -> list[int]:
        """Where each field starts in bytes, and (last) where the last one ends."""
        out, end = [], 0
        for size, (_, dtype) in zip(sizes, STEP_FIELDS):
            start = -(-end // cls.ALIGN_BYTES) * cls.ALIGN_BYTES
            out.append(start)
            end = start + size * dtype.itemsize
        return out + [end]

    def _views(self, sizes: list[int], offsets: list[int], num_rows: int, table_width: int) -> StepTensors:
        tensors = [self.data[o:o + n * dtype.itemsize].view(dtype)
                   for o, n, (_, dtype) in zip(offsets, sizes, STEP_FIELDS)]
        tensors[7] = tensors[7].view(num_rows, table_width)
        tensors[9] = tensors[9].view(-1, 4)
        return StepTensors(*tensors)

    def stage(self, parts: list, num_tokens: int, num_rows: int, table_width: int, num_sample_slots: int,
              num_samples: int, num_work_items: int) -> StepTensors:
        """Packs the parts (in STEP_FIELDS' order, block tables as one [rows, width] array) at
        their offsets and copies the pack to the device."""
        sizes = self.sizes(num_tokens, num_rows, table_width, num_sample_slots, num_samples, num_work_items)
        offsets = self.offsets(sizes)
        # The caching host allocator hands out pinned memory, and does not reuse it before the
        # copy from it has run: packs of steps in flight never overwrite each other.
        host = torch.empty(offsets[-1], dtype=torch.uint8, pin_memory=self.data.is_cuda)
        packed = host.numpy()
        for part, start, size, (_, dtype) in zip(parts, offsets, sizes, STEP_FIELDS):
            packed[start:start + size * dtype.itemsize].view(_NUMPY_DTYPES[dtype])[:] = np.ravel(part)
        if self.copy_stream is None:
            self.data[:offsets[-1]].copy_(host, non_blocking=True)
        else:
            self.copy_stream.wait_event(self.released)
            with torch.cuda.stream(self.copy_stream):
                self.data[:offsets[-1]].copy_(host, non_blocking=True)
                self.copied.record()
            torch.cuda.current_stream(self.data.device).wait_event(self.copied)
        return self._views(sizes, offsets, num_rows, table_width)


class StepHandle:
    """A launched step's sampled tokens (and log-probabilities, where asked), on their way to the
    host. finish turns the extras' host lists into (the sampling rows' logprobs, the prompt
    log-probabilities of the rows that asked), either None. pooled: the pooling rows' vectors, a
    [rows, hidden] fp32 array, in their row order (layers/pooler.py), or None. samples: the sampled
    tokens where the device holds them, for work queued behind the step (a draft model's proposal
    gathers its drafts from them: runner/draft_model.py); a CUDA graph's, overwritten two launches
    later."""

    def __init__(self, tokens: list[int] | None = None, logprobs: list | None = None,
                 host: list[torch.Tensor] | None = None, ready: torch.cuda.Event | None = None,
                 finish: Callable[..., tuple[list | None, list | None]] | None = None,
                 prompt_logprobs: list | None = None, pooled: np.ndarray | None = None,
                 pooled_host: torch.Tensor | None = None, samples: torch.Tensor | None = None):
        self.tokens, self.logprobs, self.host, self.ready, self.finish = tokens, logprobs, host, ready, finish
        self.samples = samples
        self.prompt_logprobs = prompt_logprobs
        self.pooled, self.pooled_host = pooled, pooled_host

    @classmethod
    def done(cls, tokens: list[int], logprobs: list | None) -> "StepHandle":
        return cls(tokens, logprobs)

    @classmethod
    def copying(cls, tokens: torch.Tensor, stream: torch.cuda.Stream | None = None,
                extras: list[torch.Tensor] = (),
                finish: Callable[..., tuple[list | None, list | None]] | None = None,
                pooled: torch.Tensor | None = None) -> "StepHandle":
        """Copies tokens (and extras, whose host lists finish turns into the step's logprobs), once
        the current stream has produced them, into pinned memory without blocking; the handle's
        event marks when they are there (and so the step is done). On a stream of its own the copy
        leaves the current stream free: the next step's work queues behind the step, not behind
        its copy (benchmarks/NOTES.md, entries 40 and 41). The caller must not overwrite tokens
        until the event has fired."""
        if not tokens.is_cuda:
            logprobs, prompt_logprobs = finish(*(t.tolist() for t in extras)) if finish else (None, None)
            return cls(tokens.tolist(), logprobs, prompt_logprobs=prompt_logprobs,
                       pooled=None if pooled is None else pooled.numpy(), samples=tokens)
        ready = torch.cuda.Event()
        stream = stream or torch.cuda.current_stream(tokens.device)
        stream.wait_stream(torch.cuda.current_stream(tokens.device))
        host = []
        copied = (tokens, *extras) if pooled is None else (tokens, *extras, pooled)
        for t in copied:
            t.record_stream(stream)          # an eager step's tensors: not reused before the copy
            host.append(torch.empty(t.shape, dtype=t.dtype, pin_memory=True))
        with torch.cuda.stream(stream):
            for h, t in zip(host, copied):
                h.copy_(t, non_blocking=True)
            ready.record(stream)
        pooled_host = host.pop() if pooled is not None else None
        return cls(host=host, ready=ready, finish=finish, pooled_host=pooled_host, samples=tokens)

    def result(self) -> tuple[list[int], list | None]:
        if self.tokens is None:
            self.ready.synchronize()              # the step's one host synchronisation
            self.tokens, *extras = (h.tolist() for h in self.host)
            if self.finish:
                self.logprobs, self.prompt_logprobs = self.finish(*extras)
            if self.pooled_host is not None:
                self.pooled = self.pooled_host.numpy()
        return self.tokens, self.logprobs
