import pytest
import torch

pytest.importorskip("triton")
from mini_engine.kernels.zero_copy import copy_from_host, copy_from_host_ref  # noqa: E402


@pytest.mark.parametrize("num_words", [1, 100, 2048, 2049, 5000])     # 2049, 5000: a partial last program
def test_copy_from_host_matches_reference(device, num_words):
    """Random words from (pinned, on a GPU) host memory into the first num_words of a longer
    device buffer: they arrive as the reference copies them, and the words past them are left alone."""
    gen = torch.Generator().manual_seed(num_words)
    src = torch.randint(-2**62, 2**62, (num_words,), generator=gen, dtype=torch.int64)
    if device == "cuda":
        src = src.pin_memory()
    expected = torch.full((num_words + 300,), -1, dtype=torch.int64)
    copy_from_host_ref(expected[:num_words], src)
    got = torch.full((num_words + 300,), -1, dtype=torch.int64, device=device)
    copy_from_host(got[:num_words], src)
    assert torch.equal(got.cpu(), expected)
    assert torch.equal(expected[:num_words], src) and (expected[num_words:] == -1).all()


def test_copy_from_host_refuses_mismatched_buffers(device):
    with pytest.raises(AssertionError, match="shapes or dtypes differ"):
        copy_from_host(torch.zeros(8, dtype=torch.int64, device=device), torch.zeros(9, dtype=torch.int64))
