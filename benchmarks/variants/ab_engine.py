# Run from the repo root with PYTHONPATH=. on the H200.
"""bench.py with the engine's decode attention swapped for a variant: `ab_engine.py MODULE CONFIG_JSON
bench-args...`, MODULE one of benchmarks/variants' modules ("" for the engine's own kernel),
CONFIG_JSON its keyword arguments, like {"tile_n": 64}."""
import functools, importlib, json, sys
sys.path.insert(0, ".")
import bench
from mini_engine.kernels import paged_attention

if sys.argv[1]:
    variant = importlib.import_module(f"benchmarks.variants.{sys.argv[1]}")
    paged_attention.paged_decode_attention = functools.partial(variant.paged_decode_attention,
                                                               **json.loads(sys.argv[2]))
sys.exit(bench.main(sys.argv[3:]))
