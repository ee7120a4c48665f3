"""How much of the host's time per step reaches the wall: bench.py with a busy wait added to the
host side of every ModelRunner.launch (before it enqueues anything), nothing else changed. If the
wall grows by about delay x steps, the host is on the run's critical path; if it barely moves, the
host is far enough ahead that shaving its per-step work cannot pay.

    PYTHONPATH=. python benchmarks/host_delay.py --delay-us 200 -- --label "host +200 us a launch"
"""
import argparse
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--delay-us", type=float, required=True)
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: bench.py's own arguments")
    args = ap.parse_args()
    import bench
    from mini_engine.runner.model_runner import ModelRunner

    launch, delay_s = ModelRunner.launch, args.delay_us / 1e6

    def delayed_launch(self, rows):
        end = time.perf_counter() + delay_s
        while time.perf_counter() < end:      # busy, as host work is: a sleep would yield the GIL
            pass
        return launch(self, rows)

    ModelRunner.launch = delayed_launch
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    return bench.main(bench_args)


if __name__ == "__main__":
    sys.exit(main())
