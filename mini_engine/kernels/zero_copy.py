"""A step's packed inputs, read by the device straight out of pinned host memory.

Pinned memory is mapped into the GPU's address space, so a kernel can load it over PCIe itself
("zero-copy"). A host-to-device copy instead goes through a copy engine, and the device waits for
that engine to start and hand back before the step's first kernel: on the H200 a copy in front of
a decode graph cost it 9-14 us, the same at 4 KB as at 143 KB, where this kernel cost 3-7 us
(benchmarks/NOTES.md, entry 40). The host must not rewrite the source until the kernel has run:
StepInputBuffers keeps two sources and an event on each."""
import torch

from mini_engine.kernels.triton_utils import tl, triton


def copy_from_host_ref(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src, non_blocking=True)


@triton.jit
def _copy_from_host_kernel(src_ptr, dst_ptr, numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = offsets < numel
    tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=in_range), mask=in_range)


# Elements a program: 16 KB of int64. 512 and 2,048 cost the same before a decode replay (entry 40).
_BLOCK = 2048


def copy_from_host(dst: torch.Tensor, src: torch.Tensor) -> None:
    """copy_from_host_ref in one kernel: src pinned host memory (or, under the interpreter, any CPU
    tensor), dst on the device, both contiguous and of one dtype and length."""
    assert dst.shape == src.shape and dst.dtype == src.dtype, "copy_from_host: shapes or dtypes differ"
    numel = dst.numel()
    if numel:
        _copy_from_host_kernel[(triton.cdiv(numel, _BLOCK),)](src, dst, numel, BLOCK=_BLOCK)
