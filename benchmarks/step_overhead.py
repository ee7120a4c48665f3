"""What the work around a decode step's graph replay costs the device: one decode batch, staged as
the engine stages it, launched back to back N times with the host never waiting, in three forms:

    replay    the captured graph alone (inputs staged once, before the loop): the input tokens
              the previous launch sampled, the forward, lm_head and the sampler
    + copy    prepare_inputs each time (its one host-to-device copy), and the replay
    launch    ModelRunner.launch: all of that, and the tokens' copy to the host

The host queues far ahead of the device (a step's host work is ~1-2 ms against ~5 ms of device
time at 256 rows x 1,000 tokens), so each form's time per step is the device's, and the
differences are what each addition costs it, idle time between operations included.

    PYTHONPATH=. python benchmarks/step_overhead.py --batch 256 64 8 --ctx 1000
"""
import argparse
import random
import sys

import torch


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[256, 64, 8])
    ap.add_argument("--ctx", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("step_overhead.py needs CUDA")
    from benchmarks.decode_step_profile import per_call_ms, synthetic_decode_rows
    from mini_engine import LLM
    from mini_engine.model.random_checkpoint import default_checkpoint
    from mini_engine.sampling_params import SamplingParams

    llm = LLM(default_checkpoint(device="cuda"), max_model_len=2048, max_num_seqs=max(args.batch),
              gpu_memory_utilization=0.5)
    runner = llm.engine.runner
    params = SamplingParams(temperature=0.6, max_tokens=1)
    rng = random.Random(0)
    print(f"{'batch':>5s} {'replay':>9s} {'+ copy':>9s} {'launch':>9s}   (ms a step)")
    for batch in args.batch:
        rows = synthetic_decode_rows(batch, args.ctx, runner.block_size, rng, params)
        for i, row in enumerate(rows):      # as in the run: input tokens from the last launch
            row.prev_token_index = i
        size = runner.graph_runner.graph_size(batch, 1)

        def inputs():
            return runner.prepare_inputs(rows, size)

        def replay():
            return runner.graph_runner.replay(size, runner.turn)

        inputs()
        times = [per_call_ms(replay, args.steps), per_call_ms(lambda: (inputs(), replay()), args.steps),
                 per_call_ms(lambda: runner.launch(rows), args.steps)]
        print(f"{batch:5d} " + " ".join(f"{t:9.4f}" for t in times))


if __name__ == "__main__":
    main()
