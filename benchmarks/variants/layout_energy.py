# PYTHONPATH=. python ab_s42/layout_energy.py [rows ...]   (H200)
"""Decode attention's energy by KV-cache layout: the engine's kernel over 28 layers' worth of blocks,
captured as a graph and replayed ~3 s per layout; NVML's energy counter gives joules per launch.
'token' is the engine's [block, offset, head, dim]; 'head' stores [block, head, offset, dim] (each
head's part of a block contiguous: 4 KB runs at block size 16) and hands the kernel the transposed view."""
import ctypes, random, sys, time
import torch
from mini_engine.kernels.paged_attention import paged_decode_attention

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


L, HKV, D, H, MAXLEN = 28, 8, 128, 16, 2048
rows_list = [int(a) for a in sys.argv[1:]] or [256, 64]
LAYOUTS = (("token", 16), ("head", 16), ("head", 64), ("token", 64))
gen = torch.Generator(device="cuda").manual_seed(0)
rng = random.Random(0)
for pass_no, rows in enumerate(rows_list):
    ctx = sorted((rng.randint(500, 1500) for _ in range(rows)), reverse=True)
    q = torch.randn(rows, H, D, generator=gen, device="cuda").bfloat16()
    sl = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    qsl = torch.arange(rows + 1, dtype=torch.int32, device="cuda")
    kv_bytes = 2 * sum(ctx) * HKV * D * 2
    print(f"\n=== {rows} rows, contexts 500-1500 (mean {sum(ctx) / rows:.0f}), {kv_bytes / 1e6:.0f} MB of KV a layer",
          flush=True)
    graphs, outs = {}, {}
    for layout, bs in (LAYOUTS if pass_no % 2 == 0 else LAYOUTS[::-1]):
        per_layer = sum(-(-c // bs) for c in ctx)
        nb = per_layer * L
        shape = (nb, bs, HKV, D) if layout == "token" else (nb, HKV, bs, D)
        k_cache = torch.randn(shape, generator=gen, device="cuda").bfloat16()
        v_cache = torch.randn(shape, generator=gen, device="cuda").bfloat16()
        if layout == "head":
            k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
        perm = torch.randperm(nb, generator=gen, device="cuda").int()
        tables = []
        for l in range(L):
            t = torch.full((rows, -(-MAXLEN // bs)), -1, dtype=torch.int32, device="cuda")
            used = l * per_layer
            for r, c in enumerate(ctx):
                n = -(-c // bs)
                t[r, :n] = perm[used:used + n]
                used += n
            tables.append(t)
        out = torch.empty_like(q)
        def step(k_cache=k_cache, v_cache=v_cache, tables=tables, out=out):
            for l in range(L):
                paged_decode_attention(q, k_cache, v_cache, tables[l], sl, qsl, D ** -0.5, MAXLEN, out)
        step(); torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        name = f"{layout}:{bs}"
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
        print(f"  {name:<10} {us:7.2f} us a launch, {kv_bytes / us / 1e3:5.0f} GB/s, {mj:7.3f} mJ a launch "
              f"({mj * 1e-3 / kv_bytes * 1e12:.1f} pJ a byte), {(e1 - e0) / 1e3 / (t1 - t0):4.0f} W, "
              f"SM {clk} MHz {why}", flush=True)
        del g, k_cache, v_cache, tables
        torch.cuda.empty_cache()
