"""Where inside one decode-attention launch the time goes: every program's start and end on the
GPU's global timer, and the SM it ran on, for steps of the benchmark's schedule.

decode_sweep.py times whole launches; this shows their inside. The engine's _paged_decode_kernel
is compiled a second time from its own source with three timer reads added (after the program ids,
after the tile loop, after the stores) and a store of them per program, so the kernel measured is
the engine's, not a copy kept in the tree. Each step is launched twice, eagerly, and both launches
are traced (the gap between them is the host's and a zeroing kernel's, not a graph's). For each launch it prints
the span, the bytes it moved against read bandwidth, when programs start and end, and a timeline
of resident programs and the bandwidth they imply (each program's bytes spread evenly over its
life), so that a loss at the start, in the middle or at the end can be told apart. Needs CUDA.

    PYTHONPATH=. python benchmarks/attention_timeline.py [--steps 1 481 897] [--splits 2] [--stages 4] [--out DIR]
"""
import argparse
import importlib.util
import inspect
import json
import os
import sys
import tempfile

import torch

TRACE_FIELDS = 4        # start, after the tile loop, end (ns), SM id

_TIMER_HELPERS = '''
# anchor: any int32 scalar, an operand the asm ignores (an elementwise asm needs one for its shape).
@triton.jit
def _globaltimer(anchor):
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [anchor], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _smid(anchor):
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [anchor], dtype=tl.int32, is_pure=False,
                                     pack=1)

'''

_TRACE_STORES = '''
    _t3 = _globaltimer(seq)
    _pid = ((seq * tl.num_programs(1) + kv_head) * tl.num_programs(0) + split).to(tl.int64) * 4
    tl.store(trace_ptr + _pid, _t0)
    tl.store(trace_ptr + _pid + 1, _t2)
    tl.store(trace_ptr + _pid + 2, _t3)
    tl.store(trace_ptr + _pid + 3, _smid(seq).to(tl.int64))
'''


