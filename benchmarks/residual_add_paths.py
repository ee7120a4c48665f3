"""Does a row's projection give the same bits whatever batch it is in? For each decode projection,
rows 0-7 computed in a batch of M rows against the same rows in a batch of 40: the fraction of
elements that differ, for the product alone and for the product added into a residual (the
decoder's residual add, layers.linear.Linear(x, residual)). Few rows take the skinny Triton kernel,
more take cuBLAS, and the two must round alike for a sequence's tokens to survive its batch
changing size (a preemption, a request finishing). Needs CUDA.

    PYTHONPATH=. python benchmarks/residual_add_paths.py
"""
import sys

import torch


def main():
    if not torch.cuda.is_available():
        sys.exit("residual_add_paths.py needs CUDA")
    from mini_engine.layers.linear import Linear
    torch.manual_seed(0)
    shapes = {"o_proj": (2048, 1024), "down_proj": (3072, 1024), "qkv_proj": (1024, 4096), "gate_up_proj": (1024, 6144)}
    for name, (k, n) in shapes.items():
        layer = Linear(k, n, bias=False, use_triton=True).to("cuda", torch.bfloat16)
        layer.weight.data.normal_(0, 0.06)
        x = torch.randn(40, k, device="cuda", dtype=torch.bfloat16)
        residual = 10 * torch.randn(40, n, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            product_40 = layer(x)[:8]
            added_40 = layer(x, residual=residual.clone())[:8]
            cells = []
            for m in (8, 16, 17, 24, 32, 33):
                product = layer(x[:m])[:8]
                added = layer(x[:m], residual=residual[:m].clone())[:8]
                differ = lambda a, b: (a != b).float().mean().item()
                cells.append(f"M={m}: {differ(product, product_40):.5f} / {differ(added, added_40):.5f}")
        print(f"{name:13s} differing vs M=40 (product / added into residual)  " + "  ".join(cells))


if __name__ == "__main__":
    main()
