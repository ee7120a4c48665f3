"""`triton` and `triton.language` when Triton is installed; otherwise a stand-in, so that every
kernel module still imports (its `*_ref` function is the CPU path) and a Triton kernel fails only
when something calls it. vLLM's `vllm/triton_utils` does the same."""
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

__all__ = ["HAS_TRITON", "triton", "tl"]
