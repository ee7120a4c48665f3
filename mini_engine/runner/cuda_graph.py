"""CUDA graphs for decode-only steps. A decode step of a 0.6B model is ~30 small kernels per
layer; launched one by one from Python they cost more than the GPU work at small batch. Each
graph replays a whole forward (through lm_head) for one batch size, reading its inputs from the
runner's StepInputBuffers (laid out for that size) and writing logits to a static buffer."""
from typing import Callable

import torch

from mini_engine.layers.attention import AttentionMetadata


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch_size] + list(range(16, max_batch_size, 16))
    return sizes + [max_batch_size]


# Inputs of a decode step of bs rows, all padding (slot -1: they write nowhere), laid out where a
# real step padded to bs will put its own: (input_ids, positions, metadata).
PaddedInputs = Callable[[int], tuple[torch.Tensor, torch.Tensor, AttentionMetadata]]


class CUDAGraphRunner:
    def __init__(self, model, max_batch_size: int, device: torch.device):
        self.model = model
        self.batch_sizes = graph_batch_sizes(max_batch_size)
        self.logits = torch.zeros(max_batch_size, model.config.vocab_size, dtype=model.embed_tokens.weight.dtype,
                                  device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    @staticmethod
    def buffer_bytes(max_batch_size: int, vocab_size: int, dtype: torch.dtype) -> int:
        """The static logits buffer (256 x 152k bf16 is 74 MiB)."""
        return max_batch_size * vocab_size * dtype.itemsize

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        hidden = self.model(input_ids, positions, meta)
        self.model.compute_logits(hidden, out=self.logits[:input_ids.shape[0]])

    @torch.inference_mode()
    def capture(self, padded_inputs: PaddedInputs) -> None:
        pool = None
        for bs in reversed(self.batch_sizes):      # largest first: the smaller ones reuse its pool
            inputs = padded_inputs(bs)               # staged here: a copy inside the capture would replay
            self.forward(*inputs)                    # warm-up: compile and autotune outside capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.forward(*inputs)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def graph_size(self, num_rows: int, max_query_len: int) -> int | None:
        """The captured batch size a step of num_rows single-token rows pads to; None: no graph."""
        if max_query_len != 1 or num_rows > self.batch_sizes[-1]:
            return None
        return next(size for size in self.batch_sizes if size >= num_rows)

    def replay(self, bs: int) -> torch.Tensor:
        """Logits of the step whose inputs were staged for bs rows: [bs, vocab], padding included."""
        self.graphs[bs].replay()
        return self.logits[:bs]
