"""Experiment: decode attention at 2 stages capped at 96 registers, so that 5 programs share an SM
(104 registers hold it to 4), against the engine's kernel. Scratch; not part of the tree."""
import collections, math, sys
import torch
import triton
sys.path.insert(0, ".")    # from the repo root: PYTHONPATH=. python benchmarks/variants/THIS.py [every]
from benchmarks.decode_sweep import (decode_schedule, graph_size, time_us, make_kv_cache, decode_step_inputs,
                                     scattered_block_tables, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, MAX_MODEL_LEN, LAYERS)
import mini_engine.kernels.paged_attention as pa
from mini_engine.kernels.triton_utils import pdl_options


def launch(q, k_cache, v_cache, tables, sl, qsl, out, stages, programs_per_sm, maxnreg, partial):
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_seqs = sl.shape[0]
    slots = programs_per_sm * pa._num_sms(q.device)
    splits = max(1, min(triton.cdiv(slots, num_seqs * NUM_KV_HEADS), triton.cdiv(MAX_MODEL_LEN, 64), 64))
    if splits > 1 and splits not in partial:
        partial[splits] = tuple(torch.empty(num_seqs * num_heads * splits * (128 if i == 2 else 1), device="cuda")
                                for i in range(3))
    pm, ps, po = partial[splits] if splits > 1 else (out, out, out)
    extra = {"maxnreg": maxnreg} if maxnreg else {}
    k = pa._paged_decode_kernel[(splits, NUM_KV_HEADS, num_seqs)](
        q, k_cache, v_cache, tables, sl, qsl, out, po, pm, ps, (head_dim ** -0.5) * math.log2(math.e), tables.shape[1],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), tables.stride(0), *pa._cache_strides(k_cache, v_cache),
        NUM_HEADS=num_heads, QUERIES_PER_KV=num_heads // NUM_KV_HEADS, HEAD_DIM=head_dim, BLOCK_D=128,
        BLOCK_SIZE=BLOCK_SIZE, BLOCK_M=16, TILE_N=64, NUM_SPLITS=splits, ROW_BLOCKS=128, DOT_IN_FP32=False,
        num_warps=4, num_stages=stages, **pdl_options(q.device), **extra)
    if splits > 1:
        bs_ = triton.next_power_of_2(splits)
        bh = min(16, max(1, 4096 // (bs_ * 128)))
        pa._paged_decode_reduce_kernel[(num_seqs, triton.cdiv(num_heads, bh))](
            po, pm, ps, qsl, out, out.stride(0), out.stride(1), NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=128,
            NUM_SPLITS=splits, BLOCK_SPLITS=bs_, BLOCK_HEADS=bh, num_warps=4, **pdl_options(q.device))
    return k


def main():
    every = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    schedule = decode_schedule()
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_blocks = max(sum(c) for c in schedule) // BLOCK_SIZE + len(schedule[0]) + 64
    k_cache, v_cache = make_kv_cache(num_blocks, BLOCK_SIZE, "token", gen)
    variants = {"s2 x5 maxnreg 96": (2, 5, 96), "s2 x4 (free regs)": (2, 4, None), "s3 x3 (free regs)": (3, 3, None),
                "s2 x5 maxnreg 96, splits for 4": (2, 4, 96)}
    totals = collections.Counter()
    by_graph = collections.defaultdict(collections.Counter)
    compiled = {}
    partial = {}
    for step in range(0, len(schedule), every):
        ctx = schedule[step]
        bs = graph_size(len(ctx))
        seq_lens, q, sl, qsl, out = decode_step_inputs(ctx, gen)
        tables = scattered_block_tables(seq_lens, BLOCK_SIZE, num_blocks, gen)
        ref = pa.paged_decode_attention(q, k_cache, v_cache, tables, sl, qsl, HEAD_DIM ** -0.5, MAX_MODEL_LEN)
        row = {"engine": time_us(lambda: pa.paged_decode_attention(q, k_cache, v_cache, tables, sl, qsl, HEAD_DIM ** -0.5,
                                                                    MAX_MODEL_LEN, out))}
        partial.clear()
        for name, (stages, pps, maxnreg) in variants.items():
            o = torch.empty_like(q)
            compiled[name] = launch(q, k_cache, v_cache, tables, sl, qsl, o, stages, pps, maxnreg, partial)
            err = (o.float() - ref.float()).abs().max().item()
            assert err < 2e-2, (name, err)
            row[name] = time_us(lambda a=(stages, pps, maxnreg), o=o: launch(q, k_cache, v_cache, tables, sl, qsl, o, *a, partial))
        w = min(every, len(schedule) - step) * LAYERS / 1e6
        for name, us in row.items():
            totals[name] += us * w
            by_graph[bs][name] += us * w
        print(f"step {step+1:4d} batch {len(ctx):3d} graph {bs:3d}: " + "  ".join(f"{n} {u:6.1f}" for n, u in row.items()),
              flush=True)
    print("run totals (s):")
    for name, s in sorted(totals.items(), key=lambda kv: kv[1]):
        print(f"  {name:<36} {s:6.3f}")
    saved = 0.0
    for bs in sorted(by_graph):
        t = by_graph[bs]
        best = min(t, key=t.get)
        saved += t["engine"] - t[best]
        print(f"  graph {bs:3d}: {best:<36} {t[best]:6.3f} against engine {t['engine']:6.3f}")
    print(f"best per size saves {saved*1e3:.1f} ms")
    for name, k in compiled.items():
        print(f"  {name}: regs {k.n_regs} spills {k.n_spills} shared {k.metadata.shared}")


if __name__ == "__main__":
    main()
