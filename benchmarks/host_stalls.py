"""bench.py with the host's stalls logged: every Triton compilation and every garbage-collector
pass over the older generations, each with its duration and the time since this script started.
A step that takes ~100 ms where its neighbours take 5 (bench.py --profile) is one of these, or
something else on the host; this tells which.

    PYTHONPATH=. python benchmarks/host_stalls.py [bench.py options]
"""
import gc
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


def _log_gc(phase: str, info: dict) -> None:
    if info["generation"] == 0:
        return
    if phase == "start":
        _gc_start["t"] = time.perf_counter()
    else:
        print(f"[host_stalls] gc generation {info['generation']}: {1e3 * (time.perf_counter() - _gc_start['t']):.1f} ms "
              f"at {_since_start():.2f} s", flush=True)


def _log_generate(generate):
    def generate_and_log(self, prompts, *args, **kwargs):
        print(f"[host_stalls] generate of {len(prompts)} prompts starts at {_since_start():.2f} s", flush=True)
        try:
            return generate(self, prompts, *args, **kwargs)
        finally:
            print(f"[host_stalls] generate ends at {_since_start():.2f} s", flush=True)
    return generate_and_log


def main(argv=None) -> int:
    # Before bench imports the engine: its kernels take the compile function when they are built.
    triton.compiler.compile = triton.compiler.compiler.compile = _logged(triton.compiler.compiler.compile)
    gc.callbacks.append(_log_gc)
    from mini_engine.llm import LLM
    LLM.generate = _log_generate(LLM.generate)      # places each stall against the timed run
    import bench
    print(f"[host_stalls] bench starts at {_since_start():.2f} s", flush=True)
    return bench.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
