"""`triton` and `triton.language` when Triton is installed; otherwise a stand-in, so that every
kernel module still imports (its `*_ref` function is the CPU path) and a Triton kernel fails only
when something calls it. vLLM's `vllm/triton_utils` does the same.

Also programmatic dependent launch (PDL, Hopper and later) for the kernels of a decode step. A
kernel launched with `launch_pdl` may become resident before the kernel ahead of it has finished;
it may read, before `pdl_enter`, only what no kernel of the step writes (weights, the step's
inputs, copied before the step's first kernel), and it reads or writes anything else only after.
`pdl_enter` also lets the next PDL kernel launch: once every program of this one has passed it,
the next one's programs take SM slots as they free up and do their own early reads, so a launch
overlaps the tail of the kernel ahead instead of following it. cuBLAS's kernels neither wait nor
release: a PDL kernel after one starts when it ends, as without PDL."""
import functools
import os

import torch

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

    class _TritonPlaceholder:
        """Any attribute is itself (so `tl.constexpr` annotations and `@triton.jit` evaluate);
        launching a kernel or calling a helper raises."""

        def __getattr__(self, name):
            return self

        def __call__(self, *args, **kwargs):
            if len(args) == 1 and callable(args[0]) and not kwargs:
                return self                 # used as a decorator: @triton.jit
            if not args and kwargs.keys() <= {"do_not_specialize", "noinline", "debug"}:
                return self                 # a decorator's options: @triton.jit(do_not_specialize=...)
            raise ImportError("this kernel needs triton, which is not installed")

        def __getitem__(self, grid):
            raise ImportError("this kernel needs triton, which is not installed")

    triton = tl = _TritonPlaceholder()


@functools.lru_cache
def num_sms(device: torch.device) -> int:
    """The GPU's streaming multiprocessors, which kernels that split their work count programs
    against; under the interpreter a small number, so that tests exercise several splits."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


@functools.lru_cache
def use_pdl(device: torch.device) -> bool:
    """Whether decode kernels on `device` launch with PDL: CUDA at compute capability 9.0 or newer
    (the interpreter and older GPUs have no griddepcontrol). MINI_ENGINE_PDL=0 turns it off, for
    A/B runs."""
    if not HAS_TRITON or device.type != "cuda" or os.environ.get("MINI_ENGINE_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_options(device: torch.device) -> dict:
    """Launch keywords of a PDL-aware kernel: its USE_PDL switch and Triton's launch flag."""
    pdl = use_pdl(device)
    return {"USE_PDL": pdl, "launch_pdl": pdl}


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """Where a PDL kernel's reads of the kernels ahead begin: wait until they have finished and
    their writes are visible, then let the next kernel launch. Releasing the next one before the
    wait instead (so launches run several kernels ahead) measured the same over the benchmark
    and slower at 1-16 rows (8 rows: 1.36 against 1.28 ms a step; benchmarks/NOTES.md, entry 30)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


__all__ = ["HAS_TRITON", "triton", "tl", "use_pdl", "pdl_options", "pdl_enter"]
