"""The top-k sampler's kernels, the KV write into each cache type, and the fp8 and LoRA products,
compiled for the H200 (sm_90) on this machine, GPU or not.

Triton's interpreter runs what a GPU compile refuses: a kernel that reads a global which is not a
tl.constexpr, or an `if` whose branches bind one name to blocks of two shapes. Triton 3.6 on the
H200 refused both in top_k_sampling.py after the interpreter's tests had passed
(benchmarks/NOTES.md, entry 48). Triton's NVIDIA backend (ptxas included) ships with the CPU
wheel, so the compile to PTX and cubin runs here too: in a child process, since the tests' own
process runs every kernel through the interpreter (TRITON_INTERPRET=1), where a kernel cannot be
compiled."""
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import triton  # noqa: E402
from mini_engine.kernels import top_k_sampling as k  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
DRAWN = {"top_k_ptr": "*i32", "temperatures_ptr": "*fp32"}
SHAPE = {"vocab_size": "i32", "stride_logits": "i32"}


def kernels(logits: str):
    """(kernel, signature, constexprs, warps) as sample_top_k launches each."""
    return [
        (k._group_max_kernel, {"logits_ptr": logits, **DRAWN, "group_max_ptr": "*i32", **SHAPE, "num_groups": "i32",
                               "CHUNK": "constexpr", "GROUP": "constexpr"}, {"CHUNK": k.CHUNK, "GROUP": k.GROUP}, 8),
        (k._threshold_kernel, {"group_max_ptr": "*i32", **DRAWN, "threshold_ptr": "*i32", "num_groups": "i32",
                               "BLOCK_GROUPS": "constexpr", "K": "constexpr"},
         {"BLOCK_GROUPS": 256, "K": k.TOP_K_MAX}, 1),
        (k._gather_kernel, {"logits_ptr": logits, **DRAWN, "threshold_ptr": "*i32", "lists_ptr": "*i64",
                            "counts_ptr": "*i32", **SHAPE, "CHUNK": "constexpr", "LIST_SIZE": "constexpr"},
         {"CHUNK": k.CHUNK, "LIST_SIZE": k.LIST_SIZE}, 8),
        (k._sample_candidates_kernel, {"lists_ptr": "*i64", "counts_ptr": "*i32", "best_ptr": "*i64",
                                       "logits_ptr": logits, "top_k_ptr": "*i32", "top_p_ptr": "*fp32",
                                       "temperatures_ptr": "*fp32", "seeds_ptr": "*i64", "tokens_ptr": "*i64", **SHAPE,
                                       "CHUNK": "constexpr", "K": "constexpr", "SHORT_LIST": "constexpr",
                                       "LIST_SIZE": "constexpr"},
         {"CHUNK": k.CHUNK, "K": k.TOP_K_MAX, "SHORT_LIST": k.SHORT_LIST, "LIST_SIZE": k.LIST_SIZE}, 4),
    ]


def compile_all() -> None:
    """Compiles every kernel for both logits dtypes; raises at the first that fails."""
    for logits in ("*bf16", "*fp32"):
        for kernel, signature, constexprs, warps in kernels(logits):
            compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=HOPPER,
                                      options={"num_warps": warps})
            assert "cubin" in compiled.asm, kernel.fn.__name__


def compile_kv_writes() -> None:
    """The fused rotary/KV write (kernels/rotary_kv.py) into a bf16, an e4m3 and an e5m2 cache: the
    fp8 ones round by hand with constexpr arithmetic that only a compile checks."""
    from mini_engine.kernels import rotary_kv
    kernel = rotary_kv._qk_norm_rope_kv_write_kernel
    pointers = {"positions_ptr": "*i64", "slot_mapping_ptr": "*i64", "cos_sin_ptr": "*fp32"}
    for cache in ("*bf16", "*fp8e4nv", "*fp8e5"):
        constexprs = dict(NUM_HEADS=16, NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=64, BLOCK_HQ=16, BLOCK_HKV=8,
                          HAS_NORM=True, BLOCK_H=1024, FP8_CACHE=cache != "*bf16", USE_PDL=True)
        signature = {name: "constexpr" if name in constexprs
                     else cache if name in ("k_cache_ptr", "v_cache_ptr")
                     else pointers.get(name, "*bf16") if name.endswith("_ptr")
                     else "fp32" if name == "eps" else "i32" for name in kernel.arg_names}
        compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=HOPPER,
                                  options={"num_warps": 4})
        assert "cubin" in compiled.asm, cache


