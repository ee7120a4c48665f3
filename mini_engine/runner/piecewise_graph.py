"""Piecewise CUDA graphs (vLLM's PIECEWISE cudagraph mode) for the steps that the decode graphs
(runner/cuda_graph.py) do not hold: steps with prompt tokens, and decode steps of more rows than
the largest decode graph. Such a step's attention depends on every sequence's query and context
lengths, so it cannot be captured once for a size; the rest of the forward depends only on the
step's token count. Launched eager, that rest is ~250 small launches from Python for Qwen3-0.6B,
8-14 ms of host time a step on the H200 (benchmarks/NOTES.md, entry 68), where a mixed step of a
few hundred tokens needs 1-3 ms of GPU time.

The forward is cut at each layer's attention into num_hidden_layers + 1 pieces
(Qwen3ForCausalLM.forward_piece), each captured once for each token count of a ladder. A step of T
tokens is padded to the smallest captured count >= T (the padding tokens write no KV and belong to
no sequence); it replays piece 0, runs layer 0's attention eager over the step's own metadata,
replays piece 1, and so on; the final norm, lm_head and the sampler run eager after the last. The
pieces pass each other nothing but static buffers (the step's token ids, positions and KV slots,
copied in; the residual stream; the queries; attention's output), so what one leaves the next
finds where it was captured. Everything else a piece allocates lives in one memory pool that all
pieces share: a piece's scratch is dead once it ends, and pieces run one at a time."""
import torch

from mini_engine.compilation_config import padded_size
from mini_engine.layers.attention import AttentionMetadata
from mini_engine.runner.batch import StepTensors


class PiecewiseGraphRunner:
    def __init__(self, model, token_sizes: tuple[int, ...], device: torch.device):
        """token_sizes: the token counts to capture, ascending (EngineConfig.piecewise_graph_sizes)."""
        self.model = model
        self.token_sizes = list(token_sizes)
        self.num_pieces = len(model.layers) + 1
        n, config = self.token_sizes[-1], model.config
        qk = model.layers[0].self_attn.qk_norm_rope
        dtype = model.embed_tokens.weight.dtype
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        # -1 until a step's slots are copied in: the warm-up and the capture write no KV.
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.hidden = torch.zeros(n, config.hidden_size, dtype=dtype, device=device)
        self.q = torch.zeros(n, qk.num_heads, qk.head_dim, dtype=dtype, device=device)
        # Attention writes only the rows of tokens that belong to a sequence: the padding rows keep
        # what they hold (zeros, or an earlier step's rows), never uninitialised memory's NaN, and
        # every piece works row by row, so they reach no real token.
        self.attn_out = torch.zeros_like(self.q)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}     # (token count, piece)

    @staticmethod
    def buffer_bytes(token_sizes: tuple[int, ...], hidden_size: int, num_heads: int, head_dim: int,
                     dtype: torch.dtype) -> int:
        """The static buffers, for the largest of token_sizes."""
        n = token_sizes[-1] if token_sizes else 0
        return n * (3 * 8 + (hidden_size + 2 * num_heads * head_dim) * dtype.itemsize)

    def run_piece(self, k: int, n: int) -> None:
        self.model.forward_piece(k, self.input_ids[:n], self.positions[:n], self.slot_mapping[:n], self.hidden[:n],
                                 self.attn_out[:n], self.q[:n])

    @torch.inference_mode()
    def capture(self) -> None:
        """Every piece at every token count, largest first, all in one pool."""
        pool = None
        for n in reversed(self.token_sizes):
            for k in range(self.num_pieces):
                self.run_piece(k, n)        # warm-up: compile and pick cuBLAS kernels outside capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    self.run_piece(k, n)
                pool = graph.pool()
                self.graphs[n, k] = graph
        torch.cuda.synchronize()

    def size_for(self, num_tokens: int) -> int | None:
        """The captured token count a step of num_tokens pads to; None: above the largest."""
        return padded_size(self.token_sizes, num_tokens)

    def forward(self, t: StepTensors, meta: AttentionMetadata, replay: bool = True) -> torch.Tensor:
        """The final hidden states of a step staged for a captured count of tokens (prepare_inputs
        padded it): [count, hidden], padding included. replay False runs the pieces eager, as
        captured (the CPU tests' way to check the cut without a GPU)."""
        n = t.input_ids.shape[0]
        self.input_ids[:n].copy_(t.input_ids)
        self.positions[:n].copy_(t.positions)
        self.slot_mapping[:n].copy_(t.slot_mapping)
        for k in range(self.num_pieces):
            if replay:
                self.graphs[n, k].replay()
            else:
                self.run_piece(k, n)
            if k < len(self.model.layers):
                self.model.layers[k].self_attn.attn(self.q[:n], meta, out=self.attn_out[:n])
        return self.model.norm(self.hidden[:n])
