# Run from the repo root with PYTHONPATH=. on the H200: the decode kernel's registers and shared
# memory at every split count the engine's captured batch sizes use.
import sys
import torch
sys.path.insert(0, ".")
from benchmarks.decode_sweep import make_kv_cache, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, MAX_MODEL_LEN, DTYPE
from mini_engine.kernels import paged_attention as pa
from mini_engine.runner.cuda_graph import graph_batch_sizes
gen = torch.Generator(device="cuda").manual_seed(0)
k, v = make_kv_cache(4096, 16, "token", gen)
for b in graph_batch_sizes(256):
    q = torch.randn(b, NUM_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    tables = torch.randint(0, 4096, (b, MAX_MODEL_LEN // 16), device="cuda", dtype=torch.int32)
    lens = torch.full((b,), 1000, device="cuda", dtype=torch.int32)
    pa.paged_attention(q, k, v, tables, lens, torch.arange(b + 1, device="cuda", dtype=torch.int32),
                       HEAD_DIM ** -0.5, 1, MAX_MODEL_LEN)
for dc in pa._paged_decode_kernel.device_caches.values():
    for key, ck in dc[0].items():
        splits = [c for c in str(key).split("NUM_SPLITS")[:1]]
        print(f"decode kernel: {ck.n_regs} regs {ck.n_spills} spills {ck.metadata.shared} B smem | {str(key)[-160:]}")
