"""`triton` and `triton.language` when Triton is installed; otherwise a stand-in, so that every
kernel module still imports (its `*_ref` function is the CPU path) and a Triton kernel fails only
when something calls it. vLLM's `vllm/triton_utils` does the same.

Also programmatic dependent launch (PDL, Hopper and later): a kernel launched with `launch_pdl`
may be scheduled before the kernel ahead of it in the stream has finished, and waits for it
(`griddepcontrol.wait`) only where it starts reading that kernel's output. What it saves is the
gap between two kernels: the next launch is set up, and its programs made resident, while the
previous one drains. Every kernel here calls `wait_for_previous_kernel` before it touches memory
that an earlier kernel writes, so PDL changes when a kernel starts, never what it reads."""
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
            raise ImportError("this kernel needs triton, which is not installed")

        def __getitem__(self, grid):
            raise ImportError("this kernel needs triton, which is not installed")

    triton = tl = _TritonPlaceholder()


@functools.lru_cache
def use_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: CUDA on compute capability 9.0 or newer (the
    interpreter and older GPUs have no griddepcontrol). MINI_ENGINE_PDL=0 turns it off, for A/B
    runs."""
    if not HAS_TRITON or device.type != "cuda" or os.environ.get("MINI_ENGINE_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_launch_options(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch: the kernel's USE_PDL switch and Triton's launch flag."""
    pdl = use_pdl(device)
    return {"USE_PDL": pdl, "launch_pdl": pdl}


@triton.jit
def wait_for_previous_kernel(USE_PDL: tl.constexpr, RELEASE_NEXT: tl.constexpr = True):
    """With PDL: block until the kernels ahead in the stream have finished and their writes are
    visible. RELEASE_NEXT then lets the next PDL kernel be scheduled at once (it will wait in turn);
    a kernel with many waves of programs passes False, so that the next kernel's programs do not
    take SM slots its own later waves need. Without PDL, nothing."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if RELEASE_NEXT:
            tl.extra.cuda.gdc_launch_dependents()


__all__ = ["HAS_TRITON", "triton", "tl", "use_pdl", "pdl_launch_options", "wait_for_previous_kernel"]
