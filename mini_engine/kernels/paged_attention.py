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
    block_size = k_cache.shape[1]
    num_blocks = (max_seq_len + block_size - 1) // block_size
    blocks = block_tables[:, :num_blocks].clamp(min=0).long()
    k = k_cache[blocks].flatten(1, 2).transpose(1, 2).to(q.dtype)     # [B, Hkv, L, D]
    v = v_cache[blocks].flatten(1, 2).transpose(1, 2).to(q.dtype)      # (an fp8 cache: dequantised)
    mask = torch.arange(k.shape[2], device=q.device)[None, :] < seq_lens[:, None]
    # Slots past a sequence's end hold whatever was there, and a masked score or weight does not
    # cancel a stale NaN (NaN - inf and 0 * NaN are NaN): clear them.
    stale = ~mask[:, None, :, None]
    k, v = k.masked_fill(stale, 0), v.masked_fill(stale, 0)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :],
                                         scale=scale, enable_gqa=True)
    return out.squeeze(2)


# ---- Triton ----
#
# Both kernels read K and V straight from the block pool: a tile of TILE_N context tokens looks up
# each token's block in the block table (token // block_size), so a tile may span several blocks
# (block_size 16, tile 64) or part of one (block_size 256), and any block_size >= 1 works. Each
# program owns one KV head and all the query heads that share it (GQA), so every K/V tile is loaded
# once per group. The query rows of a program are (token, head) pairs, row r = token * QH + head,
# padded to BLOCK_M >= 16 rows (tl.dot's minimum); softmax is online, in base 2. K and V are
# converted to q's dtype as they load: a no-op for a cache in the model's dtype, and how an fp8
# cache dequantises (its values are stored unscaled: EngineConfig.kv_cache_dtype).

import math  # noqa: E402

import numpy as np  # noqa: E402

from mini_engine.kernels.rotary_kv import FP8_DTYPES  # noqa: E402
from mini_engine.kernels.triton_utils import num_sms, pdl_enter, pdl_options, tl, triton  # noqa: E402


