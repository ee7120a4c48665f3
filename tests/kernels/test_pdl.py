"""Programmatic dependent launch: off where it cannot work, and no kernel launched with it skips
the wait (a kernel that did could read its predecessor's output half-written). Whether the
compiled kernels really wait, and that PDL leaves outputs unchanged, benchmarks/gpu_correctness.py
checks on the H200."""
import importlib
import inspect
import pkgutil

import pytest
import torch

pytest.importorskip("triton")
import mini_engine.kernels  # noqa: E402
from mini_engine.kernels import triton_utils  # noqa: E402


def jit_kernels():
    for info in pkgutil.iter_modules(mini_engine.kernels.__path__):
        module = importlib.import_module(f"mini_engine.kernels.{info.name}")
        for name, fn in vars(module).items():
            # a JITFunction, or under the interpreter its stand-in: both keep the Python function
            if name.endswith("_kernel") and hasattr(fn, "arg_names") and inspect.isfunction(getattr(fn, "fn", None)):
                yield f"{info.name}.{name}", fn


def test_off_on_cpu_and_when_switched_off(monkeypatch):
    assert triton_utils.pdl_launch_options(torch.device("cpu")) == {"USE_PDL": False, "launch_pdl": False}
    if torch.cuda.is_available():
        monkeypatch.setenv("MINI_ENGINE_PDL", "0")
        triton_utils.use_pdl.cache_clear()
        try:
            assert not triton_utils.use_pdl(torch.device("cuda"))
        finally:
            monkeypatch.undo()
            triton_utils.use_pdl.cache_clear()


def test_every_kernel_waits_before_it_reads():
    """Each kernel takes the USE_PDL switch (every launch passes it) and calls the wait with it."""
    kernels = dict(jit_kernels())
    assert len(kernels) >= 10, sorted(kernels)
    for name, fn in kernels.items():
        source = inspect.getsource(fn.fn)
        assert "USE_PDL" in fn.arg_names, f"{name} has no USE_PDL switch"
        assert "wait_for_previous_kernel(USE_PDL" in source, f"{name} never waits for the kernel ahead"
