"""Tuning sweep for the decode step's kernels, weighted by the benchmark's own schedule.

bench.py's workload fixes, for every decode step, which sequences run and how long their contexts
are (all prompts are prefilled in the first few steps, then request i decodes until its
max_tokens). This script rebuilds that schedule, then times, with CUDA-graph replay so that launch
overhead is out of the picture:
  * decode attention on sampled steps of the schedule, for several split/tile choices;
  * every projection of a layer (qkv, o, gate_up, down) at every captured batch size, cuBLAS
    against the skinny Triton kernel's configurations;
  * prefill attention on the first prefill step, for a few tile shapes;
  * the sampler at a few batch sizes.
Each table ends with the run total it implies (28 layers x the steps at that batch size), so a
choice is judged by what it would save over the whole benchmark. Needs CUDA.

    PYTHONPATH=. python benchmarks/decode_sweep.py [--sections attention gemm sampler] [--out DIR]
"""
import argparse
import collections
import json
import os
import sys

import torch

from bench import make_workload

HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB, LAYERS = 1024, 16, 8, 128, 3072, 151936, 28
BLOCK_SIZE, MAX_MODEL_LEN, DTYPE = 16, 2048, torch.bfloat16
PROJECTIONS = {"qkv": ((NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, HIDDEN), "o": (HIDDEN, NUM_HEADS * HEAD_DIM),
               "gate_up": (2 * INTERMEDIATE, HIDDEN), "down": (HIDDEN, INTERMEDIATE)}


def decode_schedule() -> list[list[int]]:
    """Context length of every running sequence at each decode step s = 1 .. max(max_tokens) - 1:
    request i (prompt P, max_tokens M) decodes token s at context P + s while s < M."""
    prompts, max_tokens = make_workload()
    return [[len(p) + s for p, m in zip(prompts, max_tokens) if s < m] for s in range(1, max(max_tokens))]


def graph_size(batch: int) -> int:
    from mini_engine.runner.cuda_graph import graph_batch_sizes
    return next(s for s in graph_batch_sizes(256) if s >= batch)


def time_us(fn) -> float:
    import triton.testing
    return triton.testing.do_bench_cudagraph(fn, rep=10) * 1e3


def sweep_attention(schedule, every: int, results: dict):
    from mini_engine.kernels.paged_attention import paged_attention, paged_decode_attention
    gen = torch.Generator(device="cuda").manual_seed(0)
    max_tokens = max(sum(c) for c in schedule)
    num_blocks = max_tokens // BLOCK_SIZE + len(schedule[0]) + 64
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen, device="cuda").to(DTYPE)
    v_cache = torch.randn(shape, generator=gen, device="cuda").to(DTYPE)
    scale = HEAD_DIM ** -0.5
    configs = {"graph default": None}
    for tile, warps, stages, splits in ((128, 4, 2, 1), (128, 4, 2, 2), (128, 4, 2, 4), (64, 4, 3, 1), (64, 4, 3, 2),
                                        (128, 8, 2, 1)):
        configs[f"tile {tile} w{warps} s{stages} splits {splits}"] = dict(
            tile_n=tile, num_warps=warps, num_stages=stages, num_splits=splits)
    totals = collections.Counter()
    best_total, floor_total = 0.0, 0.0
    print(f"\n== decode attention, one layer, every {every}th step of the schedule (us) ==")
    for step in range(0, len(schedule), every):
        ctx = schedule[step]
        b = len(ctx)
        bs = graph_size(b)
        seq_lens = ctx + [1] * (bs - b)                      # padded rows, as the graph runs them
        perm = torch.randperm(num_blocks, generator=gen, device="cuda").to(torch.int32)
        width = MAX_MODEL_LEN // BLOCK_SIZE
        tables = torch.full((bs, width), 0, dtype=torch.int32, device="cuda")
        used = 0
        for row, n in enumerate(seq_lens):
            nb = -(-n // BLOCK_SIZE)
            tables[row, :nb] = perm[used:used + nb]
            used += nb
        q = torch.randn(bs, NUM_HEADS, HEAD_DIM, generator=gen, device="cuda").to(DTYPE)
        sl = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        qsl = torch.arange(bs + 1, dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)
        kv_bytes = 2 * sum(ctx) * NUM_KV_HEADS * HEAD_DIM * 2
        row = {}
        for name, cfg in configs.items():
            try:
                if cfg is None:
                    fn = lambda: paged_attention(q, k_cache, v_cache, tables, sl, qsl, scale, 1, MAX_MODEL_LEN, out)
                else:
                    fn = lambda cfg=cfg: paged_decode_attention(q, k_cache, v_cache, tables, sl, qsl, scale,
                                                                MAX_MODEL_LEN, out, **cfg)
                row[name] = time_us(fn)
            except Exception as e:                                 # e.g. a tile too big for shared memory
                row[name] = float("inf")
                print(f"  {name}: failed ({type(e).__name__}: {str(e)[:80]})")
        # us per layer -> s over the run: this step stands for itself and the every - 1 after it
        weight = min(every, len(schedule) - step) * LAYERS / 1e6
        for name, us in row.items():
            totals[name] += us * weight
        best_total += min(row.values()) * weight
        floor_total += kv_bytes / results["copy_GBps"] / 1e3 * weight
        best = min(row, key=row.get)
        print(f"  step {step + 1:4d} batch {b:3d} (graph {bs:3d}) mean ctx {sum(ctx) / b:6.0f}: "
              f"default {row['graph default']:7.1f}  best {row[best]:7.1f} ({best}) "
              f"{kv_bytes / row[best] / 1e3:5.0f} GB/s")
        results["attention"].append(dict(step=step + 1, batch=b, graph=bs, kv_bytes=kv_bytes, us=row))
    print("  run totals (s, 28 layers, all decode steps):")
    for name, s in sorted(totals.items(), key=lambda kv: kv[1]):
        print(f"    {name:<34} {s:6.3f}")
    print(f"    {'best per step':<34} {best_total:6.3f}\n    {'KV bytes at copy bandwidth':<34} {floor_total:6.3f}")
    results["attention_totals"] = dict(totals) | {"best_per_step": best_total, "copy_bw_floor": floor_total}


def sweep_prefill(results: dict):
    """The first prefill step of the benchmark: whole prompts, in order, up to 16,384 tokens."""
    from mini_engine.kernels.paged_attention import paged_prefill_attention
    prompts, _ = make_workload()
    lens, total = [], 0
    for p in prompts:
        if total + len(p) > 16384:
            break
        lens.append(len(p))
        total += len(p)
    gen = torch.Generator(device="cuda").manual_seed(1)
    blocks = [-(-n // BLOCK_SIZE) for n in lens]
    shape = (sum(blocks) + 1, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen, device="cuda").to(DTYPE)
    v_cache = torch.randn(shape, generator=gen, device="cuda").to(DTYPE)
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32, device="cuda")
    used = 0
    for row, nb in enumerate(blocks):
        tables[row, :nb] = torch.arange(used, used + nb, dtype=torch.int32)
        used += nb
    q = torch.randn(total, NUM_HEADS, HEAD_DIM, generator=gen, device="cuda").to(DTYPE)
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    out = torch.empty_like(q)
    flops = sum(4 * n * (n + 1) / 2 * HEAD_DIM * NUM_HEADS for n in lens)      # causal QK^T and PV
    print(f"\n== prefill attention: {len(lens)} prompts, {total} tokens, one layer ==")
    rows = []
    for block_m, tile_n, warps, stages in ((64, 64, 4, 2), (128, 64, 4, 2), (128, 64, 8, 2), (128, 128, 8, 2),
                                           (64, 128, 4, 2), (128, 64, 8, 3), (64, 32, 4, 3)):
        label = f"block_m {block_m} tile {tile_n} w{warps} s{stages}"
        try:
            us = time_us(lambda: paged_prefill_attention(q, k_cache, v_cache, tables, sl, qsl, HEAD_DIM ** -0.5, out,
                                                         block_m, tile_n, warps, stages))
        except Exception as e:
            print(f"  {label}: failed ({type(e).__name__}: {str(e)[:60]})")
            continue
        print(f"  {label:<28} {us:8.1f} us  {flops / us / 1e6:6.1f} TFLOP/s  x28 layers: {us * 28 / 1e3:6.2f} ms")
        rows.append(dict(config=label, us=us))
    results["prefill"] = rows


def skinny_configs():
    from mini_engine.kernels.linear import SkinnyConfig
    shapes = ((16, 256, 1, 4, 4), (16, 256, 2, 4, 4), (16, 256, 4, 4, 4), (16, 512, 1, 4, 3),
              (32, 256, 1, 4, 4), (32, 128, 1, 4, 6), (64, 128, 1, 4, 4), (128, 64, 1, 4, 4))
    return [SkinnyConfig(*s) for s in shapes]


def sweep_gemm(schedule, results: dict, max_rows: int = 256):
    import torch.nn.functional as F
    from mini_engine.kernels.linear import skinny_linear
    steps_at = collections.Counter(size for size in map(graph_size, map(len, schedule)) if size <= max_rows)
    configs = skinny_configs()
    cublas_total = collections.Counter()
    best_total = collections.Counter()
    print("\n== projections: cuBLAS vs skinny Triton (us), and the best config ==")
    for name, (n, k) in PROJECTIONS.items():
        # One weight per layer, as in the model: 28 of them outgrow the 50 MB L2, so every product
        # reads its weight from HBM (one weight, replayed, would be served from L2).
        ws = [torch.randn(n, k, device="cuda").to(DTYPE) / k ** 0.5 for _ in range(LAYERS)]
        for m in sorted(steps_at):
            x = torch.randn(m, k, device="cuda").to(DTYPE)
            ref = F.linear(x, ws[0])
            cublas = time_us(lambda: [F.linear(x, w) for w in ws]) / LAYERS
            row = {"cublas": cublas}
            if m <= 128:
                for cfg in configs:
                    label = f"n{cfg.block_n} k{cfg.block_k} split{cfg.split_k} w{cfg.num_warps} s{cfg.num_stages}"
                    try:
                        out = skinny_linear(x, ws[0], cfg)
                        err = (out.float() - ref.float()).abs().max().item()
                        if err > 0.05:
                            print(f"  {name} m={m} {label}: WRONG (max err {err:.3g})")
                            continue
                        row[label] = time_us(lambda cfg=cfg: [skinny_linear(x, w, cfg) for w in ws]) / LAYERS
                    except Exception as e:
                        print(f"  {name} m={m} {label}: failed ({type(e).__name__}: {str(e)[:60]})")
            best = min(row, key=row.get)
            cublas_total[name] += cublas * steps_at[m] * LAYERS / 1e6
            best_total[name] += row[best] * steps_at[m] * LAYERS / 1e6
            print(f"  {name:<8} m={m:3d} ({steps_at[m]:3d} steps): cuBLAS {cublas:6.2f}  best {row[best]:6.2f} ({best}) "
                  f"{n * k * 2 / row[best] / 1e3:5.0f} GB/s")
            results["gemm"].append(dict(proj=name, m=m, steps=steps_at[m], us=row))
    print("  run totals (s): " + "  ".join(f"{p}: cuBLAS {cublas_total[p]:.3f} -> best {best_total[p]:.3f}"
                                          for p in PROJECTIONS))
    results["gemm_totals"] = dict(cublas=dict(cublas_total), best=dict(best_total))


def sweep_sampler(results: dict):
    from mini_engine.kernels.sampling import sample
    print("\n== sampler (bf16 logits, temperature 0.6) ==")
    for b in (1, 16, 64, 128, 256):
        logits = torch.randn(b, VOCAB, device="cuda").to(DTYPE)
        temps, seeds = torch.full((b,), 0.6, device="cuda"), torch.arange(b, device="cuda")
        us = time_us(lambda: sample(logits, temps, seeds))
        print(f"  B={b:3d}: {us:7.1f} us")
        results["sampler"].append(dict(batch=b, us=us))
    h = torch.randn(256, HIDDEN, device="cuda").to(DTYPE)
    w = torch.randn(VOCAB, HIDDEN, device="cuda").to(DTYPE)
    buf = torch.empty(256, VOCAB, device="cuda", dtype=DTYPE)

    def copy_after():
        buf.copy_(torch.nn.functional.linear(h, w))
    into = time_us(lambda: torch.mm(h, w.t(), out=buf))
    after = time_us(copy_after)
    print(f"  lm_head B=256: into the buffer {into:.1f} us, computed then copied {after:.1f} us")
    results["lm_head"] = dict(into_buffer_us=into, copy_after_us=after)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", nargs="+", default=["attention", "gemm", "prefill", "sampler"])
    ap.add_argument("--every", type=int, default=96, help="attention: time every N-th decode step")
    ap.add_argument("--gemm-max-rows", type=int, default=256, help="projections: batch sizes up to this")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_sweep.py needs CUDA", file=sys.stderr)
        return 2
    import triton
    from benchmarks.floor import copy_bandwidth
    schedule = decode_schedule()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "copy_GBps": copy_bandwidth(torch.device("cuda")) / 1e9, "attention": [], "gemm": [], "sampler": []}
    print(f"{results['device']}, copy {results['copy_GBps']:.0f} GB/s; {len(schedule)} decode steps")
    if "attention" in args.sections:
        sweep_attention(schedule, args.every, results)
    if "gemm" in args.sections:
        sweep_gemm(schedule, results, args.gemm_max_rows)
    if "prefill" in args.sections:
        sweep_prefill(results)
    if "sampler" in args.sections:
        sweep_sampler(results)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "decode_sweep.json"), "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