def compile_fp8_linear() -> None:
    """The fp8 weights' kernels (kernels/fp8_linear.py): the quantization's IEEE divisions and
    rounding (the GPU's conversion, and by hand as under the interpreter), with and without the norm, and the fp8 dot at each tile of fp8_gemm_config."""
    from mini_engine.kernels import fp8_linear as f
    for has_norm, hand_rounding in ((False, False), (True, False), (True, True)):
        constexprs = dict(GROUPS=8, BLOCK_K=128, MIN_AMAX=f.MIN_AMAX, HAS_NORM=has_norm, HAND_ROUNDING=hand_rounding,
                          USE_PDL=True)
        signature = {"x_ptr": "*bf16", "norm_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "K": "i32",
                     "num_groups": "i32", "stride_xm": "i32", "stride_sm": "i32", "stride_sg": "i32",
                     "eps": "fp32"} | dict.fromkeys(constexprs, "constexpr")
        compiled = triton.compile(ASTSource(f._quantize_fp8_kernel, signature, constexprs=constexprs), target=HOPPER,
                                  options={"num_warps": 4})
        assert "cubin" in compiled.asm
    # Qwen3-0.6B's down_proj (split over K at decode) and gate_up_proj, at decode and prefill rows
    for rows, n, k in ((1, 1024, 3072), (32, 6144, 1024), (256, 1024, 3072), (2048, 6144, 1024)):
        cfg = f.fp8_gemm_config(rows, n, k, sms=132)
        constexprs = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=128, SPLIT_K=cfg.split_k, HAS_BIAS=False,
                          ADD_OUT=True, USE_PDL=True)
        signature = {"a_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32",
                     "bias_ptr": "*bf16", "out_ptr": "*bf16", "partial_ptr": "*fp32", "counter_ptr": "*i32", "M": "i32",
                     "N": "i32", "K": "i32", "num_groups": "i32", "stride_wn": "i32",
                     "stride_om": "i32"} | dict.fromkeys(constexprs, "constexpr")
        compiled = triton.compile(ASTSource(f._fp8_gemm_kernel, signature, constexprs=constexprs), target=HOPPER,
                                  options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
        assert "cubin" in compiled.asm, cfg


def compile_fp8_fused_moe() -> None:
    """The fp8 experts' grouped GEMM (kernels/fp8_fused_moe.py) at each tile of fp8_moe_config, as
    gate/up or down (a compile each, ~2 s): fp8 tiles of a gathered block of rows, each group's
    scales a row's and a column's."""
    from mini_engine.kernels import fp8_fused_moe as f
    for cfg, down in ((f.FP8_DECODE_CONFIG, True), (f.FP8_DECODE_WIDE_CONFIG, False), (f.FP8_PREFILL_CONFIG, False)):
        constexprs = dict(TOP_K=8, DOWN=down, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=128, USE_PDL=True)
        signature = {"a_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32",
                     "out_ptr": "*bf16", "topk_weights_ptr": "*bf16", "sorted_pair_ids_ptr": "*i32",
                     "block_expert_ids_ptr": "*i32", "num_padded_ptr": "*i32"} | {
            name: "i32" for name in ("num_pairs", "N", "K", "num_groups", "stride_we", "stride_wn", "stride_se",
                                     "stride_sn", "stride_om")} | dict.fromkeys(constexprs, "constexpr")
        compiled = triton.compile(ASTSource(f._fp8_grouped_gemm_kernel, signature, constexprs=constexprs),
                                  target=HOPPER, options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
        assert "cubin" in compiled.asm, (cfg, down)


def compile_lora() -> None:
    """LoRA's expand kernel (kernels/lora.py) at a decode's and a prefill's tiles, one slot of a
    packed q/k/v (48 columns) and four (192): its branch on the block's slots and its masked loads."""
    from mini_engine.kernels import lora
    for rows, num_cols in ((1, 48), (256, 192), (16384, 48)):
        cfg = lora.lora_kernel_config(rows, num_cols)
        constexprs = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=cfg.block_r, DOT_IN_FP32=False,
                          INPUT_PRECISION="tf32", USE_PDL=True)
        signature = {"shrunk_ptr": "*bf16", "b_ptr": "*bf16", "slots_ptr": "*i32", "out_ptr": "*bf16",
                     } | {name: "i32" for name in ("M", "N", "NUM_COLS", "WIDTH", "stride_sm", "stride_om")
                          } | dict.fromkeys(constexprs, "constexpr")
        compiled = triton.compile(ASTSource(lora._lora_expand_kernel, signature, constexprs=constexprs),
                                  target=HOPPER, options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
        assert "cubin" in compiled.asm, (rows, num_cols)


@pytest.mark.parametrize("compile_fn", ["compile_all", "compile_kv_writes", "compile_fp8_linear",
                                        "compile_fp8_fused_moe", "compile_lora"])
def test_kernels_compile_for_sm90(compile_fn):
    pytest.importorskip("triton.backends.nvidia", reason="this triton has no NVIDIA backend")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child = subprocess.run([sys.executable, "-c", f"from tests.kernels.test_compiles_for_hopper import {compile_fn}; "
                            f"{compile_fn}()"], cwd=root, env=env | {"PYTHONPATH": root}, capture_output=True,
                           text=True)
    assert child.returncode == 0, child.stderr[-3000:]
