"""What crosses between the engine and the runner each step: the rows of a batch going in, and a
handle on the sampled tokens coming out."""
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
