"""The block manager's slowest single free() in a pool the size of the H200's at entry 36 (~70,000
blocks of 16 tokens; since entry 42 the same memory holds ~17,500 of 64), sequences of 2,000
tokens admitted and freed in turn (256 live), as the benchmark does. A free list that rebuilds
a table when it fills (the OrderedDict before entry 36) shows one free() of milliseconds among
thousands of ~0.05 ms; that pause stalled the benchmark's step loop at step 925. CPU only.

    python benchmarks/block_pool_stalls.py [TREE]      # TREE: another checkout's root (default: this one)
"""
import os
import random
import sys
import time


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and (argv[0].startswith("-") or not os.path.isdir(os.path.join(argv[0], "mini_engine"))):
        print(__doc__)
        return 0 if argv[0] in ("-h", "--help") else 2
    tree = os.path.abspath(argv[0]) if argv else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, tree)
    from mini_engine.engine.block_manager import BlockManager
    from mini_engine.engine.sequence import Sequence
    from mini_engine.sampling_params import SamplingParams

    bm = BlockManager(70_000, 16)
    rng = random.Random(0)
    live, frees, allocs = [], [], []
    for i in range(400):
        seq = Sequence(f"r{i}", [rng.randrange(150_000) for _ in range(2_000)], SamplingParams(max_tokens=4))
        start = time.perf_counter()
        assert bm.allocate_slots(seq, seq.num_tokens)
        allocs.append(time.perf_counter() - start)
        live.append(seq)
        if len(live) > 256:
            victim = live.pop(rng.randrange(len(live)))
            start = time.perf_counter()
            bm.free(victim)
            frees.append(time.perf_counter() - start)
    print(f"{tree}: free() of 125 blocks: slowest {max(frees) * 1e3:.2f} ms, mean {sum(frees) / len(frees) * 1e3:.3f} "
          f"ms over {len(frees)}; allocate_slots() of 125 blocks with their hashes: mean "
          f"{sum(allocs) / len(allocs) * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
