"""Per-step profile of a run (bench.py --profile DIR): wall time against GPU time per step, by
batch size, and one picture of the run over time.

Wall time per step is the time between the host receiving the step's results and receiving the
previous step's: what the run pays for each step. (With async scheduling an engine step returns
the results of the step launched one call earlier, so the call's duration belongs to that step,
not to the one it launched.) GPU time runs from a CUDA event recorded once the step's inputs are
built to one after its last kernel: for graph replays that is the device's own time (an event
queued behind the previous step completes when that step does), for eager steps it also holds the
launch gaps the host leaves. Wall close to GPU means the host's work is hidden or small.
"""
import json
import os
import time
from dataclasses import asdict, dataclass


@dataclass(slots=True)
class StepRecord:
    start_s: float          # where its wall time starts, since the run began
    wall_ms: float
    gpu_ms: float | None
    num_seqs: int           # rows in the batch
    prefill_tokens: int
    decode_tokens: int
    running: int            # after the step
    waiting: int            # requests not yet running nor finished (StepProfiler's num_requests)


class StepProfiler:
    """Times every step of an LLMEngine: wall time between the arrivals of consecutive steps'
    results on the host, and the device time of each launch, between a CUDA event recorded once
    its inputs are built and one recorded after its last kernel. The events are read after the
    run, so timing never makes a step wait (with async scheduling a step returns while the device
    still runs it).

    num_requests: the requests of the run, so that a step's waiting count is those not yet running
    nor finished: LLM.generate adds requests only as the scheduler can take them, so the engine's
    own queue holds just the next step's. Without it, the length of that queue."""

    def __init__(self, engine, clock=time.perf_counter, num_requests: int | None = None):
        import torch
        self.engine, self.records, self.events = engine, [], []
        self.num_requests, self.finished = num_requests, 0
        self.t0 = self.interval_start = None
        self.awaiting = None            # async scheduling: the record whose results the next call returns
        cuda = engine.runner.device.type == "cuda"
        async_results = engine.config.async_scheduling
        runner, step, prepare, launch = engine.runner, engine.step, engine.runner.prepare_inputs, engine.runner.launch
        self.launched = None

        def timed_prepare(rows, *args):
            out = prepare(rows, *args)
            if cuda:
                self.launched = [torch.cuda.Event(enable_timing=True), None]
                self.launched[0].record()
            self.num_rows = len(rows)
            return out

        def timed_launch(rows):
            handle = launch(rows)
            if cuda:
                self.launched[1] = torch.cuda.Event(enable_timing=True)
                self.launched[1].record()
            return handle

        def timed_step():
            if self.t0 is None:
                self.t0 = self.interval_start = clock()
            self.launched, self.num_rows = None, 0
            out = step()
            end = clock()
            self.finished += sum(o.finished for o in out)
            launched = None
            if self.num_rows:
                s = engine.scheduler
                waiting = len(s.waiting) if num_requests is None else num_requests - len(s.running) - self.finished
                launched = StepRecord(0.0, 0.0, None, self.num_rows, engine.last_step_prefill_tokens,
                                      engine.last_step_decode_tokens, len(s.running), waiting)
                self.records.append(launched)
                self.events.append(self.launched)
            # The step whose results this call returned: the one launched a call earlier (async
            # scheduling) or in this call. Its wall time runs from the previous results to these;
            # the host's time before the first results goes to the first step.
            done = self.awaiting if async_results else launched
            if async_results:
                self.awaiting = launched
            if done is not None:
                done.start_s = self.interval_start - self.t0
                done.wall_ms = (end - self.interval_start) * 1e3
                self.interval_start = end
            return out

        runner.prepare_inputs = timed_prepare
        runner.launch = timed_launch
        engine.step = timed_step

    def finish(self) -> None:
        """Reads the events once the run is over."""
        for record, events in zip(self.records, self.events):
            if events is not None:
                events[1].synchronize()
                record.gpu_ms = events[0].elapsed_time(events[1])

    def summary(self) -> list[dict]:
        """Decode-only and mixed steps, by batch-size bucket: mean wall, mean GPU, their ratio."""
        buckets = [(1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 32), (33, 64), (65, 128), (129, 256), (257, 10**9)]
        rows = []
        for kind in ("decode", "mixed/prefill"):
            for lo, hi in buckets:
                sel = [r for r in self.records if lo <= r.num_seqs <= hi
                       and (r.prefill_tokens == 0) == (kind == "decode")]
                if not sel:
                    continue
                wall = sum(r.wall_ms for r in sel) / len(sel)
                gpus = [r.gpu_ms for r in sel if r.gpu_ms is not None]
                gpu = sum(gpus) / len(gpus) if gpus else None
                rows.append(dict(kind=kind, batch=f"{lo}-{hi}" if lo != hi else str(lo), steps=len(sel),
                                 wall_ms=wall, gpu_ms=gpu, wall_over_gpu=wall / gpu if gpu else None,
                                 total_wall_s=sum(r.wall_ms for r in sel) / 1e3))
        return rows

    def print_summary(self) -> None:
        self.finish()
        print(f"{'step kind':14s} {'batch':>8s} {'steps':>6s} {'wall ms':>8s} {'GPU ms':>8s} {'wall/GPU':>8s} {'total s':>8s}")
        for r in self.summary():
            gpu = f"{r['gpu_ms']:8.3f}" if r["gpu_ms"] is not None else f"{'-':>8s}"
            ratio = f"{r['wall_over_gpu']:8.2f}" if r["wall_over_gpu"] is not None else f"{'-':>8s}"
            print(f"{r['kind']:14s} {r['batch']:>8s} {r['steps']:6d} {r['wall_ms']:8.3f} {gpu} {ratio} {r['total_wall_s']:8.2f}")

    def save(self, out_dir: str, title: str) -> str:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "steps.jsonl"), "w") as f:
            for r in self.records:
                f.write(json.dumps(asdict(r)) + "\n")
        with open(os.path.join(out_dir, "step_summary.json"), "w") as f:
            json.dump(self.summary(), f, indent=1)
        return plot(self.records, os.path.join(out_dir, "profile.png"), title)


def plot(records: list[StepRecord], path: str, title: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t = [r.start_s for r in records]
    fig, axes = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    ax = axes[0]
    ax.plot(t, [r.running for r in records], label="running sequences", color="tab:blue")
    ax.plot(t, [r.waiting for r in records], label="waiting sequences", color="tab:orange")
    ax.set_ylabel("sequences")
    ax.legend(loc="upper right")
    ax.set_title(title)
    ax = axes[1]
    ax.bar(t, [r.prefill_tokens for r in records], width=[r.wall_ms / 1e3 for r in records], align="edge",
           label="prefill tokens", color="tab:red", alpha=0.6)
    ax.plot(t, [r.decode_tokens for r in records], label="decode tokens", color="tab:green")
    ax.set_ylabel("tokens per step")
    ax.set_yscale("symlog", linthresh=256)
    ax.legend(loc="upper right")
    ax = axes[2]
    ax.plot(t, [r.wall_ms for r in records], label="wall time per step", color="black", linewidth=0.8)
    if any(r.gpu_ms is not None for r in records):
        ax.plot(t, [r.gpu_ms for r in records], label="GPU time per step", color="tab:purple", linewidth=0.8)
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax.set_xlabel("seconds since the run began")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
