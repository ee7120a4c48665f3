"""Variant: the engine's decode kernel (block-table row read beside seq_len) made persistent: about
programs_per_sm x SMs programs, program p takes items p, p + P, ... in the engine's order (split
fastest, then KV head, then sequence), and loads the next item's row, seq_len and query start
while it works on the current one, so that each item after a program's first issues its first
K/V load with no wait at all."""
import math

import torch

from mini_engine.kernels.paged_attention import (_attend_tile, _block_d, _check_shapes, _cache_strides,
                                                 _dot_in_fp32, _empty_softmax_state, _load_query_rows, _num_sms,
                                                 _paged_decode_reduce_kernel, _row_blocks, decode_num_splits)
from mini_engine.kernels.triton_utils import tl, triton


@triton.jit
def _persistent_decode_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
        out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr, qk_scale, table_width, num_seqs,
        stride_q_token, stride_q_head, stride_out_token, stride_out_head, stride_block_table,
        stride_k_block, stride_k_offset, stride_k_head, stride_v_block, stride_v_offset, stride_v_head,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, QUERIES_PER_KV: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
        TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr, ROW_BLOCKS: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    items_per_seq: tl.constexpr = NUM_KV_HEADS * NUM_SPLITS
    num_items = num_seqs * items_per_seq
    row_cols = tl.arange(0, ROW_BLOCKS)
    rows = tl.arange(0, BLOCK_M)
    row_valid = rows < QUERIES_PER_KV

    # the first item's sequence (clamped: a program with no item loads a real row and does nothing)
    seq = tl.minimum(pid // items_per_seq, num_seqs - 1)
    row_blocks = tl.load(block_tables_ptr + seq.to(tl.int64) * stride_block_table + row_cols,
                         mask=row_cols < table_width, other=-1)
    seq_len = tl.load(seq_lens_ptr + seq)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    for item in range(pid, num_items, num_programs):
        split = item % NUM_SPLITS
        kv_head = (item // NUM_SPLITS) % NUM_KV_HEADS
        seq = item // items_per_seq
        # the next item's inputs, in flight while this one runs
        next_seq = tl.minimum((item + num_programs) // items_per_seq, num_seqs - 1)
        next_row = tl.load(block_tables_ptr + next_seq.to(tl.int64) * stride_block_table + row_cols,
                           mask=row_cols < table_width, other=-1)
        next_seq_len = tl.load(seq_lens_ptr + next_seq)
        next_token = tl.load(query_start_loc_ptr + next_seq).to(tl.int64)

        num_tiles = tl.cdiv(seq_len, TILE_N)
        tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
        tile_lo = split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
        head = kv_head * QUERIES_PER_KV + rows
        q, q_mask, offs_d = _load_query_rows(q_ptr, token * stride_q_token + head * stride_q_head, row_valid,
                                             HEAD_DIM, BLOCK_D, DOT_IN_FP32)
        m_i, l_i, acc = _empty_softmax_state(BLOCK_M, BLOCK_D)
        for tile in range(tile_lo, tile_hi):
            offs_n = tile * TILE_N + tl.arange(0, TILE_N)
            block = tl.gather(row_blocks, tl.minimum(offs_n // BLOCK_SIZE, ROW_BLOCKS - 1), axis=0)
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block, offs_n, kv_head,
                                         seq_len, rows, qk_scale, stride_k_block, stride_k_offset,
                                         stride_k_head, stride_v_block, stride_v_offset, stride_v_head,
                                         BLOCK_SIZE, HEAD_DIM, BLOCK_D, False)
        if NUM_SPLITS == 1:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(out_ptr + token * stride_out_token + head[:, None] * stride_out_head + offs_d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=q_mask)
        else:
            part = (seq.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS + split
            tl.store(partial_max_ptr + part, m_i, mask=row_valid)
            tl.store(partial_sum_ptr + part, l_i, mask=row_valid)
            tl.store(partial_out_ptr + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=row_valid[:, None])
        row_blocks, seq_len, token = next_row, next_seq_len, next_token


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_seq_len,
                           out=None, num_splits=None, tile_n=64, num_warps=4, num_stages=3, programs_per_sm=3,
                           min_splits=1, maxnreg=None):
    num_heads, num_kv_heads, head_dim = _check_shapes(q, k_cache, v_cache, block_tables)
    out = torch.empty_like(q) if out is None else out
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0:
        return out
    queries_per_kv = num_heads // num_kv_heads
    if num_splits is None:
        num_splits = decode_num_splits(num_seqs, num_kv_heads, max_seq_len, tile_n, _num_sms(q.device))
        num_splits = min(max(num_splits, min_splits), triton.cdiv(max_seq_len, tile_n))
    if num_splits > 1:
        partial_max = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
        partial_sum = torch.empty_like(partial_max)
        partial_out = torch.empty(*partial_max.shape, _block_d(head_dim), dtype=torch.float32, device=q.device)
    else:
        partial_out = partial_max = partial_sum = out
    block_size, table_width = k_cache.shape[1], block_tables.shape[1]
    row_blocks = _row_blocks(table_width, block_size, tile_n)
    assert row_blocks > 0
    programs = min(num_seqs * num_kv_heads * num_splits, programs_per_sm * _num_sms(q.device))
    extra = {} if maxnreg is None else {"maxnreg": maxnreg}
    _persistent_decode_kernel[(programs,)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, partial_out, partial_max, partial_sum,
        scale * math.log2(math.e), table_width, num_seqs, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), *_cache_strides(k_cache, v_cache),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, QUERIES_PER_KV=queries_per_kv, HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim), BLOCK_SIZE=block_size, BLOCK_M=max(16, triton.next_power_of_2(queries_per_kv)),
        TILE_N=tile_n, NUM_SPLITS=num_splits, ROW_BLOCKS=row_blocks, DOT_IN_FP32=_dot_in_fp32(q),
        num_warps=num_warps, num_stages=num_stages, **extra)
    if num_splits > 1:
        block_splits = triton.next_power_of_2(num_splits)
        block_heads = min(triton.next_power_of_2(num_heads), max(1, 4096 // (block_splits * _block_d(head_dim))))
        _paged_decode_reduce_kernel[(num_seqs, triton.cdiv(num_heads, block_heads))](
            partial_out, partial_max, partial_sum, query_start_loc, out, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim), NUM_SPLITS=num_splits,
            BLOCK_SPLITS=block_splits, BLOCK_HEADS=block_heads, num_warps=4)
    return out
