"""The embedding and the lm_head, each rank holding 1/N of the vocabulary's rows under tensor
parallelism (Qwen3-0.6B ties the two: one [151936, 1024] matrix, 311 MB in bf16). Where N does not
divide the vocabulary, each rank holds ceil(V/N) rows and the last rank's final ones are padding:
zeros, never looked up, their logits dropped (vLLM pads its shares too)."""
import torch
import torch.nn.functional as F
from torch import nn

from mini_engine.distributed import TensorParallel, all_gather_columns, all_reduce


class VocabParallelEmbedding(nn.Embedding):
    """Rank r holds rows [r n, (r+1) n), n = ceil(V/N). It embeds the tokens that fall in its
    rows, zeros the others, and an all-reduce gives every rank every token's row."""
    tp_dim = 0

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = TensorParallel()):
        super().__init__(tp.shard(vocab_size), hidden_size)
        self.tp = tp
        self.vocab_size = vocab_size
        self.vocab_start = tp.rank * self.num_embeddings

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_embeddings)
        rows = F.embedding(torch.where(mine, local, 0), self.weight)
        return all_reduce(rows.mul_(mine.unsqueeze(1)), self.tp)


class ParallelLMHead(nn.Linear):
    """Rank r computes the logits of its rows of the vocabulary; they are gathered, so every rank
    holds the whole [T, V] (and samples the same tokens from it)."""
    tp_dim = 0

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel = TensorParallel()):
        super().__init__(hidden_size, tp.shard(vocab_size), bias=False)
        self.tp = tp
        self.vocab_size = vocab_size

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[T, hidden] -> [T, vocab]; into `out` when given (a CUDA graph's static buffer: writing
        there directly saves copying 256 x 152k logits, ~0.1 ms, every step)."""
        if self.tp.size > 1:
            local = F.linear(hidden, self.weight)
            if self.out_features * self.tp.size == self.vocab_size:
                return all_gather_columns(local, self.tp, out)
            logits = all_gather_columns(local, self.tp)[:, :self.vocab_size]      # the padding's dropped
            return logits if out is None else out.copy_(logits)
        if out is None:
            return F.linear(hidden, self.weight)
        return torch.mm(hidden, self.weight.t(), out=out)
