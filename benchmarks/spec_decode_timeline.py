"""Where a draft model's cycle spends its time on the device: bench.py's checkpoint drafting for
itself (a draft that is always right, so every cycle is k draft steps and one verifying step),
1 and --requests requests, 512-token prompts.

1. Timed: the fastest and the median of --runs generations, ms per token of a request.
2. One generation of --tokens tokens under torch.profiler: the device's busy time against its
   span, its idle gaps summed by the operations on either side (a graph replay's kernels show),
   and the device time by kernel.

    PYTHONPATH=. python benchmarks/spec_decode_timeline.py
"""
import argparse
import random
import statistics
import sys
import time

import torch

from benchmarks.step_gaps import device_activity, gaps_by_pair, gaps_report, time_by_kernel


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128, help="tokens a request in the profiled run")
    ap.add_argument("--top", type=int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("spec_decode_timeline.py needs a GPU")
    from mini_engine import LLM, SamplingParams
    from mini_engine.model.random_checkpoint import default_checkpoint

    path = default_checkpoint(device="cuda")
    llm = LLM(path, max_num_seqs=64, max_model_len=2048, num_kv_blocks=512, enable_prefix_caching=False,
              speculative_config={"model": path, "num_speculative_tokens": args.k})
    rng = random.Random(0)
    for num in args.requests:
        batch = [[rng.randrange(1000, 100000) for _ in range(512)] for _ in range(num)]
        params = SamplingParams(temperature=0, max_tokens=512, ignore_eos=True)
        llm.generate(batch, params, use_tqdm=False)           # warm-up
        walls = []
        for _ in range(args.runs):
            start = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            walls.append(time.perf_counter() - start)
        stats = llm.engine.spec_decode_stats
        print(f"{num} request(s): ms per token a request: fastest {1000 * min(walls) / 512:.4f}, "
              f"median {1000 * statistics.median(walls) / 512:.4f}; acceptance {stats.acceptance_rate:.3f}")
        short = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            llm.generate(batch, short, use_tqdm=False)
            torch.cuda.synchronize()
        acts = device_activity(prof)
        summary, lines = gaps_report(acts, args.top)
        print(f"  profiled ({args.tokens} tokens):", {k: round(v, 3) if isinstance(v, float) else v
                                                     for k, v in summary.items()})
        print("  largest gaps:", *lines, sep="\n")
        print("  idle by the operations on either side:", *gaps_by_pair(acts, args.top), sep="\n")
        print("  device time by kernel:", *time_by_kernel(acts, args.top), sep="\n")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
