"""Where a run's steps spend their device time: the benchmark's workload through the engine's own
step loop, measured three ways.

1. As the run does it (async scheduling, no profiler): per step, the host's time to enqueue the
   step (ModelRunner.launch) against the device time between a CUDA event recorded once the
   inputs are built and one after the last kernel (as bench.py --profile times it).
2. Again from the start, one step at a time under torch.profiler (a synchronisation after each
   step, so the device's span of a step is its own): the step's kernels end to end, the time
   they cover, and the largest idle gaps between them, with the kernels on either side.
3. Again from the start, as the run takes them (async scheduling), --steps steps from each
   --start under torch.profiler: the device's idle time between operations, summed by the names of
   the operations on either side (graph replays show their kernels too).

If the device time of (1) is well above the kernels' busy time of (2), the device waits between
kernels: on the host (enqueue time near device time) or on something the gaps name.

    PYTHONPATH=. python benchmarks/step_gaps.py --steps 12
    PYTHONPATH=. python benchmarks/step_gaps.py --steps 10 --start 100 800   # pass 3 inside the decode phase
"""
import argparse
import json
import os
import sys
import tempfile
import time

import torch


def add_workload(llm, temperature: float) -> None:
    from bench import make_workload
    from mini_engine.sampling_params import SamplingParams
    prompts, max_tokens = make_workload()
    for prompt, m in zip(prompts, max_tokens):
        llm.engine.add_request(prompt, SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=m))


def drain(engine) -> None:
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()


