"""Does torch's block-scaled fp8 GEMM (cuBLAS: 1x128 activation scales, 128x128 weight scales) run
on this GPU, match fp8_linear_ref, and beat the Triton kernel? Qwen3-0.6B's and Qwen3-8B's shapes at
16 to 8192 rows, and which scale layouts torch accepts. Session 57's run set kernels/fp8_linear.py's
CUBLAS_MIN_FLOP (profiles/session57_scaled_mm_probe.log, where "triton_us" was the Triton kernel
at every size; since then fp8_linear takes cuBLAS itself for large products). One JSON line a shape
and row count, microseconds a call (the quantize launch timed apart from cuBLAS's product)."""
import json
import sys

import torch
import torch.nn.functional as F

SHAPES = {"0.6b qkv": (4096, 1024), "0.6b down": (1024, 3072), "8b qkv": (6144, 4096),
          "8b gate_up": (24576, 4096), "8b down": (4096, 12288)}


def layouts(q, scales, w, w_scales):
    """cuBLAS's product under each way of passing the scales (torch refuses all but column-major)."""
    column_major = scales.t().contiguous().t()
    yield "_scaled_mm, scales column-major", lambda: torch._scaled_mm(
        q, w.t(), scale_a=column_major, scale_b=w_scales.t(), out_dtype=torch.bfloat16)
    yield "_scaled_mm, scales row-major", lambda: torch._scaled_mm(
        q, w.t(), scale_a=scales, scale_b=w_scales.t(), out_dtype=torch.bfloat16)
    if hasattr(F, "ScalingType"):
        yield "F.scaled_mm", lambda: F.scaled_mm(q, w.t(), column_major, F.ScalingType.BlockWise1x128, w_scales.t(),
                                                 F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)


def main() -> int:
    if not torch.cuda.is_available():
        sys.exit("fp8_cublas_probe.py needs CUDA")
    from benchmarks.fp8_sweep import replay_us
    from mini_engine.kernels import fp8_linear as f
    print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
                      "scaling_types": list(F.ScalingType.__members__) if hasattr(F, "ScalingType") else None}))
    torch.manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w, w_scales = f.quantize_fp8_weight_ref((torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16())
        bf16_weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in (16, 256, 2048, 8192):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = f.fp8_linear_ref(x, w, w_scales).float()

            def rel_err(out: torch.Tensor) -> float:
                return ((out.float() - ref).abs().max() / ref.abs().max()).item()
            q, scales = f.quantize_fp8(x)
            fp8_linear = lambda: f.fp8_linear(x, w, w_scales)     # noqa: E731
            line = {"shape": name, "rows": m, "fp8_linear_us": round(replay_us(fp8_linear, 20), 2),
                    "fp8_linear_err": rel_err(fp8_linear()),
                    "bf16_us": round(replay_us(lambda: x @ bf16_weight.t(), 20), 2),
                    "quantize_us": round(replay_us(lambda: f.quantize_fp8(x), 20), 2)}
            for label, product in layouts(q, scales, w, w_scales):
                try:
                    line[label] = dict(err=rel_err(product()), us=round(replay_us(product, 20), 2))
                except RuntimeError as e:
                    line[label] = str(e)[:200]
            print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
