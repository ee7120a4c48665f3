import pytest
import torch

pytest.importorskip("triton")
from mini_engine.kernels.sampling import sample  # noqa: E402


def test_greedy_is_argmax(device):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5000, generator=gen).to(device)      # 5000: a loop over two chunks
    logits[1, 4500] = 100.0                                        # winner in the last chunk
    logits[2, 100:] = float("-inf")
    tokens = sample(logits, torch.zeros(6, device=device), torch.arange(6, device=device))
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, logits.argmax(-1))


def test_same_seed_same_token_and_seeds_differ(device):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 300, generator=gen).to(device).expand(32, 300).contiguous()
    temperatures = torch.ones(32, device=device)
    seeds = torch.arange(32, device=device) * 7919
    first = sample(logits, temperatures, seeds)
    assert torch.equal(first, sample(logits, temperatures, seeds))
    assert len(set(first.tolist())) > 1


def test_mixed_greedy_and_masked_rows(device):
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(8, 70, generator=gen).to(device)
    allowed = torch.zeros(8, 70, dtype=torch.bool, device=device)
    allowed[:, ::7] = True                                         # top-k/top-p style -inf mask
    logits = logits.masked_fill(~allowed, float("-inf"))
    temperatures = torch.tensor([0.0, 1.0, 0.5, 2.0, 0.0, 1.0, 100.0, 1.0], device=device)
    for step in range(4):
        tokens = sample(logits, temperatures, torch.arange(8, device=device) + 100 * step)
        assert allowed[torch.arange(8, device=device), tokens].all()
        greedy = temperatures == 0
        assert torch.equal(tokens[greedy], logits[greedy].argmax(-1))


def test_distribution_matches_softmax(device):
    """Chi-square goodness of fit over a fixed set of seeds: one row per seed, same logits."""
    num_draws, temperature = 600, 0.8
    logits = torch.tensor([1.0, 0.5, 0.0, -1.0, float("-inf"), 2.0, 0.3, -0.5], device=device)
    tokens = sample(logits.expand(num_draws, -1).contiguous(), torch.full((num_draws,), temperature, device=device),
                    torch.arange(num_draws, device=device) * 1_000_003 % 2**31)
    counts = torch.bincount(tokens, minlength=logits.numel()).double().cpu()
    expected = (logits / temperature).softmax(-1).double().cpu() * num_draws
    assert counts[4] == 0
    live = expected > 0
    chi2 = ((counts[live] - expected[live]) ** 2 / expected[live]).sum().item()
    assert chi2 < 24.3      # chi-square, 6 degrees of freedom, p = 0.9995
