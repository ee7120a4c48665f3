"""The grouped-GEMM experts (kernels/fused_moe.py) by tile configuration, at Qwen3-30B-A3B's shape
(128 experts of 2048 -> 2 x 768 -> 2048, 8 a token), on the GPU: microseconds a layer for each
batch size, against the experts' bytes at copy bandwidth for decode and against bf16 FLOPs for
prefill. A graph replays the layer over four weight copies in turn, so that (at 1.2 GB each) every
call reads its experts from HBM, not L2. Routing is uniform at random, as a random checkpoint's.

--fp8: the fp8 experts (kernels/fp8_fused_moe.py: Qwen3-30B-A3B-FP8's 128 x 128 blocks, their
activations quantized as they arrive) over the same shapes, their tiles' K fixed at one 128-column
group, and the floor their fp8 bytes (not yet run on a GPU)."""
import argparse
import itertools

import torch

from mini_engine.kernels.fp8_fused_moe import fp8_fused_moe, fp8_moe_config
from mini_engine.kernels.fp8_linear import quantize_fp8_weight_ref
from mini_engine.kernels.fused_moe import MoeConfig, fused_moe, moe_config

E, H, I, K = 128, 2048, 768, 8


def bf16_layer(hidden, weights, topk, ids, config, residual):
    w13, w2 = weights
    return fused_moe(hidden, w13, w2, topk, ids, config, residual=residual)


def fp8_layer(hidden, weights, topk, ids, config, residual):
    w13, w2, w13_scale, w2_scale = weights
    return fp8_fused_moe(hidden, w13, w2, topk, ids, w13_scale, w2_scale, residual=residual, config=config)


# the experts' call, given a copy of the weights; its default tiles; a weight's bytes
LAYERS = {False: (bf16_layer, moe_config, 2), True: (fp8_layer, fp8_moe_config, 1)}
FP8 = False         # main() sets it from --fp8


def time_layer(tokens: int, config: MoeConfig | None, weights, reps: int = 10) -> float:
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    hidden = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    ids = torch.rand(tokens, E, device="cuda", generator=gen).argsort(dim=1)[:, :K].int()
    topk = torch.full((tokens, K), 1.0 / K, device="cuda", dtype=torch.bfloat16)
    residual = torch.zeros_like(hidden)
    layer = LAYERS[FP8][0]
    run = lambda: [layer(hidden, w, topk, ids, config, residual) for w in weights]
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps / len(weights)


def timed(tokens: int, configs: list[MoeConfig], weights, reps: int = 10) -> list[tuple[float, MoeConfig]]:
    """(us a layer, config), fastest first; a configuration the GPU cannot hold (shared memory) is left out."""
    results = []
    for cfg in configs:
        try:
            results.append((time_layer(tokens, cfg, weights, reps), cfg))
        except Exception as e:          # triton's OutOfResources, raised at compile
            print(f"    skipped {cfg}: {type(e).__name__}")
    return sorted(results, key=lambda r: r[0])


def main():
    global FP8
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--prefill-tokens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--bandwidth", type=float, default=4.27e12, help="copy bandwidth, bytes/s")
    ap.add_argument("--fp8", action="store_true", help="the fp8 experts (kernels/fp8_fused_moe.py)")
    args = ap.parse_args()
    FP8 = args.fp8
    _, moe_config, weight_bytes = LAYERS[FP8]
    weights = [(torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02,
                torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.02) for _ in range(4)]
    if FP8:             # each copy as (w13, w2, w13_scale, w2_scale), in 128 x 128 blocks
        quantized = []
        for w13, w2 in weights:
            (q13, s13), (q2, s2) = quantize_fp8_weight_ref(w13), quantize_fp8_weight_ref(w2)
            quantized.append((q13, q2, s13, s2))
        weights = quantized
    expert_bytes = 3 * I * H * weight_bytes
    k_steps = (128,) if FP8 else (64, 128, 256)      # fp8: one 128-column group a step
    decode = [MoeConfig(16, n, k, w, s) for n, k, w, s in itertools.product((32, 64, 128), k_steps, (4,), (3, 4))]
    decode += [MoeConfig(16, 64, 128, 8, 3), MoeConfig(16, 128, 128, 8, 4), MoeConfig(32, 64, 128, 4, 3)]
    for tokens in args.tokens:
        touched = E * (1 - (1 - K / E) ** tokens)
        floor_us = touched * expert_bytes / args.bandwidth * 1e6
        results = timed(tokens, decode, weights)
        default = time_layer(tokens, None, weights)
        print(f"tokens {tokens:5d}: experts' bytes at copy bandwidth {floor_us:7.1f} us; default "
              f"{moe_config(tokens * K, E)} {default:7.1f} us; best:")
        for us, cfg in results[:4]:
            print(f"    {us:7.1f} us  {cfg}")
    prefill_k = (128,) if FP8 else (64,)
    prefill = [MoeConfig(m, n, k, w, s) for m, n, k, w, s in itertools.product((64, 128), (128, 256), prefill_k, (4, 8),
                                                                               (3, 4))]
    for tokens in args.prefill_tokens:
        flop = tokens * K * 3 * I * H * 2
        results = timed(tokens, prefill, weights, reps=3)
        default = time_layer(tokens, None, weights, reps=3)
        print(f"tokens {tokens:5d}: {flop / 1e12:.2f} TFLOP; default {moe_config(tokens * K, E)} {default:7.1f} us "
              f"({flop / default / 1e6:.0f} TFLOP/s); best:")
        for us, cfg in results[:4]:
            print(f"    {us:7.1f} us ({flop / us / 1e6:.0f} TFLOP/s)  {cfg}")


if __name__ == "__main__":
    main()