def timed_steps(engine, num_steps: int) -> list[dict]:
    """The first num_steps steps as the run takes them: host enqueue time and device time each."""
    runner, launch, prepare = engine.runner, engine.runner.launch, engine.runner.prepare_inputs
    current = {}

    def timed_prepare(rows, *args):
        t0 = time.perf_counter()
        out = prepare(rows, *args)
        current["prepare_ms"] = (time.perf_counter() - t0) * 1e3
        current["start"] = torch.cuda.Event(enable_timing=True)
        current["start"].record()
        return out

    def timed_launch(rows):
        t0 = time.perf_counter()
        handle = launch(rows)
        t1 = time.perf_counter()
        current["enqueue_ms"] = (t1 - t0) * 1e3
        # Host time each decoder layer took to enqueue (eager steps only: neither a decode graph's
        # replay nor the piecewise graphs' run the hooks),
        # and what came after the last layer (final norm, logits, sampler).
        marks = current.pop("layer_t", [])
        current["layer_ms"] = [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]
        current["tail_ms"] = (t1 - marks[-1]) * 1e3 if marks else None
        current["end"] = torch.cuda.Event(enable_timing=True)
        current["end"].record()
        current["rows"] = len(rows)
        return handle

    def layer_start(module, args):
        current.setdefault("layer_t", []).append(time.perf_counter())

    def timed(obj, name):
        """Wraps obj.name so that each step records the host time spent in it."""
        fn = getattr(obj, name)

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            current.setdefault("parts", {})[name] = (time.perf_counter() - t0) * 1e3
            return out
        setattr(obj, name, wrapper)
        return obj, name

    wrapped = [timed(runner.model, "compute_logits"), timed(runner, "sampling_tensors"),
               timed(runner.sampler, "forward")]
    hooks = [layer.register_forward_pre_hook(layer_start) for layer in runner.model.layers]
    hooks.append(runner.model.norm.register_forward_pre_hook(layer_start))
    runner.prepare_inputs, runner.launch = timed_prepare, timed_launch
    steps = []
    before = torch.cuda.memory_stats()
    # Any call that makes the host wait for the device inside a step is reported (as a warning).
    torch.cuda.set_sync_debug_mode("warn")
    try:
        for _ in range(num_steps):
            current.clear()
            t0 = time.perf_counter()
            engine.step()
            steps.append(dict(current, step_ms=(time.perf_counter() - t0) * 1e3,
                              retries=torch.cuda.memory_stats().get("num_alloc_retries", 0),
                              prefill_tokens=engine.last_step_prefill_tokens,
                              decode_tokens=engine.last_step_decode_tokens))
    finally:
        torch.cuda.set_sync_debug_mode(0)
        del runner.prepare_inputs, runner.launch
        for hook in hooks:
            hook.remove()
        for obj, name in wrapped:
            delattr(obj, name)
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    # A retry is a cudaMalloc that failed, after which the allocator synchronised the device and
    # freed its cached blocks: the host waits for every queued kernel.
    print("caching allocator during these steps:", ", ".join(
        f"{key} {after.get(key, 0) - before.get(key, 0)}"
        for key in ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free")))
    for s in steps:
        s["gpu_ms"] = s.pop("start").elapsed_time(s.pop("end"))
    return steps


def device_activity(prof) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every kernel, memcpy and memset the profiler saw, by start."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    acts = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
            if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    return sorted(acts)


def idle_gaps(acts: list[tuple[float, float, str]]) -> tuple[list[tuple[float, str, str]], float, float]:
    """(idle us, operation before, operation after) for every stretch the device did nothing, and
    the time any operation ran (us) and the span from the first start to the last end (us)."""
    busy, end, gaps, prev = 0.0, acts[0][0], [], None
    for start, stop, name in acts:
        if start > end and prev is not None:
            gaps.append((start - end, prev, name))
        busy += max(0.0, stop - max(start, end))
        end, prev = max(end, stop), name
    return gaps, busy, end - acts[0][0]


def gaps_report(acts: list[tuple[float, float, str]], top: int) -> tuple[dict, list[str]]:
    gaps, busy, span = idle_gaps(acts)
    gaps.sort(reverse=True)
    total_gap = sum(g for g, _, _ in gaps)
    stats = dict(span_ms=span / 1e3, busy_ms=busy / 1e3, kernels=len(acts), gaps=len(gaps),
                 gap_ms=total_gap / 1e3, gaps_over_5us_ms=sum(g for g, _, _ in gaps if g > 5) / 1e3)
    lines = [f"    {g:8.1f} us  {a[:50]:50s} -> {b[:50]}" for g, a, b in gaps[:top]]
    return stats, lines


def gaps_by_pair(acts: list[tuple[float, float, str]], top: int) -> list[str]:
    """The idle time between consecutive device operations, summed by (before, after) name."""
    pairs = {}
    for gap, before, after in idle_gaps(acts)[0]:
        key = (before.split("<")[0][:44], after.split("<")[0][:44])
        total, count = pairs.get(key, (0.0, 0))
        pairs[key] = (total + gap, count + 1)
    ranked = sorted(pairs.items(), key=lambda kv: -kv[1][0])[:top]
    return [f"    {total / 1e3:7.2f} ms in {count:5d} gaps  {a:44s} -> {b}" for (a, b), (total, count) in ranked]


def time_by_kernel(acts: list[tuple[float, float, str]], top: int) -> list[str]:
    """Device time summed by operation name, largest first."""
    totals = {}
    for start, stop, name in acts:
        name = name.split("<")[0][:60]
        total, count = totals.get(name, (0.0, 0))
        totals[name] = (total + stop - start, count + 1)
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [f"    {total / 1e3:8.2f} ms {count:6d} calls {total / count:8.1f} us each  {name}"
            for name, (total, count) in ranked]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--top", type=int, default=8, help="gaps listed a step")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--no-profile", action="store_true", help="the timed pass only")
    ap.add_argument("--start", type=int, nargs="+", default=[0],
                    help="the third pass profiles --steps steps from each of these steps on")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("step_gaps.py needs CUDA")
    from torch.profiler import ProfilerActivity, profile
    from bench import make_workload, warm_up
    from mini_engine import LLM
    from mini_engine.model.random_checkpoint import default_checkpoint

    # No prefix cache: the second pass runs the same prompts and must do the same work.
    llm = LLM(default_checkpoint(device="cuda"), max_model_len=2048, enable_prefix_caching=False)
    engine = llm.engine
    warm_up(llm, make_workload()[0], dict(temperature=args.temperature))

    add_workload(llm, args.temperature)
    steps = timed_steps(engine, args.steps)
    drain(engine)
    print("1. the run's own steps (async scheduling)")
    print("(step: engine.step(), which also waits for the previous step's tokens; enqueue: "
          "ModelRunner.launch, of which prepare: prepare_inputs; device: after prepare to the last kernel)")
    print(f"{'step':>4s} {'rows':>5s} {'prefill':>8s} {'decode':>6s} {'step ms':>8s} {'enqueue ms':>10s} "
          f"{'prepare ms':>10s} {'device ms':>9s} {'alloc retries':>13s}")
    for i, s in enumerate(steps):
        print(f"{i:4d} {s['rows']:5d} {s['prefill_tokens']:8d} {s['decode_tokens']:6d} {s['step_ms']:8.2f} "
              f"{s['enqueue_ms']:10.2f} {s['prepare_ms']:10.2f} {s['gpu_ms']:9.2f} {s['retries']:13d}")
        if s["layer_ms"]:
            layers = s["layer_ms"]
            slowest = max(range(len(layers)), key=layers.__getitem__)
            print(f"       layers: median {sorted(layers)[len(layers) // 2]:.2f} ms, slowest layer {slowest} "
                  f"{layers[slowest]:.2f} ms, all {sum(layers):.2f} ms; after the layers {s['tail_ms']:.2f} ms "
                  f"({', '.join(f'{k} {v:.2f}' for k, v in s.get('parts', {}).items())})")

    if args.no_profile:
        return
    add_workload(llm, args.temperature)
    print("\n2. the same steps one at a time under torch.profiler")
    for i in range(args.steps):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.step()
            torch.cuda.synchronize()
        acts = device_activity(prof)
        if not acts:
            continue
        stats, lines = gaps_report(acts, args.top)
        print(f"step {i}: span {stats['span_ms']:.2f} ms, kernels busy {stats['busy_ms']:.2f} ms, "
              f"{stats['kernels']} kernels, {stats['gaps']} gaps = {stats['gap_ms']:.2f} ms "
              f"({stats['gaps_over_5us_ms']:.2f} ms in gaps over 5 us); largest:")
        print("\n".join(lines))
    drain(engine)

    for start in args.start:
        add_workload(llm, args.temperature)
        for _ in range(start):
            engine.step()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                engine.step()
            torch.cuda.synchronize()
        acts = device_activity(prof)
        stats, _ = gaps_report(acts, 0)
        print(f"\n3. steps {start}-{start + args.steps - 1} ({engine.last_step_decode_tokens} decode rows in the last) "
              f"as the run takes them (async scheduling) "
              f"under torch.profiler: span {stats['span_ms']:.2f} ms, kernels busy {stats['busy_ms']:.2f} ms, "
              f"idle {stats['gap_ms']:.2f} ms in {stats['gaps']} gaps; by the operations on either side:")
        print("\n".join(gaps_by_pair(acts, 3 * args.top)))
        print("  device time by operation:")
        print("\n".join(time_by_kernel(acts, 3 * args.top)))
        drain(engine)
    print(f"\nKV blocks all free: {engine.num_free_blocks == engine.block_manager.num_blocks}")


if __name__ == "__main__":
    main()
