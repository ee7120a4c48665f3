"""Tiles for kernels/fp8_linear.py on the GPU: each candidate of fp8_gemm_config (the quantize launch
included) against the bf16 product the engine runs today (cuBLAS, or the skinny kernel at few rows),
for Qwen3-0.6B's four projections at 1 to 2048 rows, timed as CUDA-graph replays (the weights stay
in L2 across a graph's calls, as they do not in a model's step: the launches and the arithmetic are
what this compares). One JSON line a shape and row count, microseconds a call: bf16, the quantize
launch alone, what fp8_linear chose (cuBLAS from CUBLAS_MIN_FLOP, or a Triton config), and each
Triton candidate (label m<rows>n<columns>w<warps>s<stages>k<splits>)."""
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
    candidates = {f"m{m}n{n}w{w}s{stages}k{split}": f.Fp8GemmConfig(m, n, w, stages, split)
                  for m, n, w, stages in ((16, 32, 4, 4), (16, 64, 4, 4), (64, 64, 4, 3), (64, 128, 4, 3),
                                          (128, 128, 8, 3)) for split in (1, 2, 4)}
    chosen, min_flop = f.fp8_gemm_config, f.CUBLAS_MIN_FLOP
    torch.manual_seed(0)
    for name, (n, k) in shapes.items():
        linear = Linear(k, n, False, use_triton=True).cuda().bfloat16()
        weight, scales = f.quantize_fp8_weight_ref(linear.weight.detach())
        for rows in (1, 8, 32, 64, 128, 256, 512, 2048):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            cublas = f.takes_cublas(rows, n, k, x.dtype, False, x.device)
            line = {"shape": name, "rows": rows, "bf16_us": round(replay_us(lambda: linear(x)), 2),
                    "quantize_us": round(replay_us(lambda: f.quantize_fp8(x)), 2),
                    "chosen": "cublas" if cublas else chosen(rows, n, k, f.num_sms(x.device)).__dict__,
                    "fp8_chosen_us": round(replay_us(lambda: f.fp8_linear(x, weight, scales)), 2)}
            for label, config in candidates.items():
                tiles = -(-rows // config.block_m) * -(-n // config.block_n)
                if config.block_m > 2 * max(rows, 16) or (config.split_k > 1 and tiles * config.split_k > 4 * 132):
                    continue
                f.fp8_gemm_config = lambda *_, config=config, **__: config
                f.CUBLAS_MIN_FLOP = float("inf")           # the candidates are the Triton kernel's
                try:
                    line[label] = round(replay_us(lambda: f.fp8_linear(x, weight, scales)), 2)
                finally:
                    f.fp8_gemm_config, f.CUBLAS_MIN_FLOP = chosen, min_flop
            print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
