import pytest
import torch

pytest.importorskip("triton")
from mini_engine.kernels.prev_tokens import take_prev_tokens, take_prev_tokens_ref  # noqa: E402


@pytest.mark.parametrize("num_tokens", [1, 7, 256, 1500])     # 1500: two programs
def test_take_prev_tokens_matches_reference(device, num_tokens):
    """Random tokens, about half of them the previous launch's (indices anywhere in its samples,
    repeats allowed); the rest keep the host's value."""
    gen = torch.Generator().manual_seed(num_tokens)
    input_ids = torch.randint(0, 150_000, (num_tokens,), generator=gen)
    prev_tokens = torch.randint(0, 150_000, (300,), generator=gen)
    prev_index = torch.randint(0, 300, (num_tokens,), generator=gen)
    prev_index[torch.rand(num_tokens, generator=gen) < 0.5] = -1
    expected = input_ids.clone()
    take_prev_tokens_ref(expected, prev_index, prev_tokens)
    got = input_ids.to(device)
    take_prev_tokens(got, prev_index.to(device), prev_tokens.to(device))
    assert torch.equal(got.cpu(), expected)
    taken = prev_index >= 0
    assert torch.equal(expected[taken], prev_tokens[prev_index[taken]])
    assert torch.equal(expected[~taken], input_ids[~taken])
