"""What the device does between two decode graphs in the real run: bench.py's workload and warm-up,
torch.profiler's CUDA trace over engine steps START..STOP of the timed run, and from it, for each
pair of consecutive decode steps, the time from the end of one graph's last kernel (the sampler's
_select_kernel) to the start of the next graph's first (_take_prev_tokens_kernel), and the
copies that run in that window (and the time to the forward's first kernel, the one after
_take_prev_tokens_kernel); and the gaps between the kernels inside each graph. Back-to-back probes (step_overhead.py) queue many steps ahead; the
run queues one, so this is the measure of what a step boundary costs the run.

    PYTHONPATH=. python benchmarks/step_boundary.py --start 400 --stop 460 --out /tmp/boundary
"""
import argparse
import gzip
import json
import os
import statistics
import sys

import torch

FIRST_KERNEL, LAST_KERNEL = "_take_prev_tokens_kernel", "_select_kernel"


def boundaries(events: list[dict]) -> list[dict]:
    """Per boundary (a LAST_KERNEL followed by a FIRST_KERNEL): the idle time between them and
    each copy inside, in us. events: the trace's GPU events (name, cat, ts, dur)."""
    events = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy") and "dur" in e),
                    key=lambda e: e["ts"])
    kernels = [i for i, e in enumerate(events) if e["cat"] == "kernel"]
    out = []
    for k, (i, j) in enumerate(zip(kernels, kernels[1:])):
        last, first = events[i], events[j]
        if not (last["name"].startswith(LAST_KERNEL) and first["name"].startswith(FIRST_KERNEL)):
            continue                       # not the end of one decode graph and the start of the next
        end = last["ts"] + last["dur"]
        row = {"idle": first["ts"] - end}
        if k + 2 < len(kernels):           # to the forward's first kernel, the one after FIRST_KERNEL
            row["to_forward"] = events[kernels[k + 2]]["ts"] - end
        for copy in events[i + 1:j]:
            kind = "h2d" if "HtoD" in copy["name"] else "d2h" if "DtoH" in copy["name"] else "other"
            row[kind + "_start"], row[kind] = copy["ts"] - end, copy["dur"]
        out.append(row)
    return out


def graph_gaps(events: list[dict]) -> list[list[float]]:
    """Per decode graph (FIRST_KERNEL to the next LAST_KERNEL), the gaps between its consecutive
    kernels, in us: what the graph's own launches cost. An eager kernel just before a replay
    made every one of them ~0.4 us longer (benchmarks/NOTES.md, entry 40)."""
    kernels = sorted((e for e in events if e.get("cat") == "kernel" and "dur" in e), key=lambda e: e["ts"])
    out, current = [], None
    for a, b in zip(kernels, kernels[1:]):
        if a["name"].startswith(FIRST_KERNEL):
            current = []
        if current is not None:
            current.append(b["ts"] - (a["ts"] + a["dur"]))
            if b["name"].startswith(LAST_KERNEL):
                out.append(current)
                current = None
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--start", type=int, default=400, help="first engine step traced (1-based)")
    ap.add_argument("--stop", type=int, default=460)
    ap.add_argument("--out", default=".", help="folder for the trace (gzipped chrome trace)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("step_boundary.py needs CUDA")
    from torch.profiler import ProfilerActivity, profile

    import bench
    from mini_engine import LLM, SamplingParams
    from mini_engine.model.random_checkpoint import default_checkpoint

    prompts, max_tokens = bench.make_workload()
    llm = LLM(default_checkpoint(device="cuda"), max_model_len=bench.MAX_MODEL_LEN, max_num_seqs=256)
    bench.warm_up(llm, prompts, dict(temperature=0.6))
    engine, prof, count = llm.engine, profile(activities=[ProfilerActivity.CUDA]), [0]
    step = engine.step

    def traced_step():
        count[0] += 1
        if count[0] == args.start:
            prof.start()
        outputs = step()
        if count[0] == args.stop:
            torch.cuda.synchronize()
            prof.stop()
        return outputs

    engine.step = traced_step
    llm.generate(prompts, [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in max_tokens],
                 use_tqdm=False)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"step_boundary_{args.start}_{args.stop}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = f.read()
    with gzip.open(path + ".gz", "wt") as f:
        f.write(trace)
    os.remove(path)
    events = json.loads(trace)["traceEvents"]
    rows = boundaries(events)
    print(f"steps {args.start}-{args.stop}: {len(rows)} boundaries between decode graphs (us, median / min / max)")
    for key in ("idle", "to_forward", "h2d_start", "h2d", "d2h_start", "d2h"):
        values = [r[key] for r in rows if key in r]
        if values:
            print(f"  {key:>9s} {statistics.median(values):7.2f} {min(values):7.2f} {max(values):7.2f}"
                  f"   ({len(values)} of {len(rows)})")
    gaps = graph_gaps(events)
    if gaps:
        print(f"inside {len(gaps)} decode graphs: kernel-to-kernel gap median "
              f"{statistics.median(g for graph in gaps for g in graph):.3f} us, "
              f"{statistics.median(sum(graph) for graph in gaps):.1f} us a graph (median of the sums)")


if __name__ == "__main__":
    main()