@triton.jit
def _rows_mask(row_valid, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Mask of a [rows, BLOCK_D] tile: the valid rows, and where BLOCK_D pads head_dim up to a
    power of two >= 16 (tl.dot's minimum), the columns < HEAD_DIM. Decided at compile time, so
    the usual head_dim 128 gets a row mask only."""
    if BLOCK_D == HEAD_DIM:
        return row_valid[:, None]
    else:
        return row_valid[:, None] & (offs_d[None, :] < HEAD_DIM)


@triton.jit
def _load_query_rows(q_ptr, row_offsets, row_valid, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                     DOT_DTYPE: tl.constexpr):
    """The program's query rows [BLOCK_M, BLOCK_D], row r at q_ptr + row_offsets[r] (zeros where
    not valid), in DOT_DTYPE (_dot_dtype), with their mask and the column offsets, which the
    output store reuses."""
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = _rows_mask(row_valid, offs_d, HEAD_DIM, BLOCK_D)
    q = tl.load(q_ptr + row_offsets[:, None] + offs_d[None, :], mask=q_mask, other=0.0)
    return q.to(DOT_DTYPE), q_mask, offs_d


@triton.jit
def _empty_softmax_state(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Running max, sum and accumulator of an online softmax that has seen no key yet."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    return m_i, l_i, acc


@triton.jit
def _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block, offs_n, kv_head, seq_len,
                 query_pos, qk_scale, stride_k_block, stride_k_offset, stride_k_head,
                 stride_v_block, stride_v_offset, stride_v_head,
                 BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                 FULL: tl.constexpr = False):
    """Folds the context tokens offs_n [TILE_N] (one tile, whose block-table entries are block)
    into the running softmax state (m_i, l_i, acc) of the query rows q [BLOCK_M, D]. Tokens past
    seq_len, behind a -1 block-table entry, or (CAUSAL) after a row's position are masked and
    never read. FULL: the caller knows that every token of the tile is in the context and visible
    to every row, so nothing is masked (the prefill's tiles below its query block's diagonal)."""
    if FULL:
        valid = offs_n >= 0
    else:
        valid = (offs_n < seq_len) & (block >= 0)
        block = tl.maximum(block, 0)
    block = block.to(tl.int64)
    offset = (offs_n % BLOCK_SIZE).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    k_ptrs = k_cache_ptr + (block * stride_k_block + offset * stride_k_offset + kv_head * stride_k_head)[:, None]
    v_ptrs = v_cache_ptr + (block * stride_v_block + offset * stride_v_offset + kv_head * stride_v_head)[:, None]
    if FULL and BLOCK_D == HEAD_DIM:
        k = tl.load(k_ptrs + offs_d[None, :]).to(q.dtype)
        v = tl.load(v_ptrs + offs_d[None, :]).to(q.dtype)
    else:
        kv_mask = _rows_mask(valid, offs_d, HEAD_DIM, BLOCK_D)
        k = tl.load(k_ptrs + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(v_ptrs + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)

    s = tl.dot(q, tl.trans(k)) * qk_scale                  # [BLOCK_M, TILE_N], log2 units
    if not FULL:
        keep = valid[None, :]
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= query_pos[:, None])
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row that has seen no key yet keeps m = -inf; shift by 0 instead so exp2 gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _paged_decode_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
        out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr, qk_scale, table_width,
        stride_q_token, stride_q_head, stride_out_token, stride_out_head, stride_block_table,
        stride_k_block, stride_k_offset, stride_k_head, stride_v_block, stride_v_offset, stride_v_head,
        NUM_HEADS: tl.constexpr, QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
        ROW_BLOCKS: tl.constexpr, DOT_DTYPE: tl.constexpr, USE_PDL: tl.constexpr):
    """Flash-decoding, first half. Program (split, kv_head, seq): the one query token of sequence
    seq, for the QUERIES_PER_KV heads sharing kv_head, against the split-th of NUM_SPLITS equal
    shares of the sequence's context tiles. The share is computed here from seq_lens, so the grid
    depends only on the batch shape (CUDA-graph safe) and a short context just leaves some splits
    empty. With one split the result is final and goes straight to out; otherwise the unnormalised
    accumulator, running max and sum go to the partial buffers for _paged_decode_reduce_kernel.

    The grid's order is measured, not arbitrary: the GPU starts programs x fastest, so this one
    starts all of a sequence's programs together, sequence after sequence. On the H200 the whole
    benchmark ran 5.24 s against 5.33-5.37 s with the sequence fastest (benchmarks/NOTES.md,
    entry 18). A start order read from memory (longest context first) cost more than it won: one
    more dependent load before each program's first tile.

    That chain is also why the program reads its sequence's whole block-table row (ROW_BLOCKS > 0:
    the row fits a few registers) together with seq_len, and picks each tile's block ids out of it
    with tl.gather: the first K/V load then waits for one round trip to memory, not two in a row
    (seq_len, then the tile's ids), and the tile loop loads nothing but K and V. On the H200 this
    freed registers too (104 a thread at tile 64 against 168 at tile 128 with per-tile id loads),
    and the whole benchmark ran ~0.1-0.2 s faster (benchmarks/NOTES.md, entry 22). A longer row
    falls back to loading each tile's ids (ROW_BLOCKS = 0)."""
    split = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    if ROW_BLOCKS > 0:
        row_cols = tl.arange(0, ROW_BLOCKS)
        row_blocks = tl.load(block_table_ptr + row_cols, mask=row_cols < table_width, other=-1)
    seq_len = tl.load(seq_lens_ptr + seq)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    # The step inputs above are written by no kernel of the step; q, and the newest token's slot
    # in the cache, by the rotary kernel ahead.
    pdl_enter(USE_PDL)

    num_tiles = tl.cdiv(seq_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    rows = tl.arange(0, BLOCK_M)
    row_valid = rows < QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + rows
    q, q_mask, offs_d = _load_query_rows(q_ptr, token * stride_q_token + head * stride_q_head, row_valid,
                                         HEAD_DIM, BLOCK_D, DOT_DTYPE)
    m_i, l_i, acc = _empty_softmax_state(BLOCK_M, BLOCK_D)
    for tile in range(tile_lo, tile_hi):
        offs_n = tile * TILE_N + tl.arange(0, TILE_N)
        if ROW_BLOCKS > 0:
            # tiles past the row's end (only ever masked tokens of a tile) read its last entry
            block = tl.gather(row_blocks, tl.minimum(offs_n // BLOCK_SIZE, ROW_BLOCKS - 1), axis=0)
        else:
            block = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=offs_n < seq_len, other=-1)
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block, offs_n, kv_head,
                                     seq_len, rows, qk_scale, stride_k_block, stride_k_offset,
                                     stride_k_head, stride_v_block, stride_v_offset, stride_v_head,
                                     BLOCK_SIZE, HEAD_DIM, BLOCK_D, False)

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + token * stride_out_token + head[:, None] * stride_out_head + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # partial buffers: [num_seqs, NUM_HEADS, NUM_SPLITS] (+ [BLOCK_D] for the accumulator)
        part = (seq.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(partial_max_ptr + part, m_i, mask=row_valid)
        tl.store(partial_sum_ptr + part, l_i, mask=row_valid)
        tl.store(partial_out_ptr + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=row_valid[:, None])


@triton.jit
def _paged_decode_reduce_kernel(
        partial_out_ptr, partial_max_ptr, partial_sum_ptr, query_start_loc_ptr, out_ptr,
        stride_out_token, stride_out_head,
        NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
        BLOCK_SPLITS: tl.constexpr, BLOCK_HEADS: tl.constexpr, USE_PDL: tl.constexpr):
    """Flash-decoding, second half. Program (seq, head block): for each of BLOCK_HEADS heads,
    rescales each split's partial result by exp2(its max - the overall max) and divides by the
    rescaled total sum. Empty splits carry max -inf and sum 0 and drop out; a row with no context
    at all gets zeros. Several heads a program: with one tiny program per (seq, head), launching
    them was the cost (on the H200 at 256 sequences x 2 splits: 4.67 us one head a program, 2.24 us
    sixteen; at 64 sequences 2.27 -> 1.86 us)."""
    pdl_enter(USE_PDL)
    seq = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    splits = tl.arange(0, BLOCK_SPLITS)
    valid = (heads[:, None] < NUM_HEADS) & (splits[None, :] < NUM_SPLITS)          # [H, S]
    part = (seq.to(tl.int64) * NUM_HEADS + heads[:, None]) * NUM_SPLITS + splits[None, :]
    m = tl.load(partial_max_ptr + part, mask=valid, other=float("-inf"))
    l = tl.load(partial_sum_ptr + part, mask=valid, other=0.0)
    m_max = tl.max(m, axis=1)
    weight = tl.math.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max)[:, None])    # [H, S]
    total = tl.sum(weight * l, axis=1)
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.load(partial_out_ptr + part[:, :, None] * BLOCK_D + offs_d[None, None, :], mask=valid[:, :, None],
                  other=0.0)                                                          # [H, S, D]
    out = tl.sum(acc * weight[:, :, None], axis=1) / tl.where(total == 0.0, 1.0, total)[:, None]
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    tl.store(out_ptr + token * stride_out_token + heads[:, None] * stride_out_head + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(heads[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM))


# The block table's row stride is its width, the batch's longest sequence in blocks, which moves
# from step to step. Specialised (Triton's divisible-by-16 variant), a width that first turned a
# multiple of 16 mid-run compiled a second kernel there: +0.9 and +1.3 s at block size 64
# (benchmarks/NOTES.md, entry 42). The prefill kernel gathers block ids, so it loses nothing.
@triton.jit(do_not_specialize=["stride_block_table"])
def _paged_prefill_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, work_ptr, out_ptr, qk_scale,
        stride_q_token, stride_q_head, stride_out_token, stride_out_head, stride_block_table,
        stride_k_block, stride_k_offset, stride_k_head, stride_v_block, stride_v_offset, stride_v_head,
        NUM_KV_HEADS: tl.constexpr, QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
        DOT_DTYPE: tl.constexpr):
    """The whole variable-length batch in one launch (prefill chunks, prefix hits, and decode rows as
    queries of length 1). Program (item, kv_head), the KV head fastest: work item `item` of
    prefill_work (up to BLOCK_Q consecutive query tokens of one sequence) times the
    QUERIES_PER_KV heads of kv_head, against that sequence's context up to the block's last query
    position, with the causal mask. The item gives the program its sequence and queries in one
    load: searching query_start_loc for them, as this kernel did before, put one more round trip
    to memory ahead of every program's first tile (on the H200, 211.5 against 193.6 us a layer on
    the benchmark's first prefill step; benchmarks/NOTES.md, entry 37)."""
    pid = tl.program_id(0)
    kv_head = pid % NUM_KV_HEADS
    item = work_ptr + (pid // NUM_KV_HEADS) * 4
    seq = tl.load(item)
    first_token = tl.load(item + 1)
    num_queries = tl.load(item + 2)
    first_pos = tl.load(item + 3)

    rows = tl.arange(0, BLOCK_M)
    q_index = rows // QUERIES_PER_KV                          # index within the item's queries
    row_valid = (rows < BLOCK_Q * QUERIES_PER_KV) & (q_index < num_queries)
    head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    token = (first_token + q_index).to(tl.int64)
    query_pos = first_pos + q_index
    q, q_mask, offs_d = _load_query_rows(q_ptr, token * stride_q_token + head * stride_q_head, row_valid,
                                         HEAD_DIM, BLOCK_D, DOT_DTYPE)
    m_i, l_i, acc = _empty_softmax_state(BLOCK_M, BLOCK_D)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    # Keys up to the last query position of this block (masked rows hold smaller positions).
    kv_len = first_pos + num_queries
    # The tiles that end at or before the block's first query position are seen whole by every
    # row: they skip the masks, and only the tiles along the diagonal pay for them.
    full_tiles = (first_pos + 1) // TILE_N
    for tile in range(0, full_tiles):
        offs_n = tile * TILE_N + tl.arange(0, TILE_N)
        block = tl.load(block_table_ptr + offs_n // BLOCK_SIZE)
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block, offs_n, kv_head,
                                     kv_len, query_pos, qk_scale, stride_k_block, stride_k_offset,
                                     stride_k_head, stride_v_block, stride_v_offset, stride_v_head,
                                     BLOCK_SIZE, HEAD_DIM, BLOCK_D, True, FULL=True)
    for tile in range(full_tiles, tl.cdiv(kv_len, TILE_N)):
        offs_n = tile * TILE_N + tl.arange(0, TILE_N)
        block = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=offs_n < kv_len, other=-1)
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block, offs_n, kv_head,
                                     kv_len, query_pos, qk_scale, stride_k_block, stride_k_offset,
                                     stride_k_head, stride_v_block, stride_v_offset, stride_v_head,
                                     BLOCK_SIZE, HEAD_DIM, BLOCK_D, True)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + token[:, None] * stride_out_token + head[:, None] * stride_out_head + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


