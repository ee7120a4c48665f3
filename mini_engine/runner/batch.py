"""What crosses between the engine and the runner each step: the rows of a batch going in (and
the device buffers their integer inputs travel to), and a handle on the sampled tokens coming out."""
from dataclasses import dataclass

import numpy as np
import torch

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


@dataclass(slots=True)
class StepTensors:
    """A step's integer inputs on the device: views into StepInputBuffers."""
    input_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64
    slot_mapping: torch.Tensor     # [T] int64, -1 where a token writes no KV (padding)
    logits_indices: torch.Tensor   # [S] int64: the token whose logits each sampling row uses
    from_prev_dst: torch.Tensor    # [P] int64: input tokens that are the previous launch's samples...
    from_prev_src: torch.Tensor    # [P] int64: ...and which of its samples each one is
    seq_lens: torch.Tensor         # [R] int32
    query_start_loc: torch.Tensor  # [R + 1] int32
    block_tables: torch.Tensor     # [R, W] int32


class StepInputBuffers:
    """Device buffers for every step's integer inputs, reached by one host-to-device copy per dtype.

    The host packs a step's int64 arrays (input ids, positions, slots, logits rows, the tokens
    taken from the previous launch) into one pinned array and its int32 arrays (sequence lengths,
    query starts, block tables) into another, each in that fixed order, and each crosses in one
    asynchronous copy: two copies a step instead of one per array. The step's tensors are views at
    offsets that depend only on its sizes, so a CUDA graph captured on the views of a bs-row decode
    step reads the inputs of every later step laid out for bs where they land: no copy into
    separate graph buffers before a replay. (Stream order makes reuse safe: a step's copy lands
    after the previous step's kernels have read the buffers.)"""

    # Each array starts on a 128-byte boundary. Triton specialises a kernel on whether each pointer
    # is 16-byte aligned: with offsets that moved with the step's sizes, a fresh machine compiled
    # new variants during the run (benchmarks/NOTES.md, entry 24).
    ALIGN_BYTES = 128

    def __init__(self, max_tokens: int, max_rows: int, max_blocks: int, device: torch.device):
        slack = 6 * self.ALIGN_BYTES
        self.int64 = torch.zeros(3 * max_tokens + 3 * max_rows + slack // 8, dtype=torch.int64, device=device)
        self.int32 = torch.zeros(2 * max_rows + 1 + max_rows * max_blocks + slack // 4, dtype=torch.int32,
                                 device=device)

    @classmethod
    def offsets(cls, sizes: list[int], itemsize: int) -> list[int]:
        """Where each of consecutive arrays of these sizes starts, and (last) where they end."""
        align = cls.ALIGN_BYTES // itemsize
        out, end = [], 0
        for size in sizes:
            start = -(-end // align) * align
            out.append(start)
            end = start + size
        return out + [end]

    @staticmethod
    def sizes(num_tokens: int, num_rows: int, table_width: int, num_samples: int,
              num_from_prev: int) -> tuple[list[int], list[int]]:
        """The int64 arrays' sizes and the int32 arrays', in StepTensors' order."""
        t, r, p = num_tokens, num_rows, num_from_prev
        return [t, t, t, num_samples, p, p], [r, r + 1, r * table_width]

    def views(self, num_tokens: int, num_rows: int, table_width: int, num_samples: int = 0,
              num_from_prev: int = 0) -> StepTensors:
        sizes64, sizes32 = self.sizes(num_tokens, num_rows, table_width, num_samples, num_from_prev)
        o64, o32 = self.offsets(sizes64, 8), self.offsets(sizes32, 4)
        v64 = [self.int64[o:o + n] for o, n in zip(o64, sizes64)]
        v32 = [self.int32[o:o + n] for o, n in zip(o32, sizes32)]
        return StepTensors(*v64, v32[0], v32[1], v32[2].view(num_rows, table_width))

    def stage(self, int64_parts: list, int32_parts: list, num_tokens: int, num_rows: int, table_width: int,
              num_samples: int, num_from_prev: int) -> StepTensors:
        """Packs the parts (in StepTensors' order, block tables as one [rows, width] array) at
        their offsets and copies each dtype's pack to the device."""
        sizes64, sizes32 = self.sizes(num_tokens, num_rows, table_width, num_samples, num_from_prev)
        for parts, sizes, buf in ((int64_parts, sizes64, self.int64), (int32_parts, sizes32, self.int32)):
            offsets = self.offsets(sizes, buf.element_size())
            # The caching host allocator hands out pinned memory, and does not reuse it before the
            # copy from it has run: packs of steps in flight never overwrite each other.
            host = torch.empty(offsets[-1], dtype=buf.dtype, pin_memory=buf.is_cuda)
            packed = host.numpy()
            for part, start, size in zip(parts, offsets, sizes):
                packed[start:start + size] = np.ravel(part)
            buf[:offsets[-1]].copy_(host, non_blocking=True)
        return self.views(num_tokens, num_rows, table_width, num_samples, num_from_prev)


class StepHandle:
    """A launched step's sampled tokens, on their way to the host."""

    def __init__(self, tokens: list[int] | None = None, logprobs: list | None = None,
                 host: torch.Tensor | None = None, ready: torch.cuda.Event | None = None):
        self.tokens, self.logprobs, self.host, self.ready = tokens, logprobs, host, ready

    @classmethod
    def done(cls, tokens: list[int], logprobs: list | None) -> "StepHandle":
        return cls(tokens, logprobs)

    @classmethod
    def copying(cls, tokens: torch.Tensor) -> "StepHandle":
        if not tokens.is_cuda:
            return cls(tokens.tolist())
        # Into pinned memory without blocking; an event marks when the copy (and so the step) is done.
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(host=host, ready=ready)

    def result(self) -> tuple[list[int], list | None]:
        if self.tokens is None:
            self.ready.synchronize()              # the step's one host synchronisation
            self.tokens = self.host.tolist()
        return self.tokens, self.logprobs
