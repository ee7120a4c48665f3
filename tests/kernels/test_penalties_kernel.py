import pytest
import torch

pytest.importorskip("triton")
from mini_engine.kernels.penalties import apply_penalties, apply_penalties_ref  # noqa: E402


@pytest.mark.parametrize("num_rows,vocab_size", [(1, 100), (5, 4099), (9, 2048)])   # 4099: a ragged third block
def test_apply_penalties_matches_reference(device, num_rows, vocab_size):
    """Random logits (some -inf, as a ban or a bias leaves them), counts and prompt flags in a
    state of more rows than the step's; the penalised rows in a random order among the step's,
    with penalties of both signs and repetition on both sides of 1."""
    gen = torch.Generator().manual_seed(num_rows * vocab_size)
    num_sampling, num_state = num_rows + 3, num_rows + 4
    logits = torch.randn(num_sampling, vocab_size, generator=gen) * 4
    logits[torch.rand(num_sampling, vocab_size, generator=gen) < 0.01] = float("-inf")
    counts = torch.randint(0, 4, (num_state, vocab_size), generator=gen, dtype=torch.int32)
    counts[torch.rand(num_state, vocab_size, generator=gen) < 0.7] = 0
    seen = torch.rand(num_state, vocab_size, generator=gen) < 0.2
    rows = torch.randperm(num_sampling, generator=gen)[:num_rows]
    state_rows = torch.randperm(num_state, generator=gen)[:num_rows]
    presence, frequency = torch.rand(2, num_rows, generator=gen) * 4 - 2
    repetition = torch.rand(num_rows, generator=gen) * 1.5 + 0.5
    expected = logits.clone()
    apply_penalties_ref(expected, rows, state_rows, presence, frequency, repetition, counts, seen)
    got = logits.clone().to(device)
    apply_penalties(got, *(x.to(device) for x in (rows, state_rows, presence, frequency, repetition, counts, seen)))
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-6, atol=1e-6)
    untouched = torch.ones(num_sampling, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(got.cpu()[untouched], logits[untouched])
    assert (expected[rows] != logits[rows]).float().mean() > 0.3      # the penalties changed most of the rows