# Pipeline stages of the decode kernel. Stages set both the tiles a program keeps in flight and how
# many programs an SM holds (DECODE_PROGRAMS_PER_SM). At 16-token KV blocks the H200 measured other
# stage and split counts faster at some batch sizes (benchmarks/NOTES.md, entries 35 and 39), and
# the engine kept them in tables; at its 64-token blocks those tables made no difference to whole
# runs (entry 43), so every batch takes 3 stages and decode_num_splits's rule.
DECODE_STAGES = 3

# Context tokens a decode tile: the fastest of entry 22's sweep. paged_decode_attention's default,
# and the tile decode_workspace_numel sizes the engine's splits for.
DECODE_TILE_N = 64

# Decode programs resident on one SM at a time, by pipeline stages: at the default tile (64 tokens)
# a program takes 38 / 70 / 102 KB of shared memory at 2 / 3 / 4 stages, so 3 or 2 fit the H200's
# 228 KB at 3 or 4 stages; at 2 stages the registers (104-108 a thread at 4 warps, as compiled on
# the H200) hold it to 4.
DECODE_PROGRAMS_PER_SM = {2: 4, 3: 3, 4: 2}


def decode_programs_per_sm(num_stages: int) -> int:
    """DECODE_PROGRAMS_PER_SM; a stage count outside it (sweeps) counts as the default's."""
    return DECODE_PROGRAMS_PER_SM.get(num_stages, DECODE_PROGRAMS_PER_SM[DECODE_STAGES])


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, tile_n: int, num_sms: int,
                      num_stages: int) -> int:
    """How many programs share one (sequence, KV head): enough to fill every program slot of the GPU
    at once (slots: decode_programs_per_sm(num_stages) times the SMs), one where the batch alone
    fills it, which then needs no reduce kernel. (Half the slots, the rule before, left 33-48
    sequences at one split and ~11 us a layer slower than with two: benchmarks/NOTES.md, entry 32.)
    Never more than the longest context has tiles. Host ints only, so a captured graph keeps its
    grid."""
    tiles = triton.cdiv(max_seq_len, tile_n)
    programs = num_seqs * num_kv_heads
    slots = decode_programs_per_sm(num_stages) * num_sms
    return max(1, min(triton.cdiv(slots, programs), tiles, 64))


