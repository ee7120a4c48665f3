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

    def __init__(self, max_tokens: int, max_rows: int, max_blocks: int, device: torch.device):
        self.device = device
        self.int64 = torch.zeros(3 * max_tokens + 3 * max_rows, dtype=torch.int64, device=device)
        self.int32 = torch.zeros(2 * max_rows + 1 + max_rows * max_blocks, dtype=torch.int32, device=device)

    def views(self, num_tokens: int, num_rows: int, table_width: int, num_samples: int = 0,
              num_from_prev: int = 0) -> StepTensors:
        t, r, s, p = num_tokens, num_rows, num_samples, num_from_prev
        b64, b32 = self.int64, self.int32
        return StepTensors(
            input_ids=b64[:t], positions=b64[t:2 * t], slot_mapping=b64[2 * t:3 * t],
            logits_indices=b64[3 * t:3 * t + s], from_prev_dst=b64[3 * t + s:3 * t + s + p],
            from_prev_src=b64[3 * t + s + p:3 * t + s + 2 * p],
            seq_lens=b32[:r], query_start_loc=b32[r:2 * r + 1],
            block_tables=b32[2 * r + 1:2 * r + 1 + r * table_width].view(r, table_width))

    def stage(self, int64_parts: list, int32_parts: list, num_tokens: int, num_rows: int, table_width: int,
              num_samples: int, num_from_prev: int) -> StepTensors:
        """Packs the parts (in StepTensors' order) and copies each dtype's pack to the device."""
        for parts, buf in ((int64_parts, self.int64), (int32_parts, self.int32)):
            n = sum(len(p) if isinstance(p, list) else p.size for p in parts)
            # The caching host allocator hands out pinned memory, and does not reuse it before the
            # copy from it has run: packs of steps in flight never overwrite each other.
            host = torch.empty(n, dtype=buf.dtype, pin_memory=buf.is_cuda)
            if n:
                np.concatenate([np.ravel(p) for p in parts], out=host.numpy(), casting="unsafe")
            buf[:n].copy_(host, non_blocking=True)
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
