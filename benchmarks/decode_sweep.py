"""Tuning sweep for the decode step's kernels, weighted by the benchmark's own schedule.

bench.py's workload fixes, for every decode step, which sequences run and how long their contexts
are (all prompts are prefilled in the first few steps, then request i decodes until its
max_tokens). This script rebuilds that schedule, then times, with CUDA-graph replay so that launch
overhead is out of the picture:
  * decode attention on sampled steps of the schedule, for several split/tile choices and KV pool
    layouts (--layouts), against the KV bytes at copy and at read-only bandwidth;
  * every projection of a layer (qkv, o, gate_up, down) at every captured batch size, cuBLAS
    against the skinny Triton kernel's configurations;
  * decode attention on uniform batches, fitted as a fixed cost per launch plus bytes / rate (fit);
  * prefill attention on the first prefill step, for a few tile shapes and work orders;
  * the sampler at a few batch sizes;
  * SwiGLU (swiglu, not run by default) a program a column block against a program a token.
Each table ends with the run total it implies (28 layers x the steps at that batch size), so a
choice is judged by what it would save over the whole benchmark. Needs CUDA.

    PYTHONPATH=. python benchmarks/decode_sweep.py [--sections attention gemm sampler] [--out DIR]
"""
import argparse
import collections
import json
import os
import sys

import numpy as np
import torch

from bench import make_workload
from mini_engine.config import KV_CACHE_DTYPES

HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB, LAYERS = 1024, 16, 8, 128, 3072, 151936, 28
# BLOCK_SIZE: the engine's KV block on CUDA (EngineConfig: 64 since entry 42)
BLOCK_SIZE, MAX_MODEL_LEN, DTYPE = 64, 2048, torch.bfloat16
PROJECTIONS = {"qkv": ((NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, HIDDEN), "o": (HIDDEN, NUM_HEADS * HEAD_DIM),
               "gate_up": (2 * INTERMEDIATE, HIDDEN), "down": (HIDDEN, INTERMEDIATE)}


def decode_schedule() -> list[list[int]]:
    """Context length of every running sequence at each decode step s = 1 .. max(max_tokens) - 1:
    request i (prompt P, max_tokens M) decodes token s at context P + s while s < M."""
    prompts, max_tokens = make_workload()
    return [[len(p) + s for p, m in zip(prompts, max_tokens) if s < m] for s in range(1, max(max_tokens))]


def graph_size(batch: int) -> int:
    from mini_engine.compilation_config import default_capture_sizes
    return next(s for s in default_capture_sizes(256) if s >= batch)


def time_us(fn) -> float:
    import triton.testing
    return triton.testing.do_bench_cudagraph(fn, rep=10) * 1e3


# (tile, warps, stages, splits); splits 0: the engine's rule (decode_num_splits); stages 0: the engine's
# count (DECODE_STAGES)
ATTENTION_CONFIGS = ((128, 4, 2, 1), (128, 4, 2, 2), (128, 4, 2, 4), (64, 4, 3, 2), (64, 4, 2, 2), (128, 8, 2, 2))


def make_kv_cache(num_blocks: int, block_size: int, layout: str, gen,
                  kv_dtype: torch.dtype = DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V pools in the engine's logical shape [block, offset, head, dim]. 'token' stores them
    that way; 'head' stores [block, head, offset, dim] (each head's part of a block contiguous) and
    hands the kernels the transposed view."""
    if layout == "token":
        shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
        return tuple(torch.randn(shape, generator=gen, device="cuda").to(kv_dtype) for _ in range(2))
    shape = (num_blocks, NUM_KV_HEADS, block_size, HEAD_DIM)
    return tuple(torch.randn(shape, generator=gen, device="cuda").to(kv_dtype).transpose(1, 2) for _ in range(2))


def read_bandwidth(nbytes: int = 4 << 30) -> float:
    """Read-only bandwidth in bytes/s: a Triton kernel that sums a 4 GiB buffer, each program a
    contiguous slice in 64 KiB steps. Attention only reads, so this, not the copy, is its ceiling."""
    import triton
    import triton.language as tl

    @triton.jit
    def _sum_kernel(x_ptr, out_ptr, per_program, BLOCK: tl.constexpr):
        base = tl.program_id(0).to(tl.int64) * per_program
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(0, per_program, BLOCK):
            acc += tl.load(x_ptr + base + start + tl.arange(0, BLOCK)).to(tl.float32)
        tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))

    x = torch.ones(nbytes // 2, dtype=DTYPE, device="cuda")
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    best = 0.0
    for programs, block in ((sms * 4, 8192), (sms * 8, 4096), (sms * 16, 4096)):
        per_program = x.numel() // programs // block * block
        out = torch.empty(programs, device="cuda")
        us = time_us(lambda: _sum_kernel[(programs,)](x, out, per_program, BLOCK=block, num_warps=8))
        gbps = programs * per_program * 2 / us / 1e3
        print(f"  read bandwidth, {programs} programs x {block}: {gbps:.0f} GB/s")
        best = max(best, gbps)
    del x
    torch.cuda.empty_cache()
    return best * 1e9


def decode_step_inputs(contexts: list[int], gen) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor,
                                                            torch.Tensor]:
    """A decode step's attention inputs as the engine's graph runs them: rows longest context first
    (entry 19), padded to the captured size with one-token rows. Returns the padded seq_lens and q,
    seq_lens, query_start_loc and out on the GPU."""
    ctx = sorted(contexts, reverse=True)
    seq_lens = ctx + [1] * (graph_size(len(ctx)) - len(ctx))
    q = torch.randn(len(seq_lens), NUM_HEADS, HEAD_DIM, generator=gen, device="cuda").to(DTYPE)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device="cuda")
    return seq_lens, q, sl, qsl, torch.empty_like(q)


def scattered_block_tables(seq_lens: list[int], block_size: int, num_blocks: int, gen) -> torch.Tensor:
    """Block tables max_model_len wide whose rows own disjoint blocks drawn at random from the pool,
    as a long-running pool hands them out."""
    perm = torch.randperm(num_blocks, generator=gen, device="cuda").to(torch.int32)
    tables = torch.zeros(len(seq_lens), MAX_MODEL_LEN // block_size, dtype=torch.int32, device="cuda")
    used = 0
    for r, n in enumerate(seq_lens):
        nb = -(-n // block_size)
        tables[r, :nb] = perm[used:used + nb]
        used += nb
    return tables


def sweep_attention(schedule, every: int, results: dict, layouts=(f"token:{BLOCK_SIZE}",), configs=ATTENTION_CONFIGS,
                    max_batch: int | None = None, min_batch: int = 1, kv_dtype: torch.dtype = DTYPE):
    from mini_engine.kernels.paged_attention import paged_attention, paged_decode_attention
    gen = torch.Generator(device="cuda").manual_seed(0)
    max_tokens = max(sum(c) for c in schedule)
    scale = HEAD_DIM ** -0.5
    totals = collections.Counter()
    best_total, floor_total, read_total = 0.0, 0.0, 0.0
    print(f"\n== decode attention, one layer, every {every}th step of the schedule (us); layouts {layouts}; "
          f"KV cache {kv_dtype} ==")
    caches = {}
    for spec in layouts:
        layout, block_size = spec.split(":")
        block_size = int(block_size)
        num_blocks = max_tokens // block_size + len(schedule[0]) + 64
        caches[spec] = (block_size, num_blocks, *make_kv_cache(num_blocks, block_size, layout, gen, kv_dtype))
    for step in range(0, len(schedule), every):
        if (max_batch is not None and len(schedule[step]) > max_batch) or len(schedule[step]) < min_batch:
            continue
        ctx = schedule[step]
        b = len(ctx)
        seq_lens, q, sl, qsl, out = decode_step_inputs(ctx, gen)
        bs = len(seq_lens)
        kv_bytes = 2 * sum(ctx) * NUM_KV_HEADS * HEAD_DIM * kv_dtype.itemsize
        row = {}
        for spec, (block_size, num_blocks, k_cache, v_cache) in caches.items():
            tables = scattered_block_tables(seq_lens, block_size, num_blocks, gen)
            variants = {f"{spec} default": None}
            if kv_dtype != DTYPE:      # the dots' type an fp8 cache does not take
                variants[f"{spec} default, bf16 dots"] = dict(dot_dtype=torch.bfloat16)
            for tile, warps, stages, splits in configs:
                variants[f"{spec} tile {tile} w{warps} s{stages} splits {splits or 'rule'}"] = dict(
                    tile_n=tile, num_warps=warps, num_stages=stages or None, num_splits=splits or None)
            for name, cfg in variants.items():
                try:
                    if cfg is None:
                        fn = lambda: paged_attention(q, k_cache, v_cache, tables, sl, qsl, scale, 1, MAX_MODEL_LEN,
                                                     out)
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
        read_total += kv_bytes / results["read_GBps"] / 1e3 * weight
        best = min(row, key=row.get)
        default = row[f"{layouts[0]} default"]
        print(f"  step {step + 1:4d} batch {b:3d} (graph {bs:3d}) mean ctx {sum(ctx) / b:6.0f}: "
              f"default {default:7.1f}  best {row[best]:7.1f} ({best}) "
              f"{kv_bytes / row[best] / 1e3:5.0f} GB/s")
        results["attention"].append(dict(step=step + 1, batch=b, graph=bs, kv_bytes=kv_bytes, us=row))
    print_per_graph_size(results["attention"], every, len(schedule), f"{layouts[0]} default")
    print("  run totals (s, 28 layers, all decode steps):")
    for name, s in sorted(totals.items(), key=lambda kv: kv[1]):
        print(f"    {name:<44} {s:6.3f}")
    print(f"    {'best per step':<44} {best_total:6.3f}\n    {'KV bytes at copy bandwidth':<44} {floor_total:6.3f}"
          f"\n    {'KV bytes at read bandwidth':<44} {read_total:6.3f}")
    results["attention_totals"] = dict(totals) | {"best_per_step": best_total, "copy_bw_floor": floor_total,
                                                  "read_bw_floor": read_total}


def print_per_graph_size(steps: list[dict], every: int, num_steps: int, default: str) -> None:
    """The best configuration for each captured batch size (a CUDA graph fixes one), judged by its
    total over that size's timed steps, and what choosing per size would save over the run."""
    by_size = collections.defaultdict(collections.Counter)
    for entry in steps:
        weight = min(every, num_steps - entry["step"] + 1) * LAYERS / 1e6
        for name, us in entry["us"].items():
            by_size[entry["graph"]][name] += us * weight
    print("  per captured size: best configuration (s over the run, against the default):")
    saved = 0.0
    for size in sorted(by_size):
        totals = by_size[size]
        best = min(totals, key=totals.get)
        saved += totals[default] - totals[best]
        print(f"    graph {size:3d}: {best:<40} {totals[best]:6.3f} against {totals[default]:6.3f}")
    print(f"    best per size saves {saved * 1e3:.1f} ms over the run")


def sweep_attention_fit(results: dict, rows=(16, 64, 128, 256), contexts=(256, 512, 1024, 2047)):
    """Decode attention on uniform batches (every row the same context), fitted per batch size as
    time = fixed + KV bytes / rate: whether what a launch loses against read bandwidth is a cost
    per launch (start-up and drain) or a lower streaming rate."""
    from mini_engine.kernels.paged_attention import paged_attention
    gen = torch.Generator(device="cuda").manual_seed(2)
    num_blocks = max(rows) * -(-max(contexts) // BLOCK_SIZE) + 1
    k_cache, v_cache = make_kv_cache(num_blocks, BLOCK_SIZE, "token", gen)
    print("\n== decode attention on uniform batches, one layer: time = fixed + bytes / rate ==")
    fits = []
    for r in rows:
        xs, ys = [], []
        for c in contexts:
            tables = scattered_block_tables([c] * r, BLOCK_SIZE, num_blocks, gen)
            q = torch.randn(r, NUM_HEADS, HEAD_DIM, generator=gen, device="cuda").to(DTYPE)
            sl = torch.full((r,), c, dtype=torch.int32, device="cuda")
            qsl = torch.arange(r + 1, dtype=torch.int32, device="cuda")
            out = torch.empty_like(q)
            us = time_us(lambda: paged_attention(q, k_cache, v_cache, tables, sl, qsl, HEAD_DIM ** -0.5, 1,
                                                 MAX_MODEL_LEN, out))
            kv_bytes = 2 * r * c * NUM_KV_HEADS * HEAD_DIM * 2
            xs.append(kv_bytes)
            ys.append(us)
            print(f"  {r:3d} rows x {c:4d} tokens: {us:7.1f} us  {kv_bytes / us / 1e3:5.0f} GB/s")
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        fixed = my - slope * mx
        fits.append(dict(rows=r, fixed_us=fixed, rate_GBps=1e-3 / slope, us=ys, kv_bytes=xs))
        print(f"  {r:3d} rows: fixed {fixed:5.1f} us, rate {1e-3 / slope:5.0f} GB/s")
    results["attention_fit"] = fits


def sweep_prefill(results: dict):
    """The first prefill step of the benchmark: whole prompts, in order, up to 16,384 tokens."""
    from mini_engine.kernels.paged_attention import paged_prefill_attention, prefill_block_q, prefill_work
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
                                           (64, 128, 4, 2), (128, 64, 8, 3), (64, 32, 4, 3), (64, 64, 4, 3),
                                           (128, 32, 8, 3), (64, 32, 4, 4), (32, 32, 4, 3), (64, 16, 4, 3),
                                           (64, 32, 2, 3), (64, 32, 8, 3)):
        label = f"block_m {block_m} tile {tile_n} w{warps} s{stages}"
        # built once, as the engine stages it with the step's inputs
        work = torch.from_numpy(prefill_work(lens, lens, prefill_block_q(NUM_HEADS // NUM_KV_HEADS, block_m))).cuda()
        try:
            us = time_us(lambda: paged_prefill_attention(q, k_cache, v_cache, tables, sl, qsl, HEAD_DIM ** -0.5, out,
                                                         work, block_m, tile_n, warps, stages))
        except Exception as e:
            print(f"  {label}: failed ({type(e).__name__}: {str(e)[:60]})")
            continue
        print(f"  {label:<28} {us:8.1f} us  {flops / us / 1e6:6.1f} TFLOP/s  x28 layers: {us * 28 / 1e3:6.2f} ms")
        rows.append(dict(config=label, us=us))
    # The engine's tile over the same items in other orders: the kernel starts programs in work
    # order (the KV head fastest), so the order is the only thing that differs.
    work = prefill_work(lens, lens, prefill_block_q(NUM_HEADS // NUM_KV_HEADS))
    kv_len = work[:, 3] + work[:, 2]
    blocks_back = np.lexsort((-work[:, 1], work[:, 0]))       # each sequence's last query block first
    for order, items in (("sequence by sequence (the engine's)", work),
                         ("longest context first", work[np.argsort(-kv_len, kind="stable")]),
                         ("each sequence's blocks last first", work[blocks_back])):
        items = torch.from_numpy(np.ascontiguousarray(items)).cuda()
        us = time_us(lambda: paged_prefill_attention(q, k_cache, v_cache, tables, sl, qsl, HEAD_DIM ** -0.5, out,
                                                     items))
        print(f"  work order: {order:<38} {us:8.1f} us  {flops / us / 1e6:6.1f} TFLOP/s")
        rows.append(dict(config=f"order: {order}", us=us))
    results["prefill"] = rows


def sweep_swiglu(results: dict):
    """SwiGLU with the folded norm, a program a column block against a program a token (the norm
    row read once), at prefill and decode token counts."""
    from mini_engine.kernels.activation import WHOLE_ROW_MIN_TOKENS, silu_and_mul
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"\n== SwiGLU, intermediate {INTERMEDIATE}, folded norm (engine: a token a program from "
          f"{WHOLE_ROW_MIN_TOKENS} tokens) ==")
    rows = []
    for tokens in (16384, 8192, 2048, 1024, 512, 256, 224, 192, 160, 128, 96, 64, 8, 1):
        gate_up = torch.randn(tokens, 2 * INTERMEDIATE, generator=gen, device="cuda").to(DTYPE)
        norm_input = torch.randn(tokens, HIDDEN, generator=gen, device="cuda").to(DTYPE)
        per_block = time_us(lambda: silu_and_mul(gate_up, norm_input, 1e-6, whole_row_min_tokens=tokens + 1))
        per_token = time_us(lambda: silu_and_mul(gate_up, norm_input, 1e-6, whole_row_min_tokens=tokens))
        print(f"  {tokens:6d} tokens: a program a column block {per_block:7.2f} us, a program a token {per_token:7.2f} us")
        rows.append(dict(tokens=tokens, per_block_us=per_block, per_token_us=per_token))
    results["swiglu"] = rows


def skinny_configs(num_rows: int):
    """Candidates for the Triton kernel: at a few rows one tile holds the whole batch and the
    weight is cut thin; from 65 rows up, square-ish tiles as in a plain GEMM."""
    from mini_engine.kernels.linear import SkinnyConfig
    if num_rows <= 64:
        shapes = ((16, 256, 1, 4, 4), (16, 256, 2, 4, 4), (16, 256, 4, 4, 4), (16, 512, 1, 4, 3),
                  (32, 256, 1, 4, 4), (32, 128, 1, 4, 6), (64, 128, 1, 4, 4), (128, 64, 1, 4, 4))
        return [SkinnyConfig(*s) for s in shapes]
    shapes = ((64, 128, 1, 4, 4, 64), (128, 64, 1, 4, 4, 64), (64, 64, 1, 4, 4, 128), (128, 64, 1, 8, 3, 128),
              (64, 128, 2, 4, 4, 64), (32, 256, 1, 4, 3, 128), (32, 128, 1, 4, 4, 128), (128, 128, 1, 8, 3, 64),
              (64, 64, 2, 4, 4, 128), (64, 64, 1, 4, 4, 64))
    return [SkinnyConfig(*s) for s in shapes]


def sweep_gemm(schedule, results: dict, max_rows: int = 256, only_rows: list[int] | None = None):
    import torch.nn.functional as F
    from mini_engine.kernels.linear import skinny_linear
    steps_at = collections.Counter(size for size in map(graph_size, map(len, schedule))
                                   if size <= max_rows and (not only_rows or size in only_rows))
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
            if m <= max_rows:
                for cfg in skinny_configs(m):
                    label = (f"{f'm{cfg.block_m} ' if cfg.block_m else ''}n{cfg.block_n} k{cfg.block_k} "
                             f"split{cfg.split_k} w{cfg.num_warps} s{cfg.num_stages}")
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
            print(f"  {name:<8} m={m:3d} ({steps_at[m]:3d} steps): cuBLAS {cublas:6.2f}  "
                  f"best {row[best]:6.2f} ({best}) {n * k * 2 / row[best] / 1e3:5.0f} GB/s")
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
    ap.add_argument("--layouts", nargs="+", default=[f"token:{BLOCK_SIZE}"],
                    help="attention: KV pool layouts as LAYOUT:BLOCK_SIZE, LAYOUT 'token' (the engine's "
                         "[block, offset, head, dim]) or 'head' ([block, head, offset, dim])")
    ap.add_argument("--tile-configs", action=argparse.BooleanOptionalAction, default=True,
                    help="attention: time ATTENTION_CONFIGS beside the default")
    ap.add_argument("--attention-configs", nargs="+", metavar="TILE,WARPS,STAGES,SPLITS",
                    help="attention: time these instead of ATTENTION_CONFIGS (stages 0: the engine's count)")
    ap.add_argument("--max-batch", type=int, help="attention: only the steps of at most this many rows "
                    "(the run totals then cover those steps alone)")
    ap.add_argument("--min-batch", type=int, default=1, help="attention: only the steps of at least this many rows")
    ap.add_argument("--gemm-max-rows", type=int, default=256, help="projections: batch sizes up to this")
    ap.add_argument("--gemm-rows", type=int, nargs="+", help="projections: only these captured batch sizes")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e5m2"], default="auto",
                    help="attention: the KV pool's type (auto: bf16, the model's)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.kv_cache_dtype != "auto" and set(args.sections) - {"attention", "gemm", "sampler"}:
        ap.error("--kv-cache-dtype applies to the decode attention sweep only: leave out fit, prefill and swiglu")
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
        results["read_GBps"] = read_bandwidth() / 1e9        # the attention's own ceiling
        configs = ATTENTION_CONFIGS if args.tile_configs else ()
        if args.attention_configs:
            configs = [tuple(int(v) for v in c.split(",")) for c in args.attention_configs]
        kv_dtype = KV_CACHE_DTYPES[args.kv_cache_dtype] or DTYPE
        sweep_attention(schedule, args.every, results, tuple(args.layouts), configs, args.max_batch, args.min_batch,
                        kv_dtype)
        from benchmarks.pdl_chain import print_registers
        from mini_engine.kernels.paged_attention import _paged_decode_kernel
        print_registers(_paged_decode_kernel, ("NUM_SPLITS", "ROW_BLOCKS", "TILE_N"))
    if "fit" in args.sections:
        sweep_attention_fit(results)
    if "gemm" in args.sections:
        sweep_gemm(schedule, results, args.gemm_max_rows, args.gemm_rows)
    if "prefill" in args.sections:
        sweep_prefill(results)
    if "sampler" in args.sections:
        sweep_sampler(results)
    if "swiglu" in args.sections:
        sweep_swiglu(results)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "decode_sweep.json"), "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