def traced_decode_kernel():
    """_paged_decode_kernel with timer reads and a trace_ptr argument ([programs, 4] int64), built
    from the engine's source in a module whose globals are the kernel module's."""
    import mini_engine.kernels.paged_attention as pa
    src = inspect.getsource(pa._paged_decode_kernel.fn)
    edits = [("def _paged_decode_kernel(", "def _paged_decode_kernel_traced("),
             ("USE_PDL: tl.constexpr):", "USE_PDL: tl.constexpr, trace_ptr):"),
             ("    seq = tl.program_id(2)\n", "    seq = tl.program_id(2)\n    _t0 = _globaltimer(seq)\n"),
             ("    if NUM_SPLITS == 1:\n", "    _t2 = _globaltimer(seq)\n    if NUM_SPLITS == 1:\n")]
    for old, new in edits:
        if src.count(old) != 1:
            raise RuntimeError(f"the decode kernel's source changed: {old!r} is not there once")
        src = src.replace(old, new)
    header = "import mini_engine.kernels.paged_attention as _pa\nglobals().update(vars(_pa))\n"
    path = os.path.join(tempfile.mkdtemp(), "traced_decode_kernel.py")
    with open(path, "w") as f:
        f.write(header + _TIMER_HELPERS + src.rstrip() + "\n" + _TRACE_STORES)
    spec = importlib.util.spec_from_file_location("traced_decode_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._paged_decode_kernel_traced


class TracingLaunches:
    """Stands in for _paged_decode_kernel while installed: each launch gets its own trace buffer."""

    def __init__(self, kernel):
        self.kernel, self.traces = kernel, []

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        programs = grid[0] * grid[1] * grid[2]

        def traced(*args, **kwargs):
            trace = torch.zeros(programs, TRACE_FIELDS, dtype=torch.int64, device="cuda")
            self.traces.append((grid, trace))
            return launch(*args, trace_ptr=trace, **kwargs)
        return traced


def program_bytes(grid, seq_lens: list[int], tile_n: int, kv_bytes_per_token: int) -> list[int]:
    """Bytes of K and V each program reads, in the kernel's program order (split fastest)."""
    num_splits, num_kv_heads, num_seqs = grid
    out = []
    for seq in range(num_seqs):
        tiles = -(-seq_lens[seq] // tile_n)
        per_split = -(-tiles // num_splits)
        for _ in range(num_kv_heads):
            for split in range(num_splits):
                lo, hi = split * per_split * tile_n, min((split + 1) * per_split * tile_n, seq_lens[seq])
                out.append(max(0, hi - lo) * kv_bytes_per_token)
    return out


def describe(trace: torch.Tensor, nbytes: list[int], origin: int, read_gbps: float, slots: int,
             bins: int = 16) -> dict:
    start, loop_end, end = ((trace[:, i] - origin).tolist() for i in range(3))
    sms = trace[:, 3].tolist()
    span = max(end) - min(start)
    total = sum(nbytes)
    ordered_starts, ordered_ends = sorted(start), sorted(end)

    def q(values, f):
        return values[min(len(values) - 1, int(f * len(values)))]
    width = span / bins
    residents, gbps = [0.0] * bins, [0.0] * bins
    lo = min(start)
    for s, e, b in zip(start, end, nbytes):
        life = max(e - s, 1)
        for k in range(bins):
            a, z = lo + k * width, lo + (k + 1) * width
            overlap = max(0.0, min(e, z) - max(s, a))
            residents[k] += overlap / width
            gbps[k] += b * overlap / life / width       # bytes per ns = GB/s
    summary = dict(programs=len(start), sms=len(set(sms)), first_start_ns=lo, span_ns=span,
                   bytes=total, achieved_GBps=total / span, at_read_bw_ns=total / read_gbps,
                   start_quantiles_ns=[q(ordered_starts, f) - lo for f in (0.5, 0.9, 1.0)],
                   end_quantiles_ns=[q(ordered_ends, f) - lo for f in (0.0, 0.1, 0.5, 0.9)],
                   last_end_ns=max(end) - lo,
                   loop_to_end_ns_median=sorted(e - le for e, le in zip(end, loop_end))[len(end) // 2],
                   residents=residents, implied_GBps=gbps, slots=slots)
    return summary


def print_summary(label: str, s: dict) -> None:
    print(f"  {label}: {s['programs']} programs on {s['sms']} SMs, span {s['span_ns'] / 1e3:.1f} us, "
          f"{s['bytes'] / 1e6:.0f} MB at {s['achieved_GBps']:.0f} GB/s (read bandwidth: "
          f"{s['at_read_bw_ns'] / 1e3:.1f} us)")
    print(f"    starts (us after the first): median {s['start_quantiles_ns'][0] / 1e3:.1f}, 90% "
          f"{s['start_quantiles_ns'][1] / 1e3:.1f}, last {s['start_quantiles_ns'][2] / 1e3:.1f}; ends: first "
          f"{s['end_quantiles_ns'][0] / 1e3:.1f}, 10% {s['end_quantiles_ns'][1] / 1e3:.1f}, median "
          f"{s['end_quantiles_ns'][2] / 1e3:.1f}, 90% {s['end_quantiles_ns'][3] / 1e3:.1f}, last "
          f"{s['last_end_ns'] / 1e3:.1f}; loop end to program end (median) {s['loop_to_end_ns_median']:.0f} ns")
    print("    timeline (16 bins): resident programs / implied GB/s")
    print("      " + " ".join(f"{r:5.0f}" for r in s["residents"]))
    print("      " + " ".join(f"{g:5.0f}" for g in s["implied_GBps"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, nargs="+", default=[1, 257, 481, 705, 769, 849, 897, 961],
                    help="decode steps of the benchmark's schedule (1-based)")
    ap.add_argument("--splits", type=int, help="num_splits instead of the engine's rule")
    ap.add_argument("--stages", type=int, help="num_stages instead of the default")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("attention_timeline.py needs CUDA", file=sys.stderr)
        return 2
    import mini_engine.kernels.paged_attention as pa
    from benchmarks.decode_sweep import (BLOCK_SIZE, DTYPE, HEAD_DIM, MAX_MODEL_LEN, decode_schedule,
                                         decode_step_inputs, make_kv_cache, read_bandwidth,
                                         scattered_block_tables)
    schedule = decode_schedule()
    read_gbps = read_bandwidth() / 1e9
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    kv_bytes_per_token = 2 * HEAD_DIM * DTYPE.itemsize      # one KV head's K and V
    gen = torch.Generator(device="cuda").manual_seed(0)
    max_tokens = max(sum(c) for c in schedule)
    num_blocks = max_tokens // BLOCK_SIZE + len(schedule[0]) + 64
    k_cache, v_cache = make_kv_cache(num_blocks, BLOCK_SIZE, "token", gen)
    tracer = TracingLaunches(traced_decode_kernel())
    knobs = {k: v for k, v in (("num_splits", args.splits), ("num_stages", args.stages)) if v is not None}
    results = []
    for step in args.steps:
        ctx = schedule[step - 1]
        b = len(ctx)
        seq_lens, q, sl, qsl, out = decode_step_inputs(ctx, gen)
        bs = len(seq_lens)
        tables = scattered_block_tables(seq_lens, BLOCK_SIZE, num_blocks, gen)
        original = pa._paged_decode_kernel
        pa._paged_decode_kernel = tracer
        try:
            def two_launches():
                for _ in range(2):
                    pa.paged_decode_attention(q, k_cache, v_cache, tables, sl, qsl, HEAD_DIM ** -0.5, MAX_MODEL_LEN,
                                              out, **knobs)
            two_launches()                      # compiles
            torch.cuda.synchronize()
            tracer.traces.clear()
            two_launches()
            torch.cuda.synchronize()
        finally:
            pa._paged_decode_kernel = original
        (grid, first), (_, second) = tracer.traces[-2:]
        stages = args.stages or pa.DECODE_STAGES
        slots = pa.decode_programs_per_sm(stages) * num_sms
        nbytes = program_bytes(grid, seq_lens, 64, kv_bytes_per_token)
        origin = int(first[:, 0].min())
        print(f"\n== step {step}: {b} rows (graph {bs}), mean context {sum(ctx) / b:.0f}, grid {grid} "
              f"{knobs or ''}==")
        s1 = describe(first, nbytes, origin, read_gbps, slots)
        s2 = describe(second, nbytes, int(second[:, 0].min()), read_gbps, slots)
        print_summary("launch 1", s1)
        print_summary("launch 2", s2)
        gap = int(second[:, 0].min()) - int(first[:, 2].max())
        # Eager launches: the gap holds the host's launch, the next trace buffer's zeroing and, with
        # splits, the reduce kernel. Not a CUDA graph's gap between kernels.
        print(f"  between them: {gap / 1e3:.1f} us from the first launch's last end to the second's first start")
        results.append(dict(step=step, rows=b, graph=bs, grid=list(grid), slots=slots, launch1=s1, launch2=s2,
                            gap_ns=gap))
    ticks = sorted({int(v) for v in tracer.traces[-1][1][:, 0].tolist()})
    steps_ns = sorted({b - a for a, b in zip(ticks, ticks[1:])})[:3]
    print(f"\nglobal timer: smallest steps between distinct start stamps {steps_ns} ns")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "attention_timeline.json"), "w") as f:
            json.dump(dict(read_GBps=read_gbps, num_sms=num_sms, steps=results), f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
