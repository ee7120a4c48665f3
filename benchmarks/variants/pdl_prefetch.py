# PYTHONPATH=. python ab_s42/pdl_prefetch.py   (H200)
"""pdl_chain.py's harness: the decode step's graph with the engine's projections against every
projection (up to 32 rows) on the weight-prefetching kernel, PDL on in both."""
import os, random, sys, unittest.mock
sys.path.insert(0, "ab_s42")
import torch
from prefetch_linear import prefetch_linear, _prefetch_linear_kernel
import mini_engine.layers.linear as linear_layer
from mini_engine import LLM
from mini_engine.kernels import triton_utils
from mini_engine.model.random_checkpoint import default_checkpoint
from mini_engine.sampling_params import SamplingParams
from benchmarks.decode_step_profile import per_call_ms, synthetic_decode_rows
from benchmarks.pdl_chain import print_registers

BATCHES = [int(b) for b in sys.argv[1:]] or [1, 4, 8, 16, 32]
os.environ["MINI_ENGINE_PDL"] = "1"
triton_utils.use_pdl.cache_clear()
llm = LLM(default_checkpoint(device="cuda"), max_model_len=2048, max_num_seqs=max(BATCHES), enforce_eager=True,
          gpu_memory_utilization=0.5)
runner, model = llm.engine.runner, llm.engine.runner.model
orig_forward = linear_layer.Linear.forward


def patched(which, **cfg):
    def forward(self, x, residual=None):
        narrow = self.out_features <= 1024
        if self.bias is None and x.shape[0] <= 32 and (which == "all" or narrow):
            return prefetch_linear(x, self.weight, residual, **cfg)
        return orig_forward(self, x, residual)
    return unittest.mock.patch.object(linear_layer.Linear, "forward", forward)


variants = {
    "engine (cublas+skinny, pdl)": lambda: unittest.mock.patch.object(linear_layer.Linear, "forward", orig_forward),
    "prefetch all bn16 k1024 w4": lambda: patched("all", block_n=16, max_block_k=1024, num_warps=4),
    "prefetch all bn16 k2048 w8": lambda: patched("all", block_n=16, max_block_k=2048, num_warps=8),
    "prefetch all bn32 k1024 w8": lambda: patched("all", block_n=32, max_block_k=1024, num_warps=8),
    "prefetch o/down only bn16 k1024 w4": lambda: patched("narrow", block_n=16, max_block_k=1024, num_warps=4),
}
rng = random.Random(0)
params = SamplingParams(temperature=0.6, max_tokens=1)
summary = {}
for batch in BATCHES:
    rows = synthetic_decode_rows(batch, 1000, runner.block_size, rng, params)
    logits = torch.empty(batch, model.config.vocab_size, dtype=torch.bfloat16, device="cuda")
    reference, graphs = None, {}
    for name, ctx in variants.items():
        try:
            with torch.inference_mode(), ctx():
                t, meta = runner.prepare_inputs(rows, graph_size=batch)
                model.compute_logits(model(t.input_ids, t.positions, meta), out=logits)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    model.compute_logits(model(t.input_ids, t.positions, meta), out=logits)
            graph.replay(); torch.cuda.synchronize()
        except Exception as exc:
            print(f"batch {batch} {name}: failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True); continue
        result = logits.float().clone()
        reference = result if reference is None else reference
        graphs[name] = (graph, (result - reference).abs().max().item(),
                        (result.argmax(-1) == reference.argmax(-1)).float().mean().item())
    times = {name: [] for name in graphs}
    for _ in range(4):
        for name, (graph, _, _) in graphs.items():
            times[name].append(per_call_ms(graph.replay, 40, warmup=5))
    base = min(times["engine (cublas+skinny, pdl)"])
    print(f"\n=== decode batch {batch}")
    for name, (graph, err, agree) in graphs.items():
        best = min(times[name])
        print(f"  {name:<38} {best:7.3f} ms ({best - base:+.3f})  rounds " + " ".join(f"{t:.3f}" for t in times[name])
              + f"  max|dlogit| {err:.3f} argmax agree {agree:.3f}", flush=True)
        summary.setdefault(name, {})[batch] = best
    del graphs
    torch.cuda.empty_cache()
print_registers(_prefetch_linear_kernel, ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K"))
print("\nsummary (ms per step):")
for name, row in summary.items():
    print(f"  {name:<38} " + " ".join(f"{b}:{t:.3f}" for b, t in row.items()))
