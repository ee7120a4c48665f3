"""Experiment: a persistent decode-attention kernel (one split) that loads the next item's step
inputs and query rows while it works on the current one. Compared with the engine's kernel on the
schedule's steps with one split. Scratch; not part of the tree."""
import collections, sys
import torch
import triton
import triton.language as tl
sys.path.insert(0, ".")    # from the repo root: PYTHONPATH=. python benchmarks/variants/THIS.py [every]
from benchmarks.decode_sweep import (decode_schedule, graph_size, time_us, make_kv_cache, decode_step_inputs,
                                     scattered_block_tables, NUM_KV_HEADS, NUM_HEADS, HEAD_DIM, BLOCK_SIZE,
                                     MAX_MODEL_LEN, LAYERS)
from mini_engine.kernels.paged_attention import (_attend_tile, _empty_softmax_state, _load_query_rows, _row_blocks,
                                                 _cache_strides, _num_sms, decode_num_splits, decode_num_stages,
                                                 paged_decode_attention, _block_d)
from mini_engine.kernels.triton_utils import pdl_enter, pdl_options


@triton.jit
def _item_of(rnd, pid, G, SNAKE: tl.constexpr):
    if SNAKE:
        return rnd * G + tl.where(rnd % 2 == 0, pid, G - 1 - pid)
    else:
        return rnd * G + pid


@triton.jit
def _persistent_decode_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, out_ptr, qk_scale,
        table_width, num_items, stride_q_token, stride_q_head, stride_out_token, stride_out_head, stride_block_table,
        stride_k_block, stride_k_offset, stride_k_head, stride_v_block, stride_v_offset, stride_v_head,
        NUM_KV_HEADS: tl.constexpr, QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, ROW_BLOCKS: tl.constexpr,
        DOT_IN_FP32: tl.constexpr, SNAKE: tl.constexpr, PREFETCH_Q: tl.constexpr, USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    rows = tl.arange(0, BLOCK_M)
    row_valid = rows < QUERIES_PER_KV
    row_cols = tl.arange(0, ROW_BLOCKS)
    item = pid
    # items past the last load the last item's inputs (in bounds, and never used)
    seq = tl.minimum(item, num_items - 1) // NUM_KV_HEADS
    row_blocks = tl.load(block_tables_ptr + seq.to(tl.int64) * stride_block_table + row_cols,
                         mask=row_cols < table_width, other=-1)
    seq_len = tl.load(seq_lens_ptr + seq)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    pdl_enter(USE_PDL)
    head = (item % NUM_KV_HEADS) * QUERIES_PER_KV + rows
    q, q_mask, offs_d = _load_query_rows(q_ptr, token * stride_q_token + head * stride_q_head, row_valid,
                                         HEAD_DIM, BLOCK_D, DOT_IN_FP32)
    rnd = 0
    while item < num_items:
        kv_head = item % NUM_KV_HEADS
        head = kv_head * QUERIES_PER_KV + rows
        if not PREFETCH_Q:
            q, q_mask, offs_d = _load_query_rows(q_ptr, token * stride_q_token + head * stride_q_head, row_valid,
                                                 HEAD_DIM, BLOCK_D, DOT_IN_FP32)
        nxt = _item_of(rnd + 1, pid, G, SNAKE)
        n_seq = tl.minimum(nxt, num_items - 1) // NUM_KV_HEADS
        n_row_blocks = tl.load(block_tables_ptr + n_seq.to(tl.int64) * stride_block_table + row_cols,
                               mask=row_cols < table_width, other=-1)
        n_seq_len = tl.load(seq_lens_ptr + n_seq)
        n_token = tl.load(query_start_loc_ptr + n_seq).to(tl.int64)
        if PREFETCH_Q:
            n_head = (nxt % NUM_KV_HEADS) * QUERIES_PER_KV + rows
            n_q, _, _ = _load_query_rows(q_ptr, n_token * stride_q_token + n_head * stride_q_head, row_valid,
                                         HEAD_DIM, BLOCK_D, DOT_IN_FP32)
        m_i, l_i, acc = _empty_softmax_state(BLOCK_M, BLOCK_D)
        for tile in range(0, tl.cdiv(seq_len, TILE_N)):
            offs_n = tile * TILE_N + tl.arange(0, TILE_N)
            block = tl.gather(row_blocks, tl.minimum(offs_n // BLOCK_SIZE, ROW_BLOCKS - 1), axis=0)
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block, offs_n, kv_head,
                                         seq_len, rows, qk_scale, stride_k_block, stride_k_offset,
                                         stride_k_head, stride_v_block, stride_v_offset, stride_v_head,
                                         BLOCK_SIZE, HEAD_DIM, BLOCK_D, False)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + token * stride_out_token + head[:, None] * stride_out_head + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask)
        item, seq_len, token, row_blocks = nxt, n_seq_len, n_token, n_row_blocks
        if PREFETCH_Q:
            q = n_q
        rnd += 1


