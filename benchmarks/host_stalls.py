"""bench.py with the host's stalls logged: every Triton compilation and every garbage-collector
pass over the older generations, each with its duration, the time since this script started and
the engine step it fell in; and every engine step whose host work (its time in LLMEngine.step,
less the wait for the previous step's tokens) took more than --slow-step-ms. A step that takes
~100 ms where its neighbours take 5 (bench.py --profile) is one of these, or something else on
the host; this tells which.

    PYTHONPATH=. python benchmarks/host_stalls.py [--slow-step-ms MS] [--profile-step N] [bench.py options]

--profile-step N runs step N of each generate call (bench.py's two warm-ups, then the timed run)
under cProfile and prints where its host time went. Steps are counted from 0 in each call.
"""
import argparse
import cProfile
import gc
import pstats
import sys
import time

import triton.compiler
import triton.compiler.compiler

START = time.perf_counter()


def _since_start() -> float:
    return time.perf_counter() - START


def _logged(compile_fn):
    def compile_and_log(src, *args, **kwargs):
        t = time.perf_counter()
        kernel = compile_fn(src, *args, **kwargs)
        name = getattr(src, "name", None) or getattr(getattr(src, "fn", None), "__name__", src)
        print(f"[host_stalls] compiled {name} in {1e3 * (time.perf_counter() - t):.0f} ms "
              f"at {_since_start():.2f} s", flush=True)
        return kernel
    return compile_and_log


_gc_start = {}
# The current generate call's engine steps so far (None outside one), and the host's wait for
# step results inside the current step.
_steps = {"n": None, "wait": 0.0}


def _log_gc(phase: str, info: dict) -> None:
    if info["generation"] == 0:
        return
    if phase == "start":
        _gc_start["t"] = time.perf_counter()
    else:
        ms = 1e3 * (time.perf_counter() - _gc_start["t"])
        print(f"[host_stalls] gc generation {info['generation']}: {ms:.1f} ms at {_since_start():.2f} s, "
              f"step {_steps['n']}", flush=True)


def _log_slow_steps(step, result, slow_ms: float, profile_step: int | None):
    """Wraps LLMEngine.step and StepHandle.result: a step whose host work took over slow_ms is
    logged, and step profile_step runs under cProfile."""
    def timed_result(self):
        t = time.perf_counter()
        try:
            return result(self)
        finally:
            _steps["wait"] += time.perf_counter() - t

    def timed_step(self):
        profiler = cProfile.Profile() if _steps["n"] is not None and _steps["n"] == profile_step else None
        _steps["wait"], t = 0.0, time.perf_counter()
        try:
            if profiler is None:
                return step(self)
            return profiler.runcall(step, self)
        finally:
            if profiler is not None:
                print(f"[host_stalls] step {profile_step} under cProfile:", flush=True)
                stats = pstats.Stats(profiler, stream=sys.stdout)
                stats.sort_stats("cumulative").print_stats(30)
                stats.sort_stats("tottime").print_stats(15)
            work = 1e3 * (time.perf_counter() - t - _steps["wait"])
            if _steps["n"] is not None:
                if work > slow_ms:
                    print(f"[host_stalls] step {_steps['n']}: host work {work:.1f} ms (waited "
                          f"{1e3 * _steps['wait']:.1f} ms for results) at {_since_start():.2f} s", flush=True)
                _steps["n"] += 1
    return timed_step, timed_result


def _log_generate(generate):
    def generate_and_log(self, prompts, *args, **kwargs):
        print(f"[host_stalls] generate of {len(prompts)} prompts starts at {_since_start():.2f} s", flush=True)
        _steps["n"] = 0
        try:
            return generate(self, prompts, *args, **kwargs)
        finally:
            _steps["n"] = None
            print(f"[host_stalls] generate ends at {_since_start():.2f} s", flush=True)
    return generate_and_log


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(add_help=False)        # the rest of the options are bench.py's
    ap.add_argument("--slow-step-ms", type=float, default=1.5)
    ap.add_argument("--profile-step", type=int)
    opts, argv = ap.parse_known_args(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__)                              # its own options; bench.py's help follows
    # Before bench imports the engine: its kernels take the compile function when they are built.
    triton.compiler.compile = triton.compiler.compiler.compile = _logged(triton.compiler.compiler.compile)
    gc.callbacks.append(_log_gc)
    from mini_engine.engine.engine import LLMEngine
    from mini_engine.llm import LLM
    from mini_engine.runner.batch import StepHandle
    LLM.generate = _log_generate(LLM.generate)      # places each stall against the timed run
    LLMEngine.step, StepHandle.result = _log_slow_steps(LLMEngine.step, StepHandle.result, opts.slow_step_ms,
                                                        opts.profile_step)
    import bench
    print(f"[host_stalls] bench starts at {_since_start():.2f} s", flush=True)
    return bench.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
