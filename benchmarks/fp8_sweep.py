"""Tiles for kernels/fp8_linear.py on the GPU: each candidate of fp8_gemm_config (the quantize launch
included) against the bf16 product the engine runs today (cuBLAS, or the skinny kernel at few rows),
for Qwen3-0.6B's four projections at 1 to 2048 rows, timed as CUDA-graph replays. One JSON line a
shape and row count."""
import json
import sys

import torch


def replay_us(fn, iters: int = 50) -> float:
    """Microseconds a call, from a graph of `iters` calls (launch costs as the decode graphs pay them)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def main() -> int:
    if not torch.cuda.is_available():
        sys.exit("fp8_sweep.py needs CUDA")
    from mini_engine.kernels import fp8_linear as f
    from mini_engine.layers.linear import Linear
    shapes = {"qkv": (4096, 1024), "o_proj": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
    candidates = {"m16n16": f.Fp8GemmConfig(16, 16, num_stages=4), "m16n32": f.Fp8GemmConfig(16, 32, num_stages=4),
                  "m16n64": f.Fp8GemmConfig(16, 64, num_stages=4), "m32n64": f.Fp8GemmConfig(32, 64),
                  "m64n64": f.Fp8GemmConfig(64, 64), "m64n128": f.Fp8GemmConfig(64, 128),
                  "m128n128w8": f.Fp8GemmConfig(128, 128, 8), "m128n128w4s4": f.Fp8GemmConfig(128, 128, 4, 4),
                  "m128n256w8": f.Fp8GemmConfig(128, 256, 8)}
    chosen = f.fp8_gemm_config
    torch.manual_seed(0)
    for name, (n, k) in shapes.items():
        linear = Linear(k, n, False, use_triton=True).cuda().bfloat16()
        weight, scales = f.quantize_fp8_weight_ref(linear.weight.detach())
        for rows in (1, 8, 16, 32, 64, 256, 2048):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            line = {"shape": name, "rows": rows, "bf16_us": round(replay_us(lambda: linear(x)), 2),
                    "fp8_chosen_us": round(replay_us(lambda: f.fp8_linear(x, weight, scales)), 2)}
            for label, config in candidates.items():
                if config.block_m > 2 * max(rows, 16):
                    continue
                f.fp8_gemm_config = lambda _, config=config: config
                try:
                    line[f"fp8_{label}_us"] = round(replay_us(lambda: f.fp8_linear(x, weight, scales)), 2)
                finally:
                    f.fp8_gemm_config = chosen
            print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
