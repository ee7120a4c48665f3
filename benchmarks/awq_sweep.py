"""Tiles for kernels/awq_linear.py on the GPU: the fused 4-bit product's candidate tiles, the
dequantize launch with cuBLAS, and the bf16 product the engine runs without AWQ (cuBLAS, or the
skinny kernel at few rows), for Qwen3-0.6B's and Qwen3-8B's four projections at 1 to 512 rows.
Timed as CUDA-graph replays that cycle through enough copies of the weights (>= 256 MB) that each
call reads its weights from HBM, as a model's step does. One JSON line a shape and row count,
microseconds a call: bf16, what awq_linear chose, dequantize + cuBLAS, and each fused candidate
(label m<rows>n<columns>k<depth>w<warps>s<stages>).

With --gemv, the FMA product (_awq_gemv_kernel) at 1 to 4 rows instead (gemv_sweep)."""
import json
import sys

import torch

from benchmarks.fp8_sweep import replay_us

SHAPES = {"0.6B qkv": (4096, 1024), "0.6B o_proj": (1024, 2048), "0.6B gate_up": (6144, 1024),
          "0.6B down": (1024, 3072), "8B qkv": (6144, 4096), "8B o_proj": (4096, 4096),
          "8B gate_up": (24576, 4096), "8B down": (4096, 12288)}
WORKING_SET = 256 << 20


def cycling(fn, copies: list):
    """fn over the copies in turn, one a call."""
    state = {"i": 0}

    def call():
        fn(copies[state["i"] % len(copies)])
        state["i"] += 1
    return call


def projections():
    """(name, N, K, the bf16 Linear, AWQ copies, bf16 copies of its weight) for each of SHAPES."""
    from mini_engine.kernels.awq_linear import quantize_awq_ref
    from mini_engine.layers.linear import Linear
    torch.manual_seed(0)
    for name, (n, k) in SHAPES.items():
        linear = Linear(k, n, False, use_triton=True).cuda().bfloat16()
        weights = quantize_awq_ref(linear.weight.detach().float().cpu(), 128)
        yield (name, n, k, linear, [tuple(t.cuda() for t in weights) for _ in range(max(1, WORKING_SET // (n * k // 2)))],
               [linear.weight.detach().clone() for _ in range(max(1, WORKING_SET // (n * k * 2)))])


def gemv_sweep() -> int:
    """At 1-4 rows: bf16, what awq_linear chose, the tensor-core product at awq_tile's tile and
    the FMA product at a few tiles (a grid of 18 tiles and 4 splits at 1-16 rows:
    profiles/session61_call2_gemv_sweep.log)."""
    from mini_engine.kernels import awq_linear as a
    chosen_tile, gemv_rows = a.awq_gemv_tile, a.GEMV_ROWS
    tiles = [a.AwqGemvTile(w, k, 4, 8) for w, k in ((16, 128), (8, 128), (16, 64), (32, 64))]
    for name, n, k, linear, awq_copies, bf16_copies in projections():
        for rows in (1, 2, 4):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            product = cycling(lambda w: a.awq_linear(x, *w), awq_copies)
            line = {"shape": name, "rows": rows,
                    "bf16_us": round(replay_us(cycling(lambda w: linear.dense_product(x, w), bf16_copies)), 2),
                    "chosen": chosen_tile(n, k, 128).__dict__ if rows <= gemv_rows else "tensor cores",
                    "awq_chosen_us": round(replay_us(product), 2)}
            try:
                a.GEMV_ROWS = 0
                line["tensor_cores_us"] = round(replay_us(product), 2)
                a.GEMV_ROWS = 8
                for tile in tiles:
                    if k % (tile.split_k * tile.block_k) == 0:
                        a.awq_gemv_tile = lambda *_, tile=tile: tile
                        line[f"gemv_w{tile.block_w}k{tile.block_k}"] = round(replay_us(product), 2)
            finally:
                a.awq_gemv_tile, a.GEMV_ROWS = chosen_tile, gemv_rows
            print(json.dumps(line), flush=True)
    return 0


def main() -> int:
    if not torch.cuda.is_available():
        sys.exit("awq_sweep.py needs CUDA")
    if "--gemv" in sys.argv[1:]:
        return gemv_sweep()
    from mini_engine.kernels import awq_linear as a
    candidates = {f"m{m}n{n}k{k}w{w}s{s}x{split}": a.AwqTile(m, n, k, w, s, split)
                  for m, n, k, w, s, splits in ((16, 32, 128, 4, 3, (1, 2, 4, 8)), (16, 64, 128, 4, 3, (1, 2, 4)),
                                                (16, 128, 128, 4, 3, (1, 2)), (16, 64, 64, 4, 4, (1, 2)),
                                                (32, 64, 128, 4, 3, (1, 2)), (64, 64, 64, 4, 3, (1, 2)),
                                                (64, 128, 64, 8, 3, (1,)), (128, 128, 64, 8, 3, (1,)))
                  for split in splits}
    chosen_tile, threshold, gemv_rows = a.awq_tile, a.DEQUANTIZE_ROWS, a.GEMV_ROWS
    for name, n, k, linear, awq_copies, bf16_copies in projections():
        for rows in (1, 8, 16, 32, 64, 128, 256, 512):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            line = {"shape": name, "rows": rows,
                    "bf16_us": round(replay_us(cycling(lambda w: linear.dense_product(x, w), bf16_copies)), 2),
                    "chosen": "dequantize" if rows >= threshold else chosen_tile(rows, n, k, 128, 132).__dict__,
                    "awq_chosen_us": round(replay_us(cycling(lambda w: a.awq_linear(x, *w), awq_copies)), 2)}
            try:
                a.GEMV_ROWS = 0
                a.DEQUANTIZE_ROWS = 0
                line["dequantize_cublas_us"] = round(replay_us(cycling(lambda w: a.awq_linear(x, *w), awq_copies)), 2)
                a.DEQUANTIZE_ROWS = 1 << 30
                for label, tile in candidates.items():
                    if (tile.block_m > 2 * max(rows, 16) or (rows >= 128 and tile.block_m < 32)
                            or k % (tile.split_k * tile.block_k)):
                        continue
                    a.awq_tile = lambda *_, tile=tile: tile
                    line[label] = round(replay_us(cycling(lambda w: a.awq_linear(x, *w), awq_copies)), 2)
            finally:
                a.awq_tile, a.DEQUANTIZE_ROWS, a.GEMV_ROWS = chosen_tile, threshold, gemv_rows
            print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
