# Run from the repo root with PYTHONPATH=. on the H200.
"""The four projections at 64-256 rows: cuBLAS against TMA Triton tiles in both orientations (weights
read from HBM: one weight per layer, 28 of them, as in the model)."""
import itertools, json, os, sys
import torch
import torch.nn.functional as F
sys.path.insert(0, ".")
from benchmarks.decode_sweep import PROJECTIONS, LAYERS, DTYPE, time_us
from benchmarks.variants.tma_gemm import TmaLinear

results = {}
for name, (n, k) in PROJECTIONS.items():
    ws = [torch.randn(n, k, device="cuda").to(DTYPE) / k ** 0.5 for _ in range(LAYERS)]
    for m in (64, 128, 256):
        x = torch.randn(m, k, device="cuda").to(DTYPE)
        ref = F.linear(x, ws[0]).float()
        row = {"cublas": time_us(lambda: [F.linear(x, w) for w in ws]) / LAYERS}
        configs = []
        tiles_wx = ((64, 64), (64, 128), (128, 64), (128, 128), (256, 64), (256, 128))
        tiles_xw = ((64, 128), (128, 128), (64, 256), (128, 64))
        for w_on_m, tiles in ((True, tiles_wx), (False, tiles_xw)):
            for (bm, bn), (bk, stages), split in itertools.product(tiles, ((64, 4), (128, 3)), (1, 2, 4)):
                if bm > m or (split > 1 and n > 2048) or k % (bk * split):
                    continue
                configs.append((w_on_m, bm, bn, bk, split, 8 if bm * bn >= 128 * 256 else 4, stages))
        for cfg in configs:
            w_on_m, bm, bn, bk, split, warps, stages = cfg
            label = f"{'wx' if w_on_m else 'xw'} m{bm} n{bn} k{bk} s{split} w{warps} st{stages}"
            try:
                ops = [TmaLinear(x, w, bm, bn, bk, split, w_on_m, warps, stages) for w in ws]
                err = (ops[0]().float() - ref).abs().max().item()
                if err > 0.05:
                    print(f"  {name} m={m} {label}: WRONG {err:.3g}"); continue
                row[label] = time_us(lambda: [op() for op in ops]) / LAYERS
            except Exception as e:
                print(f"  {name} m={m} {label}: failed {type(e).__name__}: {str(e)[:100]}")
        top = sorted(row.items(), key=lambda kv: kv[1])[:4]
        print(f"{name:<8} m={m:3d}: cuBLAS {row['cublas']:6.2f}  best: "
              + ", ".join(f"{l} {v:.2f}" for l, v in top), flush=True)
        results[f"{name} {m}"] = row
if os.environ.get("OUT"):
    json.dump(results, open(os.path.join(os.environ["OUT"], "gemm_sweep.json"), "w"))
