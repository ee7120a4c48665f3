"""A pooling model's pooling (runner "pooling"): a prompt's final hidden states into one vector, an
embedding or a sequence classifier's logits.

A prompt may run in several chunks (chunked prefill), so pooling is done in two halves. On the
device, each step gives every row that pools one fp32 vector, its chunk's share: under LAST the
hidden state of the prompt's last token (only its last chunk pools), under MEAN the sum over the
chunk's tokens. On the host the engine keeps each share by its chunk's start, and once the
prompt's last chunk is in, combines them (chunk_chain), cuts a Matryoshka model's vector and
normalises it (finish_embedding). A sequence classifier's rows go through its score head on the
device (ClassificationHead: linear and without a bias, so a MEAN's chunk shares of logits sum as
their states would), and the host applies the activation (finish_classification). A preempted
prompt is computed again, possibly in other chunks: its new shares replace the old ones at the
same starts, and the walk from position 0 follows the new chunks' ends, so an old share is never
counted."""
import numpy as np
import torch
from torch import nn

from mini_engine.pooling_params import PoolerConfig, PoolingParams


class ClassificationHead(nn.Module):
    """transformers' `score` of a *ForSequenceClassification model: Linear(hidden, num_labels),
    no bias, loaded from the checkpoint's score.weight. Every tensor-parallel rank holds all of it
    (num_labels x hidden: a few kB), as the pooled states it reads are whole on every rank."""

    def __init__(self, hidden_size: int, num_labels: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_labels, hidden_size))

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] fp32 pooled states -> [rows, num_labels] fp32 logits: in fp32 whatever the
        model's dtype, as vLLM's pooler heads run by default (head_dtype)."""
        return pooled.float() @ self.weight.float().t()


def pooled_token_indices(chunks: list[tuple[int, int, str]]) -> tuple[np.ndarray, np.ndarray]:
    """For the pooling rows' chunks, (flat offset in the step's tokens, its chunk length, pooling
    type): the step tokens whose hidden states each row sums, and the row (0, 1, ...) each goes to."""
    tokens, rows = [], []
    for row, (offset, n, pooling_type) in enumerate(chunks):
        index = np.arange(offset + n - 1, offset + n) if pooling_type == "LAST" else np.arange(offset, offset + n)
        tokens.append(index)
        rows.append(np.full(len(index), row))
    return np.concatenate(tokens), np.concatenate(rows)


def pool_chunks(hidden: torch.Tensor, token_index: torch.Tensor, row_index: torch.Tensor,
                num_rows: int) -> torch.Tensor:
    """[T, H] hidden states -> [num_rows, H] fp32: row r is the sum of the hidden states of the
    tokens whose row_index is r (summed in fp32: a MEAN over thousands of bf16 states)."""
    out = torch.zeros(num_rows, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    return out.index_add_(0, row_index, hidden[token_index].float())


def chunk_chain(shares: dict[int, tuple[int, np.ndarray]], num_tokens: int) -> np.ndarray:
    """The sum of the chunk shares that tile [0, num_tokens), walked from 0: shares[start] is
    (the chunk's end, its share), the latest computed at that start."""
    total, position = None, 0
    while position < num_tokens:
        end, share = shares[position]
        total = share.copy() if total is None else total + share
        position = end
    if position != num_tokens:
        raise RuntimeError(f"the pooled chunks end at {position}, not at the prompt's {num_tokens} tokens")
    return total


def cosine_similarity(a: list[float], b: list[float]) -> float:
    """Two embeddings' cosine similarity (vLLM's score for an embedding model), in float64."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / max(float(np.linalg.norm(a) * np.linalg.norm(b)), 1e-12))


def classifier_probabilities(logits: np.ndarray) -> list[float]:
    """A cross-encoder's classifier tokens' probabilities, the softmax of their logits: for
    Qwen3-Reranker's ("no", "yes"), the second is the score."""
    shifted = np.exp(logits.astype(np.float64) - logits.max())
    return (shifted / shifted.sum()).tolist()


def finish_classification(logits: np.ndarray, params: PoolingParams, pooler: PoolerConfig) -> list[float]:
    """A sequence classifier's output from its logits: through the pooler's activation (softmax,
    sigmoid or none) where the request asks for it (use_activation, else the pooler's default);
    computed in float64."""
    use_activation = pooler.use_activation if params.use_activation is None else params.use_activation
    logits = logits.astype(np.float64)
    if not use_activation or pooler.activation == "identity":
        return logits.tolist()
    if pooler.activation == "sigmoid":
        return np.exp(-np.logaddexp(0.0, -logits)).tolist()        # 1 / (1 + e^-x), with no overflow
    return classifier_probabilities(logits)


def finish_pooled(pooled: np.ndarray, params: PoolingParams, pooler: PoolerConfig) -> list[float]:
    """A request's output from its pooled vector: a cross-encoder's classifier-token
    probabilities, a sequence classifier's (activated) logits, or an embedding."""
    if pooler.is_cross_encoder:
        return classifier_probabilities(pooled)
    if pooler.is_classifier:
        return finish_classification(pooled, params, pooler)
    return finish_embedding(pooled, params, pooler.normalize)


def task_output(output: list[float], pooler: PoolerConfig) -> list[float]:
    """A request's pooled output as vLLM's LLM.encode and /pooling give it: a cross-encoder's, its
    second classifier token's probability alone (vLLM converts Qwen3-Reranker to a classifier of
    one label, whose sigmoid of the two logits' difference is that probability); any other's as it is."""
    return output[-1:] if pooler.is_cross_encoder else output


def finish_embedding(pooled: np.ndarray, params: PoolingParams, default_normalize: bool) -> list[float]:
    """The request's embedding from its pooled vector: cut to params.dimensions (a Matryoshka
    cut, before normalising, as vLLM cuts it), then L2-normalised where asked (or by default)."""
    vector = pooled[:params.dimensions] if params.dimensions is not None else pooled
    if default_normalize if params.normalize is None else params.normalize:
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
    return vector.astype(np.float32).tolist()
