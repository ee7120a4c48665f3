"""CUDA graphs for decode-only steps. A decode step of a 0.6B model is ~30 small kernels per
layer; launched one by one from Python they cost more than the GPU work at small batch. Each
graph replays a whole decode step for one batch size, and every operation of the step is in it:
the copy of the step's inputs from a pinned host pack into the runner's StepInputBuffers (laid out
for that size), the input tokens that the previous step sampled, the forward through lm_head into
a static logits buffer and, with the Triton sampler, the sampler into the runner's buffer of
sampled tokens and their copy to pinned host memory. Outside the graph a step then costs the
device one launch and one event: each operation outside it cost ~10-20 us of device time a step
(benchmarks/NOTES.md, entry 34).

The pinned buffers are fixed addresses inside the graphs, so the graphs come in two slots, each
with its own pack and token buffer, used in turn: the host fills one slot's pack for step n+1
while the device may still run step n from the other's."""
from typing import Callable

import torch

from mini_engine.layers.attention import AttentionMetadata
from mini_engine.runner.batch import StepHandle, StepInputBuffers, StepTensors

NUM_SLOTS = 2


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch_size] + list(range(16, max_batch_size, 16))
    return sizes + [max_batch_size]


# Inputs of a decode step of bs rows, all padding (slot -1: they write nowhere; greedy), packed
# into the given pinned buffer, laid out where a real step padded to bs will put its own.
PaddedInputs = Callable[[int, torch.Tensor], tuple[StepTensors, AttentionMetadata]]
# take_prev_tokens(input_ids, prev_index, sampled_tokens) and sample(logits, temperatures, seeds, out=)
TakePrevTokens = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
Sample = Callable[..., torch.Tensor]


class CUDAGraphRunner:
    def __init__(self, model, max_batch_size: int, device: torch.device, inputs: StepInputBuffers,
                 sampled_tokens: torch.Tensor, take_prev_tokens: TakePrevTokens, sample: Sample | None):
        self.model = model
        self.batch_sizes = graph_batch_sizes(max_batch_size)
        self.logits = torch.zeros(max_batch_size, model.config.vocab_size, dtype=model.embed_tokens.weight.dtype,
                                  device=device)
        self.inputs = inputs
        self.sampled_tokens = sampled_tokens
        self.take_prev_tokens = take_prev_tokens
        self.sample = sample             # None: the graph stops at the logits, and the runner samples
        pinned = device.type == "cuda"
        self.packs = [torch.zeros_like(inputs.data, device="cpu", pin_memory=pinned) for _ in range(NUM_SLOTS)]
        self.host_tokens = [torch.zeros_like(sampled_tokens, device="cpu", pin_memory=pinned)
                            for _ in range(NUM_SLOTS)]
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.next_slot = 0
        # The last launch from each slot: its pack and token buffer are free once it has run and
        # its tokens were read.
        self.last_launch: list[tuple[torch.cuda.Event, StepHandle] | None] = [None] * NUM_SLOTS

    @staticmethod
    def buffer_bytes(max_batch_size: int, vocab_size: int, dtype: torch.dtype) -> int:
        """The static logits buffer (256 x 152k bf16 is 74 MiB)."""
        return max_batch_size * vocab_size * dtype.itemsize

    def forward(self, slot: int, t: StepTensors, meta: AttentionMetadata) -> None:
        bs = t.input_ids.shape[0]
        nbytes = self.inputs.layout_bytes(bs, bs, t.block_tables.shape[1], bs, bs)
        self.inputs.data[:nbytes].copy_(self.packs[slot][:nbytes], non_blocking=True)
        self.take_prev_tokens(t.input_ids, t.prev_index, self.sampled_tokens)
        hidden = self.model(t.input_ids, t.positions, meta)
        logits = self.model.compute_logits(hidden, out=self.logits[:bs])
        if self.sample is not None:
            self.sample(logits, t.temperatures, t.seeds, out=self.sampled_tokens[:bs])
            self.host_tokens[slot][:bs].copy_(self.sampled_tokens[:bs], non_blocking=True)

    @torch.inference_mode()
    def capture(self, padded_inputs: PaddedInputs) -> None:
        pool = None
        for slot in range(NUM_SLOTS):
            for bs in reversed(self.batch_sizes):      # largest first: the smaller ones reuse its pool
                inputs = padded_inputs(bs, self.packs[slot])
                self.forward(slot, *inputs)              # warm-up: compile and autotune outside capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    self.forward(slot, *inputs)
                pool = graph.pool()
                self.graphs[slot, bs] = graph
        torch.cuda.synchronize()

    def graph_size(self, num_rows: int, max_query_len: int) -> int | None:
        """The captured batch size a step of num_rows single-token rows pads to; None: no graph."""
        if max_query_len != 1 or num_rows > self.batch_sizes[-1]:
            return None
        return next(size for size in self.batch_sizes if size >= num_rows)

    def claim_slot(self) -> int:
        """The slot for the next launch, once its last launch no longer needs it. In the engine's
        loop that launch was two launches ago and its tokens have been read, so this never waits;
        a caller that launches further ahead waits here for the device."""
        slot, self.next_slot = self.next_slot, (self.next_slot + 1) % NUM_SLOTS
        if self.last_launch[slot] is not None:
            done, handle = self.last_launch[slot]
            done.synchronize()
            handle.result()
        return slot

    def replay(self, bs: int, slot: int) -> torch.Tensor:
        """Runs the step packed into packs[slot] for bs rows. Returns its logits, [bs, vocab],
        padding included; if the graph samples, its tokens are in sampled_tokens[:bs] on the device
        and host_tokens[slot][:bs] once the step is done."""
        self.graphs[slot, bs].replay()
        return self.logits[:bs]

    def mark_launched(self, slot: int, handle: StepHandle) -> None:
        """Marks the end of a launch from slot: its pack and token buffer are free once the device
        has passed this point and the handle's tokens (if any) have been read."""
        done = handle.ready
        if done is None:
            done = torch.cuda.Event()
            done.record()
        self.last_launch[slot] = (done, handle)
