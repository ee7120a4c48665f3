"""Attention over the paged KV cache for a variable-length batch.

The batch is flattened: query tokens of sequence b are rows query_start_loc[b]:query_start_loc[b+1]
of q, and its context (cached tokens and this step's tokens, already written to the cache) is the
first seq_lens[b] slots reached through block_tables[b]. Query row i of a sequence that has n query
rows sits at position seq_lens[b] - n + i and attends causally to keys 0..that position.
"""
import torch
import torch.nn.functional as F


def gather_kv_ref(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len, Hkv, D]: one sequence's keys or values, copied out of the block pool."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:seq_len]


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """The oracle: one sequence at a time, in fp32, with an explicit causal mask."""
    out = torch.empty_like(q)
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q_start, q_end = starts[b], starts[b + 1]
        if q_end == q_start:
            continue
        k = gather_kv_ref(k_cache, block_tables[b], seq_len).float()
        v = gather_kv_ref(v_cache, block_tables[b], seq_len).float()
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        qb = q[q_start:q_end].float()
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale
        q_pos = torch.arange(seq_len - (q_end - q_start), seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~mask, float("-inf"))
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


def paged_decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                                 scale: float) -> torch.Tensor:
    """Batched eager decode (one query row per sequence): gathers every context into a padded
    tensor, then one masked SDPA call. The copy is the cost the Triton kernel removes."""
    B, block_size = q.shape[0], k_cache.shape[1]
    num_blocks = (max_seq_len + block_size - 1) // block_size
    blocks = block_tables[:, :num_blocks].clamp(min=0).long()
    k = k_cache[blocks].flatten(1, 2).transpose(1, 2)     # [B, Hkv, L, D]
    v = v_cache[blocks].flatten(1, 2).transpose(1, 2)
    mask = torch.arange(k.shape[2], device=q.device)[None, :] < seq_lens[:, None]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :],
                                         scale=scale, enable_gqa=True)
    return out.squeeze(2)
