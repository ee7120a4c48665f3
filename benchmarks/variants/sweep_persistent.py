# Run from the repo root with PYTHONPATH=. on the H200.
"""Decode attention on the benchmark's schedule (rows longest first): the engine's kernel against the
swapped-operand variant (keys on the M side of the dots), several tiles/stages/warps. Prints each
compiled kernel's registers, spills and shared memory, and writes the run totals as JSON."""
import collections, json, os, sys
import torch
sys.path.insert(0, ".")
from benchmarks.decode_sweep import decode_schedule, graph_size, time_us, make_kv_cache, \
    NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, MAX_MODEL_LEN, DTYPE, LAYERS
from benchmarks.variants import persistent_rows_pa
from mini_engine.kernels import paged_attention as cur

CONFIGS = {"cur": (cur.paged_decode_attention, {})}
for ppsm, min_splits, tile, stages in ((3, 1, 64, 3), (3, 2, 64, 3), (2, 1, 64, 3), (4, 1, 64, 2), (5, 1, 64, 2),
                                       (4, 1, 32, 4), (3, 1, 128, 2)):
    CONFIGS[f"persistent ppsm{ppsm} min{min_splits} t{tile} s{stages}"] = (
        persistent_rows_pa.paged_decode_attention,
        dict(programs_per_sm=ppsm, min_splits=min_splits, tile_n=tile, num_stages=stages))

every = int(sys.argv[1]) if len(sys.argv) > 1 else 96
schedule = decode_schedule()
gen = torch.Generator(device="cuda").manual_seed(0)
bsz = 16
num_blocks = max(sum(c) for c in schedule) // bsz + len(schedule[0]) + 64
k_cache, v_cache = make_kv_cache(num_blocks, bsz, "token", gen)
scale = HEAD_DIM ** -0.5
totals = collections.Counter()
for step in range(0, len(schedule), every):
    ctx = sorted(schedule[step], reverse=True); b = len(ctx); bs = graph_size(b)
    seq_lens = ctx + [1] * (bs - b)
    q = torch.randn(bs, NUM_HEADS, HEAD_DIM, generator=gen, device="cuda").to(DTYPE)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    qsl = torch.arange(bs + 1, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    perm = torch.randperm(num_blocks, generator=gen, device="cuda").to(torch.int32)
    tables = torch.full((bs, MAX_MODEL_LEN // bsz), -1, dtype=torch.int32, device="cuda")
    used = 0
    for r, n in enumerate(seq_lens):
        nb = -(-n // bsz); tables[r, :nb] = perm[used:used + nb]; used += nb
    ref = cur.paged_attention(q, k_cache, v_cache, tables, sl, qsl, scale, 1, MAX_MODEL_LEN).float()
    row = {}
    for name, (fn0, kw) in CONFIGS.items():
        fn = lambda fn0=fn0, kw=kw: fn0(q, k_cache, v_cache, tables, sl, qsl, scale, MAX_MODEL_LEN, out, **kw)
        try:
            out.fill_(float("nan")); fn()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            if not err < 1e-2:
                print(f"  {name}: WRONG rel err {err}"); row[name] = float("inf"); continue
            row[name] = time_us(fn)
        except Exception as e:
            row[name] = float("inf"); print(f"  {name}: failed {type(e).__name__}: {str(e)[:200]}")
    w = min(every, len(schedule) - step) * LAYERS / 1e6
    for n, us in row.items(): totals[n] += us * w
    best = min(row, key=row.get)
    print(f"step {step+1:4d} batch {b:3d} ctx {sum(ctx)/b:5.0f}: cur {row['cur']:6.1f} best {row[best]:6.1f} {best}  "
          + " ".join(f"{v:6.1f}" for v in row.values()), flush=True)
print("run totals (s):")
for n, s in sorted(totals.items(), key=lambda kv: kv[1]): print(f"  {n:<40} {s:6.3f}")
for label, kernel in (("engine", cur._paged_decode_kernel), ("persistent", persistent_rows_pa._persistent_decode_kernel)):
    for dc in kernel.device_caches.values():
        for key, ck in dc[0].items():
            c = {k: getattr(ck.metadata, k, None) for k in ("num_warps", "num_stages")}
            print(f"{label} kernel {c} {key[:80] if isinstance(key, str) else ''}: {ck.n_regs} regs {ck.n_spills} spills {ck.metadata.shared} B smem")
best = min((v, n) for n, v in totals.items() if n != "cur")
print(f"BEST {best[1]} | {best[0]:.3f} vs cur {totals['cur']:.3f} (gain {totals['cur'] - best[0]:.3f})")
if os.environ.get("OUT"):
    json.dump(dict(totals=totals, best=best[1], config=CONFIGS[best[1]][1]),
              open(os.path.join(os.environ["OUT"], "persistent_sweep.json"), "w"))
