"""LoRA's delta added to a projection's output: out += ((x A^T) * mask) B^T (layers/lora.py).

A and B hold max_loras slots side by side, A [L * W, in] and B [out, L * W] (W: one slot's
columns), and each token keeps only its own slot's W columns of x A^T: mask[t, j] = (slot of t
== j // W), a slot of -1 keeping none.

In PyTorch that is three launches a projection (the shrink, the mask, the expand with its add),
336 a decode step of Qwen3-0.6B: ~1 ms a step at any batch size (benchmarks/NOTES.md, entry 58).
Here the shrink stays with cuBLAS (x A^T: one GEMM whatever the slots), and one Triton launch does
the rest: each program loads its rows' shrunk values with the other slots' columns masked to zero
as it reads them, expands them through its tile of B and adds the result into out. A first design
did the shrink in the same launch, each program shrinking its rows again: at max_loras=4 its 192
columns a row filled the registers, and the runs were slower than PyTorch's (entry 59).
"""
import torch


def lora_add_ref(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, out: torch.Tensor
                 ) -> torch.Tensor:
    """out += ((x a^T) * mask) b^T, in place; returns out. x [T, in], a [L * W, in], b [out, L * W],
    mask [T, L] in x's dtype (1 where a token reads slot l). The shrink is rounded to x's dtype,
    the expand accumulates in fp32 and adds to out before its one rounding (cuBLAS's beta = 1)."""
    return lora_expand_ref(x @ a.t(), b, mask, out)


def lora_expand_ref(shrunk: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out += (shrunk * mask) b^T, in place; returns out. shrunk [T, L * W] (its rows may be
    strided: the last columns of a product that computed it with the base one, layers/lora.py)."""
    num_tokens, num_loras = mask.shape
    masked = shrunk.reshape(num_tokens, num_loras, -1) * mask[:, :, None]
    return out.addmm_(masked.view(num_tokens, -1), b.t())


def lora_mask(token_slots: torch.Tensor, num_loras: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, L] in `dtype`: 1 where token t's slot is l (slot -1: a row of zeros)."""
    slot_ids = torch.arange(num_loras, dtype=token_slots.dtype, device=token_slots.device)
    return (token_slots[:, None] == slot_ids).to(dtype)


# ---- Triton ----

from dataclasses import dataclass  # noqa: E402

from mini_engine.kernels.triton_utils import pdl_enter, pdl_options, tl, triton  # noqa: E402


@triton.jit
def _lora_expand_kernel(shrunk_ptr, b_ptr, slots_ptr, out_ptr, M, N, NUM_COLS, WIDTH, stride_sm, stride_om,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                        DOT_IN_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (n_block, m_block): out[m_block, n_block] += shrunk[m_block] B[n_block]^T over each
    row's own slot's columns, BLOCK_R of the L * W columns at a time. A block whose rows all have
    slot -1 reads nothing but the slots and writes nothing: a batch without adapters costs the launch."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    slots = tl.load(slots_ptr + rows, mask=row_ok, other=-1)    # a step input: no wait needed
    # Every program waits, also one with nothing to do: a kernel after this one waits for this
    # grid only, which must not end before the kernels ahead of it have.
    pdl_enter(USE_PDL)
    if tl.max(slots, axis=0) >= 0:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        shrunk_rows = shrunk_ptr + rows.to(tl.int64)[:, None] * stride_sm
        b_rows = b_ptr + cols.to(tl.int64)[:, None] * NUM_COLS
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for r0 in range(0, NUM_COLS, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            r_ok = r < NUM_COLS
            own_slot = (r[None, :] // WIDTH) == slots[:, None]      # the mask, applied as the load's
            s = tl.load(shrunk_rows + r[None, :], mask=own_slot & r_ok[None, :], other=0.0)
            b = tl.load(b_rows + r[None, :], mask=col_ok[:, None] & r_ok[None, :], other=0.0)
            if DOT_IN_FP32:
                s, b = s.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(s, tl.trans(b), acc, input_precision=INPUT_PRECISION)
        out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        total = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32) + acc
        tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class LoRAKernelConfig:
    block_m: int
    block_n: int
    block_r: int
    num_warps: int = 4
    num_stages: int = 2


def lora_kernel_config(num_rows: int, num_cols: int) -> LoRAKernelConfig:
    """Rows a program as the batch needs up to 64; B's columns (num_cols = L * W) 64 at a time."""
    block_m = min(64, max(16, triton.next_power_of_2(num_rows)))
    return LoRAKernelConfig(block_m, block_n=64, block_r=min(64, max(16, triton.next_power_of_2(num_cols))))


def lora_expand(shrunk: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, out: torch.Tensor, width: int,
                config: LoRAKernelConfig | None = None) -> torch.Tensor:
    """out += (shrunk * mask) b^T in place, mask from token_slots as lora_mask's; returns out.
    shrunk [T, L * width] and out [T, out_features] with contiguous rows, b [out_features, L * width]
    contiguous, token_slots [T] int32. The grid depends on shapes only (CUDA-graph safe)."""
    (m, num_cols), n = shrunk.shape, out.shape[1]
    assert shrunk.stride(-1) == 1 and out.stride(-1) == 1 and b.is_contiguous()
    assert b.shape == (n, num_cols) and token_slots.shape == (m,) and num_cols % width == 0 and out.shape[0] == m
    if m == 0:
        return out
    cfg = config or lora_kernel_config(m, num_cols)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))
    _lora_expand_kernel[grid](shrunk, b, token_slots, out, m, n, num_cols, width, shrunk.stride(0), out.stride(0),
                              BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=cfg.block_r,
                              DOT_IN_FP32=shrunk.device.type == "cpu",
                              # fp32 weights get fp32 products, not TF32 (bf16/fp16 ignore this)
                              INPUT_PRECISION="ieee" if shrunk.dtype == torch.float32 else "tf32",
                              num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_options(shrunk.device))
    return out


def lora_add(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, out: torch.Tensor,
             width: int, config: LoRAKernelConfig | None = None) -> torch.Tensor:
    """lora_add_ref(x, a, b, lora_mask(token_slots, L, x.dtype), out): the shrink on cuBLAS, the
    mask, expand and add in one launch (lora_expand). Rounds where lora_add_ref does."""
    return lora_expand(x @ a.t(), b, token_slots, out, width, config)
