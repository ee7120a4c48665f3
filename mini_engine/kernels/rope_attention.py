"""A decode step's QK-norm, rotary embedding, KV-cache write and attention in one launch.

Apart, they are two kernels: kernels.rotary_kv (one program per token) writes q and the newest k
and v, then kernels.paged_attention's decode kernel reads them. Every kernel boundary costs the
device a drain and a start, and this one sits in each of the 28 layers of every decode step: on
the H200, leaving the rotary kernel out of a decode graph made it 0.05-0.10 ms faster
(benchmarks/NOTES.md, entry 31). Doing the rotary work inside attention's own programs cost more
than that (entries 15 and 31: registers, and q's work delaying the first K/V loads).

Here one grid holds both: its first programs are producers, one per token, running the rotary
kernel's code; the rest are the decode kernel's programs (consumers), which load their step inputs,
wait until every producer has published its writes (a counter in global memory, released by each
producer and read with acquire by each consumer), then attend as before. The GPU starts a 1-D
grid's programs in order, so every producer is running before any consumer waits for it, and
nothing a consumer holds can keep a producer from finishing. (The interpreter runs programs one by
one in that order, so there too the producers are done before a consumer looks.) The last program
to finish resets the counters for the next launch, so a CUDA graph can replay the kernel as is.
"""
import math

import torch

from mini_engine.kernels.paged_attention import (
    DECODE_TILE_N, _block_d, _cache_strides, _check_shapes, _dot_in_fp32, _num_sms, _row_blocks, decode_attend,
    decode_num_splits, decode_num_stages, decode_partials, paged_attention_ref, reduce_decode_splits)
from mini_engine.kernels.rotary_kv import qk_norm_rope_kv_write_ref, qk_norm_rope_kv_write_token
from mini_engine.kernels.triton_utils import pdl_enter, pdl_options, tl, triton


def rope_decode_attention_ref(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                              q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor, eps: float,
                              k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                              num_heads: int, num_kv_heads: int, head_dim: int, norm_input: torch.Tensor | None,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                              scale: float) -> torch.Tensor:
    """The two references in a row: qk_norm_rope_kv_write_ref, then paged_attention_ref."""
    q = qk_norm_rope_kv_write_ref(qkv, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps, k_cache,
                                  v_cache, slot_mapping, num_heads, num_kv_heads, head_dim, norm_input)
    return paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)


