"""A decode step's forward as one CUDA graph, with and without programmatic dependent launch (PDL,
kernels/triton_utils.py), and (--all-triton) with every projection on the Triton kernel of
kernels/linear.py instead of cuBLAS. Times each variant's graph replay at a few batch sizes
(contexts ~U(ctx/2, 3ctx/2)), in interleaved rounds, and checks its logits against the first
variant's. --without rope swiglu adds variants with that kernel left out (its layer hands its
input on unchanged, so their logits are wrong): timing only, the most that fusing it away could
win. Needs CUDA.

    PYTHONPATH=. python benchmarks/pdl_chain.py --batch 1 8 32 64 128 256
"""
import argparse
import contextlib
import itertools
import os
import random
import sys
import unittest.mock

import torch


def triton_table(tile: tuple):
    """skinny_config's stand-in: every projection on the Triton kernel, the whole batch in one
    tile up to 64 rows, `tile` = (block_m, block_n, block_k, warps, stages) above."""
    from mini_engine.kernels.linear import SkinnyConfig

    def config(num_rows: int, out_features: int, in_features: int):
        if num_rows <= 64:
            split = (4 if num_rows <= 32 else 2) if in_features >= 3072 else (2 if in_features >= 2048 else 1)
            return SkinnyConfig(block_n=16, block_k=256, split_k=split)
        bm, bn, bk, warps, stages = tile
        return SkinnyConfig(block_m=bm, block_n=bn, block_k=bk, split_k=2 if out_features <= 1024 else 1,
                            num_warps=warps, num_stages=stages)
    return config


def _without_rope():
    """QK-norm/rotary/KV write left out: attention reads the projection's raw q heads."""
    from mini_engine.layers.rotary_embedding import QKNormRopeKVWrite

    def forward(self, qkv, *args, **kwargs):
        return qkv[:, :self.num_heads * self.head_dim].view(-1, self.num_heads, self.head_dim)
    return unittest.mock.patch.object(QKNormRopeKVWrite, "forward", forward)


def _without_swiglu():
    """SwiGLU left out: down_proj reads the gate half of the gate/up product."""
    from mini_engine.layers.activation import SiluAndMul
    return unittest.mock.patch.object(SiluAndMul, "forward", lambda self, gate_up, norm_input=None:
                                      gate_up[:, :gate_up.shape[1] // 2])


SKIPPED = {None: contextlib.nullcontext, "rope": _without_rope, "swiglu": _without_swiglu}


def print_registers(kernel, show=()) -> None:
    """Registers, spills and shared memory of each compiled variant of a Triton kernel: what sets
    how many of its programs share an SM (benchmarks/NOTES.md, entry 20). show: constexpr names
    whose values label each variant."""
    print(f"\ncompiled variants of {kernel.fn.__name__}:")
    for cache in getattr(kernel, "device_caches", {}).values():
        for compiled in (cache[0] if isinstance(cache, tuple) else cache).values():
            constants = getattr(getattr(compiled, "src", None), "constants", {}) or {}
            named = {kernel.arg_names[k[0] if isinstance(k, tuple) else k]: v for k, v in constants.items()}
            label = " ".join(f"{name}={named[name]}" for name in show if name in named)
            print(f"  regs {compiled.n_regs} spills {compiled.n_spills} shared {compiled.metadata.shared} {label}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--ctx", type=int, default=1000)
    ap.add_argument("--replays", type=int, default=40)
    ap.add_argument("--all-triton", action="store_true", help="also every projection on the Triton kernel")
    ap.add_argument("--without", nargs="*", default=[], choices=[kind for kind in SKIPPED if kind],
                    help="also the PDL variant without this kernel (timing only: wrong logits)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("pdl_chain.py needs CUDA")
    import mini_engine.layers.linear as linear_layer
    from mini_engine import LLM
    from mini_engine.kernels import paged_attention, triton_utils
    from mini_engine.model.random_checkpoint import default_checkpoint
    from benchmarks.decode_step_profile import per_call_ms, synthetic_decode_rows
    from mini_engine.sampling_params import SamplingParams

    llm = LLM(default_checkpoint(device="cuda"), max_model_len=2048, max_num_seqs=max(args.batch),
              enforce_eager=True, gpu_memory_utilization=0.5)
    runner, model = llm.engine.runner, llm.engine.runner.model
    original_config = linear_layer.skinny_config
    tiles = [(64, 64, 64, 4, 4), (64, 32, 128, 4, 4), (128, 64, 64, 8, 3)]
    # name: (PDL, projection configs, kernel left out)
    variants = {"cublas": (False, original_config, None), "cublas+pdl": (True, original_config, None)}
    for kind in args.without:
        variants[f"cublas+pdl without {kind} (timing only)"] = (True, original_config, kind)
    if args.all_triton:
        for tile, pdl in itertools.product(tiles, (False, True)):
            variants[f"triton{tile}" + ("+pdl" if pdl else "")] = (pdl, triton_table(tile), None)

    rng = random.Random(0)
    params = SamplingParams(temperature=0.6, max_tokens=1)
    bs = runner.block_size
    summary = {}
    for batch in args.batch:
        rows = synthetic_decode_rows(batch, args.ctx, bs, rng, params)
        logits = torch.empty(batch, model.config.vocab_size, dtype=torch.bfloat16, device="cuda")
        reference = None
        graphs = {}
        for name, (pdl, config, skipped) in variants.items():
            if batch <= 64 and name.startswith("triton") and not name.startswith(f"triton{tiles[0]}"):
                continue        # the tile only matters above 64 rows
            os.environ["MINI_ENGINE_PDL"] = "1" if pdl else "0"
            triton_utils.use_pdl.cache_clear()
            linear_layer.skinny_config = config
            try:
                with torch.inference_mode(), SKIPPED[skipped]():
                    t, meta = runner.prepare_inputs(rows, graph_size=batch)
                    model.compute_logits(model(t.input_ids, t.positions, meta), out=logits)    # compile outside
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        model.compute_logits(model(t.input_ids, t.positions, meta), out=logits)
                graph.replay()
                torch.cuda.synchronize()
            except Exception as exc:    # a variant that does not compile is reported, not fatal
                print(f"batch {batch} {name}: failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            result = logits.float().clone()
            if reference is None:
                reference = result
            err = (result - reference).abs().max().item()
            agree = (result.argmax(-1) == reference.argmax(-1)).float().mean().item()
            graphs[name] = (graph, err, agree)
        linear_layer.skinny_config = original_config
        times = {name: [] for name in graphs}
        for _ in range(3):                         # interleaved rounds: drift hits every variant alike
            for name, (graph, _, _) in graphs.items():
                times[name].append(per_call_ms(graph.replay, args.replays, warmup=5))
        base = min(times["cublas"])
        print(f"\n=== decode batch {batch}, mean context {sum(r.start_position for r in rows) / batch:.0f}")
        for name, (graph, err, agree) in graphs.items():
            best = min(times[name])
            print(f"  {name:<40} {best:7.3f} ms  ({best - base:+.3f})  rounds "
                  + " ".join(f"{t:.3f}" for t in times[name]) + f"  max|dlogit| {err:.3f}  argmax agree {agree:.3f}",
                  flush=True)
            summary.setdefault(name, {})[batch] = best
        del graphs
        torch.cuda.empty_cache()
    print_registers(paged_attention._paged_decode_kernel, ("NUM_SPLITS", "ROW_BLOCKS"))
    print("\nsummary (ms per step):")
    for name, row in summary.items():
        print(f"  {name:<40} " + " ".join(f"{b}:{t:.3f}" for b, t in row.items()))


if __name__ == "__main__":
    main()
