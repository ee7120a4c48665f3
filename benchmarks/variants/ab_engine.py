# Run from the repo root with PYTHONPATH=. on the H200.
"""bench.py with the engine's decode attention swapped for a variant: `ab_engine.py CONFIG_JSON
bench-args...`, CONFIG_JSON like {"tile_n": 64, "num_stages": 3} (empty: the engine's own kernel)."""
import functools, json, sys
sys.path.insert(0, ".")
import bench
from benchmarks.variants import swapped_pa
from mini_engine.kernels import paged_attention

config = json.loads(sys.argv[1])
if config:
    paged_attention.paged_decode_attention = functools.partial(swapped_pa.paged_decode_attention, **config)
sys.exit(bench.main(sys.argv[2:]))
