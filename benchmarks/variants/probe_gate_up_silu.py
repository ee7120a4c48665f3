# PYTHONPATH=. python ab_s42/probe_gate_up_silu.py  (H200)
"""gate/up + SwiGLU per layer, 28 weights from HBM, graph replay: cuBLAS + the engine's SwiGLU kernel
against the fused TMA kernel (several tiles), each followed by the down projection as in the model."""
import itertools, sys, time
sys.path.insert(0, "ab_s42")
import torch
import torch.nn.functional as F
import triton.testing
from gate_up_silu import GateUpSilu
from mini_engine.kernels.activation import silu_and_mul

H, I, L, EPS = 1024, 3072, 28, 1e-6
torch.manual_seed(0)
wgu = [(torch.randn(2 * I, H, device="cuda") / H ** 0.5).bfloat16() for _ in range(L)]
wd = [(torch.randn(H, I, device="cuda") / I ** 0.5).bfloat16() for _ in range(L)]

def t_us(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=20) * 1e3 / L

for m in (64, 96, 128, 160, 192, 256):
    x = torch.randn(m, H, device="cuda").bfloat16()
    res = torch.zeros(m, H, device="cuda").bfloat16()
    def base():
        for l in range(L):
            a = silu_and_mul(F.linear(x, wgu[l]), x, EPS)
            res.addmm_(a, wd[l].t())
    def base_gu_only():
        for l in range(L):
            silu_and_mul(F.linear(x, wgu[l]), x, EPS)
    ref = silu_and_mul(F.linear(x, wgu[0]), x, EPS)
    row = {"base(gu+silu+down)": t_us(base), "base(gu+silu)": t_us(base_gu_only)}
    configs = []
    for bm, bk, st in itertools.product((64, 128, 256), (64, 128), (3, 4)):
        if bm <= max(64, triton.next_power_of_2(m)):
            configs.append((True, bm, 64, bk, st, 4 if bm <= 128 else 8))
    for bm, bn, bk, st in itertools.product((64, 128), (32, 64, 128), (64, 128), (3, 4)):
        if bm <= max(64, triton.next_power_of_2(m)):
            configs.append((False, bm, bn, bk, st, 4 if bm * bn <= 64 * 128 else 8))
    for w_on_m, bm, bn, bk, st, warps in configs:
        label = f"{'wx' if w_on_m else 'xw'} m{bm} n{bn} k{bk} st{st} w{warps}"
        try:
            ops = [GateUpSilu(x, w, EPS, bm, bn, bk, w_on_m, warps, st) for w in wgu]
            out = ops[0]()
            diff = (out.float() - ref.float()).abs()
            if diff.max().item() > 0.05:
                print(f"  m={m} {label}: WRONG {diff.max().item():.3g}", flush=True); continue
            frac = (out != ref).float().mean().item()
            def fused(ops=ops):
                for l in range(L):
                    res.addmm_(ops[l](), wd[l].t())
            row[label] = (t_us(fused), frac)
        except Exception as e:
            print(f"  m={m} {label}: failed {type(e).__name__}: {str(e)[:120]}", flush=True)
    b = row.pop("base(gu+silu+down)"); g = row.pop("base(gu+silu)")
    top = sorted(row.items(), key=lambda kv: kv[1][0])[:5]
    print(f"m={m:3d}: base {b:6.2f} us/layer (gu+silu alone {g:.2f}); fused best: "
          + ", ".join(f"[{l}] {v[0]:.2f} (bits differ {v[1]:.3%})" for l, v in top), flush=True)
