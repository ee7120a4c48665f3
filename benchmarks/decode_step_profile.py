"""Where a decode step's GPU time goes: one decode batch per size (contexts ~U(ctx/2, 3ctx/2)),
timed as a CUDA-graph replay, then the same step under torch.profiler with kernels listed by
total device time. With --in-graph the profiler watches the graph replays themselves instead (the
engine's own launches, PDL overlap included) and the table ends with the replay's time against
its kernels' sum: what is left between kernels. Needs CUDA.

    PYTHONPATH=. python benchmarks/decode_step_profile.py --batch 1 64 256 --ctx 1000 [--in-graph]
"""
import argparse
import random
import sys

import torch


def synthetic_decode_rows(batch: int, ctx: int, block_size: int, rng: random.Random, params) -> list:
    """One decode row per sequence, contexts ~U(ctx/2, 3ctx/2), each on blocks of its own."""
    from mini_engine.runner.batch import BatchRow
    rows, next_block = [], 0
    for _ in range(batch):
        context = rng.randint(ctx // 2, 3 * ctx // 2)
        n = -(-(context + 1) // block_size)
        rows.append(BatchRow([rng.randrange(1000)], context, list(range(next_block, next_block + n)), True, params))
        next_block += n
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--ctx", type=int, default=1000)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--in-graph", action="store_true", help="profile the decode graphs' replays (kernels as the "
                    "engine runs them), not the same step run eagerly")
    ap.add_argument("--prefill-tokens", type=int, default=0,
                    help="also profile one prefill step: the benchmark's first prompts, whole, up to this many tokens")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_step_profile.py needs CUDA")
    from mini_engine import LLM
    from mini_engine.model.random_checkpoint import default_checkpoint
    from mini_engine.sampling_params import SamplingParams

    llm = LLM(default_checkpoint(device="cuda"), max_model_len=2048, max_num_seqs=max(args.batch),
              kernels=args.kernels, gpu_memory_utilization=0.5)
    runner = llm.engine.runner
    rng = random.Random(0)
    params = SamplingParams(temperature=0.6, max_tokens=1)
    bs = runner.block_size
    for batch in args.batch:
        rows = synthetic_decode_rows(batch, args.ctx, bs, rng, params)
        if args.in_graph:
            print(profile_graph_replay(runner, rows, replays=20, top=args.top))
            continue
        step_ms, table = time_and_profile(runner, rows, warmup=3, timed=20, profiled=5, top=args.top)
        kv_gb = sum(r.start_position + 1 for r in rows) * runner.kv_bytes_per_token / 1e9
        print(f"\n=== decode batch {batch}, mean context {sum(r.start_position for r in rows) / batch:.0f}: "
              f"{step_ms:.3f} ms per step back to back (graphs: {runner.graph_runner is not None}); "
              f"KV {kv_gb:.2f} GB -> {kv_gb / 4.25:.3f} ms at 4.25 TB/s, weights 0.28 ms")
        print(table)
    if args.prefill_tokens:
        profile_prefill(runner, args.prefill_tokens, params, args.top)


def profile_prefill(runner, max_tokens: int, params, top: int) -> None:
    """One prefill step as the scheduler's first one is: the workload's prompts in order, whole,
    while they fit max_tokens."""
    from bench import make_workload
    from mini_engine.runner.batch import BatchRow
    prompts, _ = make_workload()
    rows, tokens, next_block = [], 0, 0
    for prompt in prompts:
        if tokens + len(prompt) > max_tokens:
            break
        n = -(-len(prompt) // runner.block_size)
        rows.append(BatchRow(list(prompt), 0, list(range(next_block, next_block + n)), True, params))
        tokens, next_block = tokens + len(prompt), next_block + n
    step_ms, table = time_and_profile(runner, rows, warmup=2, timed=5, profiled=3, top=top)
    print(f"\n=== prefill step, {len(rows)} prompts, {tokens} tokens: {step_ms:.2f} ms per step "
          f"(kernel times below are over 3 steps)")
    print(table)


def per_call_ms(fn, calls: int, warmup: int = 3) -> float:
    """Device ms per call of fn, called back to back (after warmup calls) between two CUDA events:
    where fn never waits for the device, the host runs ahead and this is the device's time."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def time_and_profile(runner, rows: list, warmup: int, timed: int, profiled: int, top: int) -> tuple[float, str]:
    """The step's time back to back (runner.execute: graph replay where one applies, host work
    and the wait for the tokens included), then its kernels under torch.profiler with graphs off,
    so that each kernel shows by name: (ms per step, the profiler's table)."""
    from torch.profiler import ProfilerActivity, profile
    step_ms = per_call_ms(lambda: runner.execute(rows), timed, warmup)
    graph_runner, runner.graph_runner = runner.graph_runner, None
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(profiled):
                runner.execute(rows)
            torch.cuda.synchronize()
    finally:
        runner.graph_runner = graph_runner
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=top, max_name_column_width=60)
    return step_ms, table


def profile_graph_replay(runner, rows: list, replays: int, top: int) -> str:
    """The decode graph of rows' batch size, replayed back to back: its time per replay (CUDA
    events), then its kernels under torch.profiler by device time a replay. With PDL a kernel is
    resident while it waits for the one ahead, so at small batch the kernels' sum exceeds the
    replay; at large batch the difference is the time between kernels."""
    import collections
    from torch.profiler import ProfilerActivity, profile
    graphs = runner.graph_runner
    size = graphs.graph_size(len(rows), 1)
    runner.prepare_inputs(rows, size)
    replay_ms = per_call_ms(lambda: graphs.replay(size, runner.turn), replays)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graphs.replay(size, runner.turn)
        torch.cuda.synchronize()
    kernels = collections.defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type.name == "CUDA":
            kernels[event.name[:72]][0] += event.device_time / replays
            kernels[event.name[:72]][1] += 1
    total_us = sum(us for us, _ in kernels.values())
    count = sum(n for _, n in kernels.values()) / replays
    lines = [f"\n=== decode graph {size} ({len(rows)} rows): {replay_ms * 1e3:.1f} us a replay; its {count:.0f} "
             f"kernels {total_us:.1f} us; left between kernels {replay_ms * 1e3 - total_us:.1f} us "
             f"({(replay_ms * 1e3 - total_us) / count:.2f} us a kernel)"]
    for name, (us, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {us:8.1f} us {n / replays:4.0f} a replay {us * replays / n:8.2f} us each  {name}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