@triton.jit
def _rope_decode_kernel(
        qkv_ptr, positions_ptr, cos_sin_ptr, q_norm_ptr, k_norm_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
        slot_mapping_ptr, norm_input_ptr, hidden_size, eps, stride_qkv, stride_cos_sin,
        block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, out_ptr, partial_out_ptr, partial_max_ptr,
        partial_sum_ptr, sync_ptr, num_tokens, num_programs, qk_scale, table_width, stride_out_token,
        stride_out_head, stride_block_table, stride_k_block, stride_k_offset, stride_k_head, stride_v_block,
        stride_v_offset, stride_v_head,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, HAS_NORM: tl.constexpr,
        BLOCK_H: tl.constexpr, QUERIES_PER_KV: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr, ROW_BLOCKS: tl.constexpr, DOT_IN_FP32: tl.constexpr, USE_PDL: tl.constexpr):
    """Programs [0, num_tokens): producer of that token (qk_norm_rope_kv_write_token). The rest:
    decode program (split, kv_head, seq), split fastest, as _paged_decode_kernel's grid orders them.
    sync_ptr: two int32 counters, zero between launches: producers done, programs finished."""
    pid = tl.program_id(0)
    ready_ptr = sync_ptr
    finished_ptr = sync_ptr + 1
    producer = pid < num_tokens
    # Step inputs and constants only before pdl_enter (written by no kernel of the step). Each role
    # loads the other's too, clamped in range, so that every program waits in one place.
    token = tl.minimum(pid, num_tokens - 1).to(tl.int64)
    half = tl.arange(0, HEAD_DIM // 2)
    pos = tl.load(positions_ptr + token)
    cos = tl.load(cos_sin_ptr + pos * stride_cos_sin + half)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cos_sin + HEAD_DIM // 2 + half)[None, :]
    work = tl.maximum(pid - num_tokens, 0)
    split = work % NUM_SPLITS
    kv_head = (work // NUM_SPLITS) % NUM_KV_HEADS
    seq = work // (NUM_SPLITS * NUM_KV_HEADS)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    row_blocks = block_table_ptr        # unused unless ROW_BLOCKS > 0
    if ROW_BLOCKS > 0:
        row_cols = tl.arange(0, ROW_BLOCKS)
        row_blocks = tl.load(block_table_ptr + row_cols, mask=row_cols < table_width, other=-1)
    seq_len = tl.load(seq_lens_ptr + seq)
    query_token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    pdl_enter(USE_PDL)
    if producer:
        qk_norm_rope_kv_write_token(
            token, cos, sin, qkv_ptr, q_norm_ptr, k_norm_ptr, q_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
            norm_input_ptr, hidden_size, eps, stride_qkv, stride_k_block, stride_k_offset, stride_k_head,
            NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_HQ, BLOCK_HKV, HAS_NORM, BLOCK_H)
        # Release: this token's q, k and v (stored by every thread: hence the barrier, after which
        # the one thread that runs a scalar atomic has them all behind it) are visible to any
        # program that acquires the count after this.
        tl.debug_barrier()
        tl.atomic_add(ready_ptr, 1, sem="release")
    else:
        # Spin on a plain (volatile) read, then one acquire read, and a barrier so that every
        # thread's loads of q and of the cache come after it.
        while tl.load(ready_ptr, volatile=True) < num_tokens:
            pass
        tl.atomic_add(ready_ptr, 0, sem="acquire")
        tl.debug_barrier()
        decode_attend(
            split, kv_head, seq, query_token, seq_len, row_blocks, block_table_ptr, q_ptr, k_cache_ptr,
            v_cache_ptr, out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr, qk_scale,
            NUM_HEADS * HEAD_DIM, HEAD_DIM, stride_out_token, stride_out_head, stride_k_block, stride_k_offset,
            stride_k_head, stride_v_block, stride_v_offset, stride_v_head, NUM_HEADS, QUERIES_PER_KV, HEAD_DIM,
            BLOCK_D, BLOCK_SIZE, BLOCK_M, TILE_N, NUM_SPLITS, ROW_BLOCKS, DOT_IN_FP32)
    # The last program out resets both counters: every producer has counted itself ready and
    # every consumer has seen them all by then.
    if tl.atomic_add(finished_ptr, 1, sem="acq_rel") == num_programs - 1:
        tl.atomic_xchg(ready_ptr, 0)
        tl.atomic_xchg(finished_ptr, 0)


def rope_decode_attention(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                          q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor, eps: float,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          num_heads: int, num_kv_heads: int, head_dim: int, norm_input: torch.Tensor | None,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                          scale: float, max_seq_len: int, sync: torch.Tensor) -> torch.Tensor:
    """rope_decode_attention_ref for a batch of one query token per sequence (token i is sequence
    i's), in one launch (plus the split reduce where the batch is small). sync: an int32 [2]
    device buffer, zeroed once and then owned by this call (each launch leaves it zeroed; two
    launches at once on different streams must not share one). Tile, splits and stages as
    paged_decode_attention picks them. Returns the attention output [T, Hq, D]."""
    num_tokens = qkv.shape[0]
    assert qkv.stride(-1) == 1 and head_dim & (head_dim - 1) == 0, "head_dim must be a power of two"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert norm_input is None or norm_input.is_contiguous()
    assert seq_lens.shape[0] == num_tokens, "one query token per sequence"
    assert sync.dtype == torch.int32 and sync.numel() >= 2 and sync.is_contiguous()
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    _check_shapes(q, k_cache, v_cache, block_tables)
    tile_n = DECODE_TILE_N
    num_splits = decode_num_splits(num_tokens, num_kv_heads, max_seq_len, tile_n, _num_sms(q.device))
    partial_out, partial_max, partial_sum = decode_partials(out, num_splits)
    hidden_size = 1 if norm_input is None else norm_input.shape[1]
    queries_per_kv = num_heads // num_kv_heads
    num_programs = num_tokens + num_splits * num_kv_heads * num_tokens
    pdl = pdl_options(q.device)
    _rope_decode_kernel[(num_programs,)](
        qkv, positions, cos_sin_cache, q_norm_weight, k_norm_weight, q, k_cache, v_cache, slot_mapping,
        qkv if norm_input is None else norm_input, hidden_size, eps, qkv.stride(0), cos_sin_cache.stride(0),
        block_tables, seq_lens, query_start_loc, out, partial_out, partial_max, partial_sum, sync, num_tokens,
        num_programs, scale * math.log2(math.e), block_tables.shape[1], out.stride(0), out.stride(1),
        block_tables.stride(0), *_cache_strides(k_cache, v_cache),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim),
        BLOCK_SIZE=k_cache.shape[1], BLOCK_HQ=triton.next_power_of_2(num_heads),
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads), HAS_NORM=norm_input is not None,
        BLOCK_H=triton.next_power_of_2(hidden_size), QUERIES_PER_KV=queries_per_kv,
        BLOCK_M=max(16, triton.next_power_of_2(queries_per_kv)), TILE_N=tile_n, NUM_SPLITS=num_splits,
        ROW_BLOCKS=_row_blocks(block_tables.shape[1], k_cache.shape[1], tile_n), DOT_IN_FP32=_dot_in_fp32(q),
        num_warps=4, num_stages=decode_num_stages(num_tokens), **pdl)
    reduce_decode_splits(partial_out, partial_max, partial_sum, query_start_loc, out)
    return out
