"""The host's time from LLM.generate() to the first step's inputs staged: while it runs the
device has nothing to do. The benchmark's 256 prompts (other random tokens each call, so the
prefix cache never hits) on the tiny model; the run stops at the first step's staging, so only the
host's work is timed and this runs anywhere, a CPU included.

    PYTHONPATH=. python benchmarks/first_step_host.py [--calls 12]
"""
import argparse
import random
import time

from bench import make_workload, tiny_checkpoint


class FirstStepStaged(Exception):
    pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=12)
    args = ap.parse_args()
    from mini_engine import LLM, SamplingParams
    prompts, max_tokens = make_workload()
    llm = LLM(tiny_checkpoint(None), max_model_len=2048, max_num_seqs=256, num_kv_blocks=70000)
    runner = llm.engine.runner
    prepare, staged = runner.prepare_inputs, []

    def prepare_then_stop(rows, *args):
        prepare(rows, *args)
        staged.append(time.perf_counter())
        raise FirstStepStaged
    runner.prepare_inputs = prepare_then_stop
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in max_tokens]
    times = []
    for call in range(args.calls):
        rng = random.Random(call)
        fresh = [[rng.randint(0, 10000) for _ in p] for p in prompts]
        start = time.perf_counter()
        try:
            llm.generate(fresh, params, use_tqdm=False)
        except FirstStepStaged:
            times.append(1e3 * (staged[-1] - start))
    times.sort()
    print(f"generate() to the first step staged, {args.calls} calls: median {times[len(times) // 2]:.2f} ms, "
          f"min {times[0]:.2f} ms, max {times[-1]:.2f} ms")


if __name__ == "__main__":
    main()
