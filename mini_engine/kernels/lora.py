"""LoRA's delta added to a projection's output: out += ((x A^T) * mask) B^T (layers/lora.py).

A and B hold max_loras slots side by side, A [L * W, in] and B [out, L * W] (W: one slot's
columns), and each token keeps only its own slot's W columns of x A^T: mask[t, j] = (slot of t
== j // W), a slot of -1 keeping none.

In PyTorch that is three launches a projection (the shrink, the mask, the expand with its add),
336 a decode step of Qwen3-0.6B: ~1 ms a step at any batch size (benchmarks/NOTES.md, entry 58),
where the bytes (A and B of every slot, x and out) take a few microseconds. The Triton kernel does
all three in one launch: each program shrinks its rows once, keeping x A^T in registers (L * W
columns are few), and expands them into a run of output columns, adding into out.
"""
import torch


def lora_add_ref(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, out: torch.Tensor
                 ) -> torch.Tensor:
    """out += ((x a^T) * mask) b^T, in place; returns out. x [T, in], a [L * W, in], b [out, L * W],
    mask [T, L] in x's dtype (1 where a token reads slot l). The shrink is rounded to x's dtype,
    the expand accumulates in fp32 and adds to out before its one rounding (cuBLAS's beta = 1)."""
    num_tokens, num_loras = mask.shape
    shrunk = (x @ a.t()).view(num_tokens, num_loras, -1).mul_(mask[:, :, None])
    return out.addmm_(shrunk.view(num_tokens, -1), b.t())


def lora_mask(token_slots: torch.Tensor, num_loras: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, L] in `dtype`: 1 where token t's slot is l (slot -1: a row of zeros)."""
    slot_ids = torch.arange(num_loras, dtype=token_slots.dtype, device=token_slots.device)
    return (token_slots[:, None] == slot_ids).to(dtype)


# ---- Triton ----

from dataclasses import dataclass  # noqa: E402

from mini_engine.kernels.triton_utils import num_sms, pdl_enter, pdl_options, tl, triton  # noqa: E402


@triton.jit
def _lora_add_kernel(x_ptr, a_ptr, b_ptr, slots_ptr, out_ptr, M, N, K, stride_xm, stride_om, cols_per_program,
                     WIDTH, NUM_COLS, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                     DOT_IN_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (n_range, m_block): rows m_block's x A^T (all NUM_COLS = L * WIDTH columns, the
    ones of other slots zeroed), then out[m_block, n_range] += that times B[n_range]^T, BLOCK_N
    columns at a time. A block whose rows all have slot -1 adds nothing and reads nothing but the
    slots: a batch without adapters costs the launch alone."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    slots = tl.load(slots_ptr + rows, mask=row_ok, other=-1)    # a step input: no wait needed
    # Every program waits, also one with nothing to do: a kernel after this one waits for this
    # grid only, which must not end before the kernels ahead of it have.
    pdl_enter(USE_PDL)
    if tl.max(slots, axis=0) >= 0:
        r = tl.arange(0, BLOCK_R)
        r_ok = r < NUM_COLS
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
        a_rows = a_ptr + r.to(tl.int64)[:, None] * K
        shrunk = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
        for k in range(0, K, BLOCK_K):
            offs_k = k + tl.arange(0, BLOCK_K)
            if EVEN_K:
                x = tl.load(x_rows + offs_k[None, :], mask=row_ok[:, None], other=0.0)
                a = tl.load(a_rows + offs_k[None, :], mask=r_ok[:, None], other=0.0)
            else:
                k_ok = offs_k < K
                x = tl.load(x_rows + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                a = tl.load(a_rows + offs_k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            if DOT_IN_FP32:
                x, a = x.to(tl.float32), a.to(tl.float32)
            shrunk = tl.dot(x, tl.trans(a), shrunk, input_precision=INPUT_PRECISION)
        own_slot = (r[None, :] // WIDTH) == slots[:, None]
        # Rounded to the model's dtype, as lora_add_ref's shrink is, and the expand's operand.
        shrunk = tl.where(own_slot, shrunk, 0.0).to(x_ptr.dtype.element_ty)
        if DOT_IN_FP32:
            shrunk = shrunk.to(tl.float32)
        n_lo = pid_n * cols_per_program
        for n in range(n_lo, tl.minimum(n_lo + cols_per_program, N), BLOCK_N):
            cols = n + tl.arange(0, BLOCK_N)
            col_ok = cols < N
            b = tl.load(b_ptr + cols.to(tl.int64)[:, None] * NUM_COLS + r[None, :],
                        mask=col_ok[:, None] & r_ok[None, :], other=0.0)
            if DOT_IN_FP32:
                b = b.to(tl.float32)
            delta = tl.dot(shrunk, tl.trans(b), input_precision=INPUT_PRECISION)
            out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
            mask = row_ok[:, None] & col_ok[None, :]
            total = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32) + delta
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class LoRAKernelConfig:
    block_m: int
    block_n: int
    block_k: int
    col_programs: int           # programs across the output columns (each takes a run of them)
    num_warps: int = 4
    num_stages: int = 2


def lora_kernel_config(num_rows: int, out_features: int, device: torch.device) -> LoRAKernelConfig:
    """Few rows (decode): one row block, and a program per BLOCK_N output columns, so that the
    launch spreads over the SMs. Many rows (prefill): ~2 programs an SM, each taking a long run of
    columns, so that x is read and shrunk as few times as possible."""
    block_m = min(64, max(16, triton.next_power_of_2(num_rows)))
    block_n = 64
    row_blocks = triton.cdiv(num_rows, block_m)
    col_blocks = triton.cdiv(out_features, block_n)
    col_programs = max(1, min(col_blocks, triton.cdiv(2 * num_sms(device), row_blocks)))
    return LoRAKernelConfig(block_m, block_n, block_k=128, col_programs=col_programs)


def lora_add(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, out: torch.Tensor,
             width: int, config: LoRAKernelConfig | None = None) -> torch.Tensor:
    """lora_add_ref(x, a, b, lora_mask(token_slots, L, x.dtype), out) in one launch, for x [T, in]
    with contiguous rows, a [L * width, in] and b [out_features, L * width] contiguous, token_slots
    [T] int32, out [T, out_features] with contiguous rows. The grid depends on shapes only
    (CUDA-graph safe)."""
    (m, k), n, num_cols = x.shape, out.shape[1], a.shape[0]
    assert x.stride(-1) == 1 and out.stride(-1) == 1 and a.is_contiguous() and b.is_contiguous()
    assert a.shape[1] == k and b.shape == (n, num_cols) and token_slots.shape == (m,) and num_cols % width == 0
    if m == 0:
        return out
    cfg = config or lora_kernel_config(m, n, x.device)
    block_k = cfg.block_k * 2 // x.element_size()         # fp32 tiles (CPU tests) in the same bytes
    cols_per_program = triton.cdiv(triton.cdiv(n, cfg.col_programs), cfg.block_n) * cfg.block_n
    grid = (triton.cdiv(n, cols_per_program), triton.cdiv(m, cfg.block_m))
    _lora_add_kernel[grid](x, a, b, token_slots, out, m, n, k, x.stride(0), out.stride(0), cols_per_program,
                           width, num_cols, BLOCK_R=max(16, triton.next_power_of_2(num_cols)),
                           BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
                           DOT_IN_FP32=x.device.type == "cpu",
                           # fp32 weights get fp32 products, not TF32 (bf16/fp16 ignore this)
                           INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                           **pdl_options(x.device))
    return out
