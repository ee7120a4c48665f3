"""CUDA graphs for decode-only steps. A decode step of a 0.6B model is ~30 small kernels per
layer; launched one by one from Python they cost more than the GPU work at small batch. Each
graph replays a whole forward (through lm_head) for one batch size from static buffers."""
from dataclasses import dataclass

import torch

from mini_engine.layers.attention import AttentionMetadata


@dataclass
class GraphBuffers:
    """The static tensors every graph reads and writes; a step copies its inputs in first."""
    input_ids: torch.Tensor        # [max_bs] int64
    positions: torch.Tensor        # [max_bs] int64
    slot_mapping: torch.Tensor     # [max_bs] int64, -1 in padding rows: they write nowhere
    query_start_loc: torch.Tensor  # [max_bs + 1] int32, always arange: one query per row
    seq_lens: torch.Tensor         # [max_bs] int32, 1 in padding rows
    block_tables: torch.Tensor     # [max_bs, max_blocks_per_seq] int32
    logits: torch.Tensor           # [max_bs, vocab]


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch_size] + list(range(16, max_batch_size, 16))
    return sizes + [max_batch_size]


class CUDAGraphRunner:
    def __init__(self, model, max_batch_size: int, max_model_len: int, block_size: int, device: torch.device):
        self.model = model
        self.max_model_len = max_model_len
        self.batch_sizes = graph_batch_sizes(max_batch_size)
        max_blocks = (max_model_len + block_size - 1) // block_size
        n = max_batch_size
        self.buffers = GraphBuffers(
            input_ids=torch.zeros(n, dtype=torch.int64, device=device),
            positions=torch.zeros(n, dtype=torch.int64, device=device),
            slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=device),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device),
            seq_lens=torch.ones(n, dtype=torch.int32, device=device),
            block_tables=torch.zeros(n, max_blocks, dtype=torch.int32, device=device),
            logits=torch.zeros(n, model.config.vocab_size, dtype=model.embed_tokens.weight.dtype, device=device),
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    @staticmethod
    def buffer_bytes(max_batch_size: int, max_model_len: int, block_size: int, vocab_size: int,
                     dtype: torch.dtype) -> int:
        """What GraphBuffers will hold: the logits dominate (256 x 152k bf16 is 74 MiB)."""
        max_blocks = (max_model_len + block_size - 1) // block_size
        n = max_batch_size
        return n * (3 * 8 + 4 + 4 + 4 * max_blocks + vocab_size * dtype.itemsize) + 4

    def metadata(self, bs: int) -> AttentionMetadata:
        b = self.buffers
        # max_seq_len is the bound the graph was captured with: the kernel's split count and grid
        # are fixed at capture, while the real lengths are read from seq_lens at replay.
        return AttentionMetadata(slot_mapping=b.slot_mapping[:bs], query_start_loc=b.query_start_loc[:bs + 1],
                                 seq_lens=b.seq_lens[:bs], block_tables=b.block_tables[:bs], num_decodes=bs,
                                 max_query_len=1, max_seq_len=self.max_model_len)

    def forward(self, bs: int) -> None:
        b = self.buffers
        hidden = self.model(b.input_ids[:bs], b.positions[:bs], self.metadata(bs))
        self.model.compute_logits(hidden, out=b.logits[:bs])

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for bs in reversed(self.batch_sizes):      # largest first: the smaller ones reuse its pool
            self.forward(bs)                          # warm-up: compile and autotune outside capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.forward(bs)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def can_run(self, num_rows: int, max_query_len: int) -> bool:
        return max_query_len == 1 and num_rows <= self.batch_sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits of a decode-only batch: its inputs copied into the static buffers, padded up to
        the next captured size with rows that write nowhere, and the graph replayed."""
        n = input_ids.shape[0]
        bs = next(size for size in self.batch_sizes if size >= n)
        b = self.buffers
        b.input_ids[:n].copy_(input_ids)
        b.positions[:n].copy_(positions)
        b.slot_mapping[:n].copy_(meta.slot_mapping)
        b.slot_mapping[n:bs].fill_(-1)
        b.seq_lens[:n].copy_(meta.seq_lens)
        b.seq_lens[n:bs].fill_(1)
        b.block_tables[:n, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        b.block_tables[n:bs].fill_(0)
        self.graphs[bs].replay()
        return b.logits[:n]
