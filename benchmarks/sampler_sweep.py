"""The sampler's two kernels timed under CUDA-graph replay, as a decode step runs them (bf16
logits of Qwen3's 151,936 columns, a static buffer per batch size), for a few tile widths, warp
counts and chunk sizes; with each variant's tokens against the engine's defaults (greedy rows must
match exactly; a sampling row may move only where its draw falls within rounding of an edge).

    PYTHONPATH=. python benchmarks/sampler_sweep.py --batch 1 64 256
"""
import argparse
import itertools
import sys

import torch

VOCAB = 151_936


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 128, 256])
    ap.add_argument("--block-v", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--chunk", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--calls", type=int, default=20, help="sampler calls in one captured graph")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("sampler_sweep.py needs CUDA")
    from benchmarks.decode_step_profile import per_call_ms
    from mini_engine.kernels import sampling

    defaults = (sampling._BLOCK_V, sampling._NUM_WARPS, sampling.SAMPLE_CHUNK_SIZE)
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'rows':>5s} {'block_v':>7s} {'warps':>5s} {'chunk':>6s} {'us':>8s} {'TB/s':>6s} {'moved':>6s}"
          f"  (defaults: block_v {defaults[0]}, {defaults[1]} warps, chunk {defaults[2]})")
    for batch in args.batch:
        logits = (3 * torch.randn(batch, VOCAB, device="cuda", generator=gen)).to(torch.bfloat16)
        temps = torch.full((batch,), 0.6, device="cuda")
        temps[::4] = 0.0                                  # a greedy row in four
        seeds = torch.randint(0, 2**31 - 1, (batch,), device="cuda", generator=gen)
        out = torch.empty(batch, dtype=torch.int64, device="cuda")
        reference = sampling.sample(logits, temps, seeds)
        for block_v, warps, chunk in itertools.product(args.block_v, args.warps, args.chunk):
            if block_v > chunk:
                continue
            sampling._BLOCK_V, sampling._NUM_WARPS = block_v, warps
            try:
                sampling.sample(logits, temps, seeds, chunk, out=out)        # compile outside the capture
                tokens = out.clone()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(args.calls):
                        sampling.sample(logits, temps, seeds, chunk, out=out)
                us = per_call_ms(graph.replay, 10) * 1e3 / args.calls
            finally:
                sampling._BLOCK_V, sampling._NUM_WARPS = defaults[:2]
            greedy = temps == 0
            if not torch.equal(tokens[greedy], reference[greedy]):
                print(f"  block_v {block_v} warps {warps} chunk {chunk}: GREEDY ROWS DIFFER")
            moved = (tokens != reference)[~greedy].sum().item()
            print(f"{batch:5d} {block_v:7d} {warps:5d} {chunk:6d} {us:8.2f} {logits.numel() * 2 / us / 1e6:6.2f} "
                  f"{moved:6d}")


if __name__ == "__main__":
    main()
