from dataclasses import dataclass

import torch
from torch import nn

from mini_engine.kernels.paged_attention import paged_attention_ref, paged_decode_attention_torch


@dataclass
class AttentionMetadata:
    """What attention needs to find each token's context in the paged KV cache. The batch is
    ordered decodes first: rows [0, num_decodes) have one query token each."""

    slot_mapping: torch.Tensor      # [T] int64: cache slot each new token's k/v goes to (-1: nowhere)
    query_start_loc: torch.Tensor   # [B + 1] int32: where each sequence's query rows start
    seq_lens: torch.Tensor          # [B] int32: context length after this step's tokens
    block_tables: torch.Tensor      # [B, max_blocks] int32: physical blocks, padded with -1
    num_decodes: int
    max_query_len: int
    max_seq_len: int                # an upper bound on seq_lens (CUDA graphs pass max_model_len)
    prefill_work: torch.Tensor | None = None    # [I, 4] int32: the varlen kernel's work list (prefill_work)
    # Programs a sequence and KV head of a decode-only step (None: the kernel's rule for the step's
    # rows; an eager step passes its graph size's, ModelRunner.prepare_inputs).
    decode_splits: int | None = None


class Attention(nn.Module):
    """Paged attention over k/v already written to the cache by QKNormRopeKVWrite."""

    def __init__(self, head_dim: int, use_triton: bool = False):
        """The head counts come from q and the cache's shapes."""
        super().__init__()
        self.scale = head_dim ** -0.5
        self.use_triton = use_triton
        # Views into the runner's KV pool, [num_blocks, block_size, Hkv, D]; set by the runner.
        self.k_cache = self.v_cache = torch.empty(0)
        # fp32 scratch for the decode kernel's split partials, one for all layers; set by the runner
        # (None: the kernel allocates its own).
        self.decode_workspace: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        """out: where the result goes (a piecewise CUDA graph's static buffer; rows of tokens outside
        every sequence are left as they are), else a new tensor."""
        if self.use_triton:
            from mini_engine.kernels.paged_attention import paged_attention
            return paged_attention(q, self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens,
                                   meta.query_start_loc, self.scale, meta.max_query_len, meta.max_seq_len, out,
                                   prefill_work=meta.prefill_work, decode_workspace=self.decode_workspace,
                                   decode_splits=meta.decode_splits)
        result = self.forward_eager(q, meta)
        if out is None:
            return result
        end = int(meta.query_start_loc[-1])     # the eager path gives padding tokens rows of its own
        out[:end].copy_(result[:end])
        return out

    def forward_eager(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        d = meta.num_decodes
        if d == q.shape[0]:
            return paged_decode_attention_torch(q, self.k_cache, self.v_cache, meta.block_tables,
                                                meta.seq_lens, meta.max_seq_len, self.scale)
        out = torch.empty_like(q)
        if d:
            out[:d] = paged_decode_attention_torch(q[:d], self.k_cache, self.v_cache, meta.block_tables[:d],
                                                   meta.seq_lens[:d], meta.max_seq_len, self.scale)
        # Prefill rows one sequence at a time: few per step, each a large attention.
        out[d:] = paged_attention_ref(q[d:], self.k_cache, self.v_cache, meta.block_tables[d:],
                                      meta.seq_lens[d:], meta.query_start_loc[d:] - meta.query_start_loc[d],
                                      self.scale)
        return out
