# PYTHONPATH=. python ab_s42/attn_energy.py [rows ...]   (H200)
"""Decode attention's energy: 28 launches (one per layer, each over its own blocks) captured as a graph
and replayed for ~3 s per variant; NVML's energy counter gives joules per launch. Variants are the
HEAD kernel's source with one substitution each, generated into ab_s42/gen/."""
import ctypes, importlib.util, os, random, sys, time
import torch

OLD = "ab_s42/old/mini_engine/kernels/paged_attention.py"
CALL = "seq_len, rows, qk_scale, stride_k_block"
TAIL = "BLOCK_SIZE, HEAD_DIM, BLOCK_D, False)\n\n    if NUM_SPLITS == 1:"
VARIANTS = {
    "head": [],
    "padded rows masked": [(CALL, "seq_len, tl.where(row_valid, 2**30, -1), qk_scale, stride_k_block"),
                           (TAIL, TAIL.replace("False)", "True)"))],
    "no exp2 (wrong; power attribution)": [
        ("p = tl.math.exp2(s - m_safe[:, None])", "p = tl.where(s > -1e30, s - m_safe[:, None], 0.0)"),
        ("alpha = tl.math.exp2(m_i - m_safe)", "alpha = tl.where(m_i > -1e30, 1.0, 0.0)")],
}


def load_variant(name, subs):
    src = open(OLD).read()
    for old, new in subs:
        assert src.count(old) == 1, (name, old)
        src = src.replace(old, new)
    os.makedirs("ab_s42/gen", exist_ok=True)
    path = f"ab_s42/gen/pa_{abs(hash(name)) % 10**8}.py"
    open(path, "w").write(src)
    spec = importlib.util.spec_from_file_location(f"pa_{abs(hash(name)) % 10**8}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


nvml = ctypes.CDLL("libnvidia-ml.so.1")
nvml.nvmlInit_v2()
handle = ctypes.c_void_p()
nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle))


def energy_mj():
    e = ctypes.c_ulonglong()
    nvml.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(e))
    return e.value


def clock_and_reasons():
    c, r = ctypes.c_uint(), ctypes.c_ulonglong()
    nvml.nvmlDeviceGetClockInfo(handle, 1, ctypes.byref(c))
    nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle, ctypes.byref(r))
    return c.value, hex(r.value)


L, HKV, D, H, BS, MAXLEN = 28, 8, 128, 16, 16, 2048
rows_list = [int(a) for a in sys.argv[1:]] or [256, 128]
mods = {name: load_variant(name, subs) for name, subs in VARIANTS.items()}
gen = torch.Generator(device="cuda").manual_seed(0)
rng = random.Random(0)
for rows in rows_list:
    ctx = sorted((rng.randint(500, 1500) for _ in range(rows)), reverse=True)
    per_layer = sum(-(-c // BS) for c in ctx)
    nb = per_layer * L
    k_cache = torch.randn(nb, BS, HKV, D, generator=gen, device="cuda").bfloat16()
    v_cache = torch.randn(nb, BS, HKV, D, generator=gen, device="cuda").bfloat16()
    perm = torch.randperm(nb, generator=gen, device="cuda").int()
    tables = []
    for l in range(L):
        t = torch.full((rows, MAXLEN // BS), -1, dtype=torch.int32, device="cuda")
        used = l * per_layer
        for r, c in enumerate(ctx):
            n = -(-c // BS)
            t[r, :n] = perm[used:used + n]
            used += n
        tables.append(t)
    q = torch.randn(rows, H, D, generator=gen, device="cuda").bfloat16()
    sl = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    qsl = torch.arange(rows + 1, dtype=torch.int32, device="cuda")
    kv_bytes = 2 * sum(ctx) * HKV * D * 2
    graphs, outs = {}, {}
    for name, mod in mods.items():
        out = torch.empty_like(q)
        def step(mod=mod, out=out):
            for l in range(L):
                mod.paged_decode_attention(q, k_cache, v_cache, tables[l], sl, qsl, D ** -0.5, MAXLEN, out)
        step(); torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        g.replay(); torch.cuda.synchronize()
        graphs[name], outs[name] = g, out
    ref = outs["head"].float()
    print(f"\n=== {rows} rows, contexts 500-1500 (mean {sum(ctx) / rows:.0f}), {kv_bytes / 1e6:.0f} MB of KV a layer")
    for name, out in outs.items():
        print(f"  {name:<38} max|d| vs head {(out.float() - ref).abs().max().item():.3g}")
    for rnd in range(2):
        for name, g in graphs.items():
            t_end = time.time() + 1.0
            while time.time() < t_end:
                g.replay()
            torch.cuda.synchronize()
            n = 0
            e0, t0 = energy_mj(), time.perf_counter()
            while time.perf_counter() - t0 < 3.0:
                for _ in range(10):
                    g.replay()
                n += 10
                if n % 50 == 0:
                    torch.cuda.synchronize()
            torch.cuda.synchronize()
            t1, e1 = time.perf_counter(), energy_mj()
            clk, why = clock_and_reasons()
            us = (t1 - t0) / (n * L) * 1e6
            mj = (e1 - e0) / (n * L)
            print(f"  round {rnd} {name:<38} {us:7.2f} us a launch, {kv_bytes / us / 1e3:5.0f} GB/s, "
                  f"{mj:6.3f} mJ a launch, {(e1 - e0) / 1e3 / (t1 - t0):5.0f} W, SM {clk} MHz {why}", flush=True)
    del graphs, outs, k_cache, v_cache
    torch.cuda.empty_cache()
