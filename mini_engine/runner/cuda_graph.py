"""CUDA graphs for decode-only steps. A decode step of Qwen3-0.6B is 28 layers of 7-9 small
kernels each (Qwen3DecoderLayer) and a few around them; launched one by one from Python they
cost more than the GPU work at small batch. Each graph replays a whole decode step for one batch
size: the input tokens that the previous step sampled, the forward through lm_head into a static
logits buffer and, with the Triton sampler, the sampler. The runner's consecutive launches take
turns, 0 and 1, and each size is captured once for each turn: the graph of turn k reads the inputs
staged in that turn's StepInputBuffers (laid out for its size), takes its input tokens from the
other turn's samples and writes its own to turn k's. With the Triton sampler each also has a second,
small graph, replayed after it in a step with top-k rows: it redraws those rows from their best
logits (kernels/top_k_sampling.py), so that the step of every other batch runs no top-k work."""
from typing import Callable

import torch

from mini_engine.compilation_config import padded_size
from mini_engine.kernels.top_k_sampling import sample_top_k
from mini_engine.layers.attention import AttentionMetadata
from mini_engine.runner.batch import StepTensors


# Inputs of a decode step of bs rows, all padding (slot mapping -1: they write nowhere; greedy),
# laid out where a real step padded to bs will put its own, in turn 0 or 1: (bs, turn).
PaddedInputs = Callable[[int, int], tuple[StepTensors, AttentionMetadata]]
# take_prev_tokens(input_ids, prev_index, sampled_tokens) and sample(logits, temperatures, seeds, out=)
TakePrevTokens = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
Sample = Callable[..., torch.Tensor]


class CUDAGraphRunner:
    def __init__(self, model, batch_sizes: tuple[int, ...], device: torch.device, sampled_tokens: torch.Tensor,
                 take_prev_tokens: TakePrevTokens, sample: Sample | None):
        """batch_sizes: those to capture, ascending (EngineConfig.cuda_graph_sizes); sampled_tokens:
        the runner's [2, max_num_seqs] samples, a row for each turn."""
        self.model = model
        self.batch_sizes = list(batch_sizes)
        self.logits = torch.zeros(self.batch_sizes[-1], model.config.vocab_size, dtype=model.embed_tokens.weight.dtype,
                                  device=device)
        self.sampled_tokens = sampled_tokens
        self.take_prev_tokens = take_prev_tokens
        self.sample = sample             # None: the graph stops at the logits, and the runner samples
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}     # (batch size, turn)
        self.top_k_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}     # where self.sample is set

    @staticmethod
    def buffer_bytes(batch_sizes: tuple[int, ...], vocab_size: int, dtype: torch.dtype) -> int:
        """The static logits buffer, for the largest of batch_sizes (256 x 152k bf16 is 74 MiB)."""
        return batch_sizes[-1] * vocab_size * dtype.itemsize if batch_sizes else 0

    def forward(self, t: StepTensors, meta: AttentionMetadata, turn: int) -> None:
        bs = t.input_ids.shape[0]
        self.take_prev_tokens(t.input_ids, t.prev_index, self.sampled_tokens[1 - turn])
        hidden = self.model(t.input_ids, t.positions, meta, t.lora_slots)
        logits = self.model.compute_logits(hidden, out=self.logits[:bs])
        if self.sample is not None:
            self.sample(logits, t.temperatures, t.seeds, out=self.sampled_tokens[turn, :bs])

    @torch.inference_mode()
    def capture(self, padded_inputs: PaddedInputs) -> None:
        """Each of batch_sizes, once for each turn, all in one memory pool: the graphs run one at a
        time."""
        pool = None
        for turn in (0, 1):
            for bs in reversed(self.batch_sizes):      # largest first: the smaller ones reuse its pool
                inputs = padded_inputs(bs, turn)         # staged here: a copy inside the capture would replay
                self.forward(*inputs, turn)              # warm-up: compile and autotune outside capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    self.forward(*inputs, turn)
                pool = graph.pool()
                self.graphs[bs, turn] = graph
                if self.sample is not None:
                    self.top_k_graphs[bs, turn] = self.capture_top_k(inputs[0], bs, turn, pool)
        torch.cuda.synchronize()

    def redraw_top_k(self, t: StepTensors, bs: int, turn: int) -> None:
        sample_top_k(self.logits[:bs], t.temperatures, t.top_k, t.top_p, t.seeds, out=self.sampled_tokens[turn, :bs])

    def capture_top_k(self, t: StepTensors, bs: int, turn: int, pool) -> torch.cuda.CUDAGraph:
        self.redraw_top_k(t, bs, turn)           # warm-up (its padding rows have top_k 0: nothing drawn)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool):
            self.redraw_top_k(t, bs, turn)
        return graph

    def graph_size(self, num_rows: int, max_query_len: int) -> int | None:
        """The captured batch size a step of num_rows single-token rows pads to; None: no graph."""
        return padded_size(self.batch_sizes, num_rows) if max_query_len == 1 else None

    def replay(self, bs: int, turn: int, top_k: bool = False) -> torch.Tensor:
        """Logits of the step whose inputs were staged for bs rows in that turn: [bs, vocab],
        padding included (and, if the graph samples, its tokens in sampled_tokens[turn, :bs]; top_k:
        the rows with a staged top_k redrawn from their top-k and top-p sets)."""
        self.graphs[bs, turn].replay()
        if top_k:
            self.top_k_graphs[bs, turn].replay()
        return self.logits[:bs]
