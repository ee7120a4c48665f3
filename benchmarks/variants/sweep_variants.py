# Tried on the H200 and not kept (benchmarks/NOTES.md entry 20); run from the repo root with PYTHONPATH=.
"""Decode attention on the schedule (rows longest first): the current kernel against the all-heads
and persistent variants, with register caps. Prints each compiled kernel's registers and smem."""
import collections, importlib.util, json, sys, os
import torch
sys.path.insert(0, ".")
from benchmarks.decode_sweep import decode_schedule, graph_size, time_us, make_kv_cache, \
    NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, MAX_MODEL_LEN, DTYPE, LAYERS
def load(name):
    spec = importlib.util.spec_from_file_location(name, f"benchmarks/variants/{name}.py")
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m
mods = {n: load(n) for n in ("cur_pa", "all_heads_pa", "persistent_pa")}
configs = {"cur_pa {}": ("cur_pa", {})}
for ppsm in (8, 16, 32):
    for reg in (None, 168):
        configs[f"all_heads_pa {json.dumps(dict(programs_per_sm=ppsm, maxnreg=reg))}"] = ("all_heads_pa", dict(programs_per_sm=ppsm, maxnreg=reg))
for ppsm in (3, 6):
    configs[f"persistent_pa {json.dumps(dict(programs_per_sm=ppsm, maxnreg=168))}"] = ("persistent_pa", dict(programs_per_sm=ppsm, maxnreg=168))
every = int(sys.argv[1]) if len(sys.argv) > 1 else 48
schedule = decode_schedule()
gen = torch.Generator(device="cuda").manual_seed(0)
bsz = 16
num_blocks = max(sum(c) for c in schedule) // bsz + len(schedule[0]) + 64
k_cache, v_cache = make_kv_cache(num_blocks, bsz, "token", gen)
scale = HEAD_DIM ** -0.5
totals = collections.Counter(); rows = []
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
    ref = mods["cur_pa"].paged_attention(q, k_cache, v_cache, tables, sl, qsl, scale, 1, MAX_MODEL_LEN).float()
    row = {}
    for name, (mod, kw) in configs.items():
        fn = lambda m=mods[mod], kw=kw: m.paged_decode_attention(q, k_cache, v_cache, tables, sl, qsl, scale,
                                                                  MAX_MODEL_LEN, out, **kw)
        try:
            out.fill_(float("nan")); fn()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            if not err < 1e-2:
                print(f"  {name}: WRONG rel err {err}"); row[name] = float("inf"); continue
            row[name] = time_us(fn)
        except Exception as e:
            row[name] = float("inf"); print(f"  {name}: failed {type(e).__name__}: {str(e)[:120]}")
    w = min(every, len(schedule) - step) * LAYERS / 1e6
    for n, us in row.items(): totals[n] += us * w
    best = min(row, key=row.get)
    print(f"step {step+1:4d} batch {b:3d} ctx {sum(ctx)/b:5.0f}: cur {row['cur_pa {}']:6.1f} best {row[best]:6.1f} {best}", flush=True)
    rows.append(dict(step=step + 1, batch=b, graph=bs, us=row))
print("run totals (s):")
for n, s in sorted(totals.items(), key=lambda kv: kv[1]): print(f"  {n:<60} {s:6.3f}")
for name, m in mods.items():
    for dc in m._paged_decode_kernel.device_caches.values():
        for key, ck in dc[0].items():
            print(f"{name} kernel: {ck.n_regs} regs {ck.n_spills} spills {ck.metadata.shared} B smem")
best = min((v, n) for n, v in totals.items() if not n.startswith("cur_pa"))
gain = totals["cur_pa {}"] - best[0]
print(f"BEST {best[1]} | {best[0]:.3f} vs cur {totals['cur_pa {}']:.3f} (gain {gain:.3f})")
if os.environ.get("OUT"):
    json.dump(dict(rows=rows, totals=totals), open(os.path.join(os.environ["OUT"], "sweep4.json"), "w"))
    pass