def persistent_decode(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out, programs_per_sm,
                      num_stages, snake=True, prefetch_q=True, tile_n=64):
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    num_items = seq_lens.shape[0] * num_kv_heads
    grid = min(num_items, programs_per_sm * _num_sms(q.device))
    block_size, table_width = k_cache.shape[1], block_tables.shape[1]
    pdl = pdl_options(q.device)
    return _persistent_decode_kernel[(grid,)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, scale * 1.4426950408889634, table_width,
        num_items, q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *_cache_strides(k_cache, v_cache), NUM_KV_HEADS=num_kv_heads, QUERIES_PER_KV=num_heads // num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim), BLOCK_SIZE=block_size, BLOCK_M=16, TILE_N=tile_n,
        ROW_BLOCKS=_row_blocks(table_width, block_size, tile_n), DOT_IN_FP32=q.device.type == "cpu", SNAKE=snake,
        PREFETCH_Q=prefetch_q, num_warps=4, num_stages=num_stages, **pdl)


def main():
    every = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    schedule = decode_schedule()
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_blocks = max(sum(c) for c in schedule) // BLOCK_SIZE + len(schedule[0]) + 64
    k_cache, v_cache = make_kv_cache(num_blocks, BLOCK_SIZE, "token", gen)
    scale = HEAD_DIM ** -0.5
    variants = {}
    for pps, stages in ((4, 2), (3, 3), (3, 2), (2, 4)):
        variants[f"persistent {pps}/SM s{stages}"] = dict(programs_per_sm=pps, num_stages=stages)
    variants["persistent 4/SM s2 round-robin"] = dict(programs_per_sm=4, num_stages=2, snake=False)
    variants["persistent 4/SM s2 q not prefetched"] = dict(programs_per_sm=4, num_stages=2, prefetch_q=False)
    totals = collections.Counter()
    by_graph = collections.defaultdict(collections.Counter)
    compiled = {}
    for step in range(0, len(schedule), every):
        ctx = schedule[step]
        bs = graph_size(len(ctx))
        if decode_num_splits(bs, NUM_KV_HEADS, MAX_MODEL_LEN, 64, _num_sms(torch.device("cuda")), decode_num_stages(bs)) > 1:
            continue
        seq_lens, q, sl, qsl, out = decode_step_inputs(ctx, gen)
        tables = scattered_block_tables(seq_lens, BLOCK_SIZE, num_blocks, gen)
        ref = paged_decode_attention(q, k_cache, v_cache, tables, sl, qsl, scale, MAX_MODEL_LEN)
        row = {"engine": time_us(lambda: paged_decode_attention(q, k_cache, v_cache, tables, sl, qsl, scale,
                                                                 MAX_MODEL_LEN, out))}
        for name, kw in variants.items():
            o = torch.empty_like(q)
            compiled[name] = persistent_decode(q, k_cache, v_cache, tables, sl, qsl, scale, o, **kw)
            err = (o.float() - ref.float()).abs().max().item()
            assert err < 1e-2, (name, err)
            row[name] = time_us(lambda kw=kw, o=o: persistent_decode(q, k_cache, v_cache, tables, sl, qsl, scale, o, **kw))
        w = min(every, len(schedule) - step) * LAYERS / 1e6
        for name, us in row.items():
            totals[name] += us * w
            by_graph[bs][name] += us * w
        best = min(row, key=row.get)
        print(f"step {step+1:4d} batch {len(ctx):3d} graph {bs:3d}: engine {row['engine']:6.1f}  " +
              "  ".join(f"{n.replace('persistent ', 'p')} {u:6.1f}" for n, u in row.items() if n != "engine") +
              f"  best {best}", flush=True)
    print("run totals (s, steps with one split):")
    for name, s in sorted(totals.items(), key=lambda kv: kv[1]):
        print(f"  {name:<40} {s:6.3f}")
    print("per graph size, best:")
    saved = 0.0
    for bs in sorted(by_graph):
        t = by_graph[bs]
        best = min(t, key=t.get)
        saved += t["engine"] - t[best]
        print(f"  graph {bs:3d}: {best:<40} {t[best]:6.3f} against engine {t['engine']:6.3f}")
    print(f"best per size saves {saved*1e3:.1f} ms")
    for name, k in compiled.items():
        print(f"  {name}: regs {k.n_regs} spills {k.n_spills} shared {k.metadata.shared}")


if __name__ == "__main__":
    main()
