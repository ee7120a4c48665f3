"""LoRA's delta on the H200: kernels/lora.py's path (the shrink on cuBLAS, then one launch for the
mask, expand and add) against the PyTorch path (three launches), on Qwen3-0.6B's four LoRA
projections at decode and prefill row counts, each timed as CUDA-graph replays (as a decode step
runs it); then the expand kernel's tiles swept at a few row counts. Each row's slot is drawn from
every slot, and one row in eight has none (-1).

    PYTHONPATH=. python3 benchmarks/lora_sweep.py [--max-loras 1 4] [--rank 16] [--no-sweep]"""
import argparse
import itertools

import torch
import triton
import triton.testing

from mini_engine.kernels.lora import (LoRAKernelConfig, lora_add, lora_add_ref, lora_expand, lora_kernel_config,
                                      lora_mask)

# (name, in_features, output_sizes) of Qwen3-0.6B's LoRA projections
PROJECTIONS = [("qkv_proj", 1024, [2048, 1024, 1024]), ("o_proj", 2048, [1024]),
               ("gate_up_proj", 1024, [3072, 3072]), ("down_proj", 3072, [1024])]
ROWS = [1, 8, 32, 64, 128, 256, 2048, 16384]


def operands(rows: int, in_features: int, output_sizes: list[int], num_loras: int, rank: int):
    width = len(output_sizes) * rank
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, in_features, device="cuda", generator=gen).bfloat16()
    a = (torch.randn(num_loras * width, in_features, device="cuda", generator=gen) * 0.02).bfloat16()
    b = (torch.randn(sum(output_sizes), num_loras * width, device="cuda", generator=gen) * 0.02).bfloat16()
    out = torch.randn(rows, sum(output_sizes), device="cuda", generator=gen).bfloat16()
    slots = torch.randint(0, num_loras, (rows,), device="cuda", generator=gen, dtype=torch.int32)
    slots[7::8] = -1
    return x, a, b, slots, out, width


def time_us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=30) * 1000


def compare(num_loras: int, rank: int) -> None:
    print(f"\nmax_loras {num_loras}, rank {rank}: us a call (CUDA-graph replay); base = the projection itself")
    print(f"{'projection':>13} {'rows':>6} {'base':>7} {'pytorch':>8} {'fused':>7} {'fused/pt':>8} {'max |diff|':>10}")
    for (name, k, sizes), rows in itertools.product(PROJECTIONS, ROWS):
        x, a, b, slots, out, width = operands(rows, k, sizes, num_loras, rank)
        weight = torch.randn(sum(sizes), k, device="cuda").bfloat16()
        mask = lora_mask(slots, num_loras, torch.bfloat16)
        ref = lora_add_ref(x, a, b, mask, out.clone())
        got = lora_add(x, a, b, slots, out.clone(), width)
        diff = (got.float() - ref.float()).abs().max().item()
        base = time_us(lambda: torch.mm(x, weight.t()))
        pytorch = time_us(lambda: lora_add_ref(x, a, b, mask, out))
        fused = time_us(lambda: lora_add(x, a, b, slots, out, width))
        print(f"{name:>13} {rows:>6} {base:7.2f} {pytorch:8.2f} {fused:7.2f} {fused / pytorch:8.2f} {diff:10.2e}",
              flush=True)


def sweep(num_loras: int, rank: int) -> None:
    print(f"\ntile sweep, max_loras {num_loras}, rank {rank}: us a call; * = lora_kernel_config's choice")
    for (name, k, sizes), rows in itertools.product(PROJECTIONS, [8, 64, 256, 16384]):
        x, a, b, slots, out, width = operands(rows, k, sizes, num_loras, rank)
        chosen = lora_kernel_config(rows, a.shape[0])
        results = []
        for block_n, block_r, stages, warps in itertools.product((32, 64, 128), (16, 32, 64), (1, 2, 3), (2, 4)):
            if block_r > max(16, triton.next_power_of_2(a.shape[0])):
                continue
            cfg = LoRAKernelConfig(chosen.block_m, block_n, block_r, warps, stages)
            results.append((time_us(lambda: lora_add(x, a, b, slots, out, width, cfg)), cfg))
        results.sort(key=lambda r: r[0])
        default = time_us(lambda: lora_add(x, a, b, slots, out, width, chosen))
        best = ", ".join(f"{t:.2f} n{c.block_n} r{c.block_r} s{c.num_stages} w{c.num_warps}" for t, c in results[:3])
        print(f"{name:>13} {rows:>6}: *{default:.2f} (n{chosen.block_n} r{chosen.block_r}); best {best}", flush=True)


def joined(num_loras: int, rank: int) -> None:
    """The packed layers' product over [W; A_all] (layers/lora.py, join_weight): cuBLAS at W's
    rows, at W's rows plus A_all's, and those rounded up to 64 and 128; then a projection's whole
    LoRA product both ways (base GEMM + shrink GEMM + expand, against joined GEMM + expand)."""
    print(f"\njoined weight, max_loras {num_loras}, rank {rank}: us a call (CUDA-graph replay)")
    for name, k, sizes in PROJECTIONS[0::2]:             # q/k/v and gate/up: the packed layers
        n, num_cols = sum(sizes), num_loras * len(sizes) * rank
        candidates = {"W": n, "W+A": n + num_cols, "pad64": -(-(n + num_cols) // 64) * 64,
                      "pad128": -(-(n + num_cols) // 128) * 128}
        for rows in ROWS:
            x, a, b, slots, out, width = operands(rows, k, sizes, num_loras, rank)
            times = {}
            for label, total in candidates.items():
                weight = torch.randn(total, k, device="cuda").bfloat16()
                times[label] = time_us(lambda: torch.mm(x, weight.t()))
            weight = torch.randn(candidates["pad64"], k, device="cuda").bfloat16()
            separate = time_us(lambda: lora_add(x, a, b, slots, torch.mm(x, weight[:n].t()), width))
            both = time_us(lambda: (lambda p: lora_expand(p[:, n:n + num_cols], b, slots, p[:, :n], width))(
                torch.mm(x, weight.t())))
            print(f"{name:>13} {rows:>6}: " + " ".join(f"{k_} {v:.2f}" for k_, v in times.items())
                  + f" | separate {separate:.2f} joined {both:.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-loras", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--only-joined", action="store_true", help="the joined weight's timings alone")
    opts = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    for num_loras in opts.max_loras:
        joined(num_loras, opts.rank)
    if opts.only_joined:
        return
    for num_loras in opts.max_loras:
        compare(num_loras, opts.rank)
    if not opts.no_sweep:
        sweep(opts.max_loras[0], opts.rank)


if __name__ == "__main__":
    main()