# How many block-table entries a decode program keeps in registers (one, four or eight a thread at
# 4 warps): the smallest of these that holds every block a tile can reach. A few sizes, not one per
# table width, so that an eager run, whose tables are as wide as the batch's longest sequence,
# compiles at most three variants. 1,024 covers Qwen3's default max_model_len, 40,960 tokens, at
# CUDA's 64-token blocks: with per-tile id loads instead, the benchmark at that max_model_len took
# 5.16 s against 4.73 s (benchmarks/NOTES.md, entry 45). A longer row (above 65,536 tokens at
# 64-token blocks, 16,384 at 16-token ones) loads each tile's ids.
ROW_BLOCKS_SIZES = (128, 512, 1024)


def _row_blocks(table_width: int, block_size: int, tile_n: int) -> int:
    """The decode kernel's ROW_BLOCKS for a block table table_width entries wide: the smallest size
    in ROW_BLOCKS_SIZES covering the row rounded up to whole tiles, or 0 where none does."""
    reach = triton.cdiv(table_width * block_size, tile_n) * tile_n // block_size
    return next((size for size in ROW_BLOCKS_SIZES if reach <= size), 0)


# torch dtypes as tl.dot operand types, for the kernels' DOT_DTYPE
_TL_DOT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _dot_dtype(q: torch.Tensor, k_cache: torch.Tensor, dot_dtype: torch.dtype | None = None):
    """The type q, K and V take in the kernels' tl.dot (K and V converted as they load), unless
    dot_dtype says. Triton 3.9's interpreter (CPU tensors) multiplies bf16/fp16 operands wrongly:
    there, fp32 copies. On the GPU, the model dtype; but a bf16 model over an fp8 cache takes fp16:
    on Hopper e4m3 and e5m2 convert to fp16 in one instruction for two values, and to bf16 only
    through fp16 and fp32, and the conversions, not the bytes, then bound decode attention
    (benchmarks/NOTES.md, entry 50). fp16 keeps more of a bf16 q's bits, and Qwen3's normed q fits
    its range, as do e4m3's +-448 and e5m2's +-57344."""
    if dot_dtype is None:
        if q.device.type == "cpu":
            dot_dtype = torch.float32
        elif k_cache.dtype in FP8_DTYPES and q.dtype == torch.bfloat16:
            dot_dtype = torch.float16
        else:
            dot_dtype = q.dtype
    return _TL_DOT_DTYPES[dot_dtype]


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _check_shapes(q, k_cache, v_cache, block_tables):
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0 and q.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and block_tables.stride(-1) == 1
    return num_heads, num_kv_heads, head_dim


