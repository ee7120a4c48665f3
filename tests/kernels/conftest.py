"""Kernel tests run the Triton kernels on the GPU when there is one, otherwise through Triton's
interpreter on CPU tensors (slow: keep shapes small; the repository's root conftest.py turns the
interpreter on)."""
import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture(autouse=True)
def poisoned_allocations(monkeypatch):
    """Every tensor that Python code allocates with torch.empty / torch.empty_like during a test
    starts as NaN (integers: -1), so an output element a kernel forgets to write fails the test
    instead of passing on whatever memory it happened to get."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan") if t.is_floating_point() else -1)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))
