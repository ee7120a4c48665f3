"""Two-batch overlap for large decode steps.

A decode step's attention streams the KV cache and is bound by memory bandwidth; the rest of a
layer (two norms, four projections, SwiGLU, rotary and the KV write) is a chain of short kernels
bound by launch latency and the tensor cores, with little memory traffic. Within one batch they
cannot overlap: each needs the other's output. Two halves of the batch are independent, so one
half's attention can run on one stream while the other half's o_proj, MLP and next-layer QKV run
on another, and then the two swap (vLLM's "dual batch overlap" and NanoFlow split batches for the
same reason).

Per half X and layer l, in issue order:

    compute stream:    after_attention(l-1, X), before_attention(l, X)   -> event "ready"
    attention stream:  wait "ready", attention(l, X)                      -> event "done"
    compute stream:    wait "done", after_attention(l, X), before_attention(l+1, X) ...

Issuing the halves alternately keeps the attention stream busy with one half while the compute
stream works on the other. The result is what the model's own forward gives for each half:
the same kernels on the same rows (only the GEMMs' row counts differ).

Without CUDA (tests on the CPU) the streams are absent and the same code runs in order.
"""
import contextlib
from dataclasses import dataclass

import torch

from mini_engine.layers.attention import AttentionMetadata

# CUDA stream priorities (lower is more urgent). The compute chain goes first: a half's next
# attention cannot start until its chain is done, while attention has thousands of programs to
# fill whatever SMs the chain leaves free.
COMPUTE_STREAM_PRIORITY = -1
ATTENTION_STREAM_PRIORITY = 0


@dataclass
class HalfBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata


class OverlapStreams:
    """The two streams, forked from and joined back into the caller's (a graph capture's) stream."""

    def __init__(self, device: torch.device):
        self.enabled = device.type == "cuda"
        if self.enabled:
            self.compute = torch.cuda.Stream(device, priority=COMPUTE_STREAM_PRIORITY)
            self.attention = torch.cuda.Stream(device, priority=ATTENTION_STREAM_PRIORITY)

    def on(self, stream_name: str):
        return torch.cuda.stream(getattr(self, stream_name)) if self.enabled else contextlib.nullcontext()

    def record(self, stream_name: str) -> torch.cuda.Event | None:
        if not self.enabled:
            return None
        event = torch.cuda.Event()
        event.record(getattr(self, stream_name))
        return event

    def wait(self, stream_name: str, event: torch.cuda.Event | None) -> None:
        if event is not None:
            getattr(self, stream_name).wait_event(event)

    @contextlib.contextmanager
    def forked(self):
        if not self.enabled:
            yield
            return
        origin = torch.cuda.current_stream()
        self.compute.wait_stream(origin)
        self.attention.wait_stream(origin)
        yield
        origin.wait_stream(self.compute)
        origin.wait_stream(self.attention)


def forward_two_batches(model, halves: list[HalfBatch], streams: OverlapStreams) -> list[torch.Tensor]:
    """The final hidden states of each half, [rows, hidden], as model(...) gives them."""
    layers = model.layers
    with streams.forked(), streams.on("compute"):
        xs = [model.embed_tokens(h.input_ids) for h in halves]
        residuals = [None] * len(halves)
        # Per half: its attention output, and the query it read. Both cross streams, so both stay
        # referenced until the compute stream has waited for that attention: until then the
        # caching allocator could hand their memory to a compute kernel while attention reads it.
        in_flight: list[tuple | None] = [None] * len(halves)
        for index, layer in enumerate(layers):
            for i, half in enumerate(halves):
                if in_flight[i] is not None:
                    attn_out, _, done = in_flight[i]
                    streams.wait("compute", done)
                    xs[i], residuals[i] = layers[index - 1].after_attention(attn_out, residuals[i])
                q, residuals[i] = layer.before_attention(xs[i], residuals[i], half.positions, half.meta)
                attn_out = torch.empty_like(q)
                ready = streams.record("compute")
                with streams.on("attention"):
                    streams.wait("attention", ready)
                    layer.self_attn.attn(q, half.meta, out=attn_out)
                    done = streams.record("attention")
                in_flight[i] = (attn_out, q, done)
        hidden = []
        for i in range(len(halves)):
            attn_out, _, done = in_flight[i]
            streams.wait("compute", done)
            x, residual = layers[-1].after_attention(attn_out, residuals[i])
            hidden.append(model.norm(x, residual)[0])
    return hidden