def _cache_strides(k_cache, v_cache):
    return (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))


def _partials_layout(num_rows: int, head_dim: int) -> tuple[int, int]:
    """(gap, numel) of num_rows split partials laid out as accumulators, then maxima, then sums:
    the later two start gap rows in (num_rows rounded up to 4, so that each view stays 16-byte
    aligned, as Triton specialises on it), and the three take numel fp32 values."""
    gap = -(-num_rows // 4) * 4
    return gap, gap * (_block_d(head_dim) + 2)


def _split_partials(workspace: torch.Tensor | None, num_seqs: int, num_heads: int, num_splits: int,
                    head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split programs' partial accumulators [S, H, splits, BLOCK_D], maxima and sums [S, H,
    splits], in fp32: views into workspace, or (none given) fresh tensors."""
    n, block_d = num_seqs * num_heads * num_splits, _block_d(head_dim)
    gap, numel = _partials_layout(n, head_dim)
    if workspace is None:
        workspace = torch.empty(numel, dtype=torch.float32, device=device)
    elif workspace.numel() < numel:
        raise ValueError(f"decode workspace holds {workspace.numel()} floats; {num_seqs} sequences x "
                         f"{num_splits} splits need {numel} (decode_workspace_numel)")
    shape = (num_seqs, num_heads, num_splits)
    partial_out = workspace[:n * block_d].view(*shape, block_d)
    partial_max = workspace[gap * block_d:gap * block_d + n].view(shape)
    partial_sum = workspace[gap * (block_d + 1):gap * (block_d + 1) + n].view(shape)
    return partial_out, partial_max, partial_sum


def decode_workspace_numel(max_num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                           max_seq_len: int, device: torch.device, tile_n: int = DECODE_TILE_N) -> int:
    """Floats of split partials that the engine's decode launches need at most, over every batch
    of 1 to max_num_seqs sequences whose contexts are at most max_seq_len tokens. The runner holds
    one workspace of this size for every layer and step: no allocation on the decode path, and none
    in the CUDA graphs' pool, whose sizing, taken from the largest batch, would not see a smaller
    batch with more splits holding larger partials (benchmarks/NOTES.md, entry 39)."""
    most = 0
    for num_seqs in range(1, max_num_seqs + 1):
        splits = decode_num_splits(num_seqs, num_kv_heads, max_seq_len, tile_n, num_sms(device), DECODE_STAGES)
        if splits > 1:
            most = max(most, _partials_layout(num_seqs * num_heads * splits, head_dim)[1])
    return most


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                           scale: float, max_seq_len: int, out: torch.Tensor | None = None,
                           num_splits: int | None = None, tile_n: int = DECODE_TILE_N, num_warps: int = 4,
                           num_stages: int | None = None, row_blocks_limit: int | None = None,
                           workspace: torch.Tensor | None = None, dot_dtype: torch.dtype | None = None
                           ) -> torch.Tensor:
    """Flash-decoding for batches of one query token per sequence. The tile, split and launch
    knobs are exposed for benchmarks and tests (row_blocks_limit: the most block-table entries a
    program may keep, 0 for per-tile id loads). paged_attention uses the defaults, the fastest of
    a sweep over the benchmark's schedule on the H200 (tile 64, 3 stages, 4 warps: 3.55 s of
    decode attention over the run, against 3.69 s for tile 128 with 2 stages; benchmarks/NOTES.md,
    entry 22), with DECODE_STAGES and decode_num_splits's split count.
    workspace: fp32 for the splits' partial results (decode_workspace_numel), allocated here if
    not given. dot_dtype: the dots' operand type where not _dot_dtype's choice."""
    num_heads, num_kv_heads, head_dim = _check_shapes(q, k_cache, v_cache, block_tables)
    out = torch.empty_like(q) if out is None else out
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0:
        return out
    if num_seqs > 65535:
        raise ValueError(f"decode attention takes at most 65,535 sequences a launch (CUDA's grid z), got {num_seqs}")
    queries_per_kv = num_heads // num_kv_heads
    if num_stages is None:
        num_stages = DECODE_STAGES
    if num_splits is None:
        num_splits = decode_num_splits(num_seqs, num_kv_heads, max_seq_len, tile_n, num_sms(q.device), num_stages)
    if num_splits > 1:
        partial_out, partial_max, partial_sum = _split_partials(workspace, num_seqs, num_heads, num_splits,
                                                                head_dim, q.device)
    else:
        partial_out = partial_max = partial_sum = out     # unused
    block_size, table_width = k_cache.shape[1], block_tables.shape[1]
    row_blocks = _row_blocks(table_width, block_size, tile_n)
    if row_blocks_limit is not None and row_blocks > row_blocks_limit:
        row_blocks = 0
    pdl = pdl_options(q.device)
    _paged_decode_kernel[(num_splits, num_kv_heads, num_seqs)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, partial_out, partial_max, partial_sum,
        scale * math.log2(math.e), table_width, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), *_cache_strides(k_cache, v_cache),
        NUM_HEADS=num_heads, QUERIES_PER_KV=queries_per_kv, HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim),
        BLOCK_SIZE=block_size, BLOCK_M=max(16, triton.next_power_of_2(queries_per_kv)), TILE_N=tile_n,
        NUM_SPLITS=num_splits, ROW_BLOCKS=row_blocks, DOT_DTYPE=_dot_dtype(q, k_cache, dot_dtype), num_warps=num_warps,
        num_stages=num_stages, **pdl)
    if num_splits > 1:
        block_splits = triton.next_power_of_2(num_splits)
        # as many heads as keep a program's partials at <= 4096 fp32 values (32 a thread)
        block_heads = min(triton.next_power_of_2(num_heads), max(1, 4096 // (block_splits * _block_d(head_dim))))
        _paged_decode_reduce_kernel[(num_seqs, triton.cdiv(num_heads, block_heads))](
            partial_out, partial_max, partial_sum, query_start_loc, out, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim), NUM_SPLITS=num_splits,
            BLOCK_SPLITS=block_splits, BLOCK_HEADS=block_heads, num_warps=4, **pdl)
    return out


# Query rows a prefill program holds: tokens times the query heads that share a KV head.
PREFILL_BLOCK_M = 64


def prefill_block_m(queries_per_kv: int, block_m: int = PREFILL_BLOCK_M) -> int:
    """Query rows of a prefill program: block_m, raised to the next power of two >= queries_per_kv
    (tl.arange's tile) where one token's query heads need more. Host arithmetic the runner calls at
    start-up whatever its kernels, so plain Python, not triton.next_power_of_2: triton is optional."""
    return max(block_m, 1 << (queries_per_kv - 1).bit_length())


def prefill_block_q(queries_per_kv: int, block_m: int = PREFILL_BLOCK_M) -> int:
    """Query tokens a prefill program (one work item) holds."""
    return prefill_block_m(queries_per_kv, block_m) // queries_per_kv


def prefill_work(query_lens, seq_lens, block_q: int) -> np.ndarray:
    """The varlen kernel's work list, built on the host from the step's lengths: one item for every
    block_q consecutive query tokens of a sequence, sequence by sequence, as [items, 4] int32 rows
    (sequence, its first query token's row in q, query tokens in the item, the first one's
    position). A sequence with no query tokens gets no item."""
    query_lens, seq_lens = np.asarray(query_lens, dtype=np.int64), np.asarray(seq_lens, dtype=np.int64)
    blocks = -(-query_lens // block_q)
    seq = np.repeat(np.arange(len(query_lens)), blocks)
    block = np.arange(blocks.sum()) - np.repeat(np.cumsum(blocks) - blocks, blocks)
    first_token = (np.cumsum(query_lens) - query_lens)[seq] + block * block_q
    num_queries = np.minimum(query_lens[seq] - block * block_q, block_q)
    first_pos = (seq_lens - query_lens)[seq] + block * block_q
    return np.stack([seq, first_token, num_queries, first_pos], axis=1).astype(np.int32)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                            scale: float, out: torch.Tensor | None = None, work: torch.Tensor | None = None,
                            block_m: int = PREFILL_BLOCK_M, tile_n: int = 32, num_warps: int = 4,
                            num_stages: int = 3) -> torch.Tensor:
    """One launch for a mixed variable-length batch (any query lengths). work: prefill_work for
    this batch with prefill_block_q(queries per KV head, block_m), on q's device (the engine stages
    it with the step's inputs); without it, built here from seq_lens and query_start_loc, which
    waits for the device. The tile (64 rows, 32 keys, 4 warps, 3 stages) is the fastest of
    fourteen on the benchmark's first prefill step (benchmarks/decode_sweep.py --sections prefill
    on the H200: 211 us a layer; 4 stages tie, 64 keys take 239 us, 128 rows with 8 warps 261 us;
    entry 37 measured the same order with the work list)."""
    num_heads, num_kv_heads, head_dim = _check_shapes(q, k_cache, v_cache, block_tables)
    out = torch.empty_like(q) if out is None else out
    num_tokens, num_seqs = q.shape[0], seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    queries_per_kv = num_heads // num_kv_heads
    block_m = prefill_block_m(queries_per_kv, block_m)
    block_q = block_m // queries_per_kv
    if work is None:
        query_lens = np.diff(query_start_loc.tolist())
        work = torch.from_numpy(prefill_work(query_lens, seq_lens.tolist(), block_q)).to(q.device)
    if work.shape[0] == 0:
        return out
    _paged_prefill_kernel[(work.shape[0] * num_kv_heads,)](
        q, k_cache, v_cache, block_tables, work, out, scale * math.log2(math.e),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *_cache_strides(k_cache, v_cache),
        NUM_KV_HEADS=num_kv_heads, QUERIES_PER_KV=queries_per_kv, HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim),
        BLOCK_SIZE=k_cache.shape[1], BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n,
        DOT_DTYPE=_dot_dtype(q, k_cache), num_warps=num_warps, num_stages=num_stages)
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                    max_seq_len: int, out: torch.Tensor | None = None,
                    prefill_work: torch.Tensor | None = None,
                    decode_workspace: torch.Tensor | None = None, decode_splits: int | None = None) -> torch.Tensor:
    """paged_attention_ref on the GPU: q [T, Hq, D] -> out [T, Hq, D]. A batch of single-token
    queries (max_query_len == 1) takes flash-decoding; anything else one varlen launch (over
    prefill_work, where given), with decode_workspace holding the decode splits' partial results
    where given, and decode_splits programs a sequence and KV head (None: decode_num_splits's rule
    for the batch). Every host choice of the decode path depends on shapes and the host ints only,
    so it can be graph-captured (pass max_seq_len = max_model_len there)."""
    if max_query_len == 1:
        return paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                      max_seq_len, out, num_splits=decode_splits, workspace=decode_workspace)
    return paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out,
                                   prefill_work)
