"""The PyTorch sampler (the CPU path and the reference for the Triton kernel)."""
import torch

from mini_engine.kernels.sampling import apply_top_k_top_p_ref
from mini_engine.layers.sampler import Sampler, SamplingTensors


def tensors(temps, top_k=None, top_p=None, row_seeds=None):
    b = len(temps)
    row_seeds = row_seeds if row_seeds is not None else [None] * b
    return SamplingTensors(
        temperatures=torch.tensor(temps, dtype=torch.float32),
        top_k=torch.tensor(top_k) if top_k is not None else None,
        top_p=torch.tensor(top_p, dtype=torch.float32) if top_p is not None else None,
        seeds=torch.tensor([s or 0 for s in row_seeds]), row_seeds=row_seeds,
        all_greedy=all(t == 0 for t in temps))


def test_greedy_is_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(Sampler()(logits, tensors([0.0] * 6)), logits.argmax(-1))
    # Greedy rows stay greedy inside a mixed batch.
    out = Sampler()(logits, tensors([0.0, 1.0, 0.0, 0.7, 0.0, 2.0]))
    assert torch.equal(out[[0, 2, 4]], logits.argmax(-1)[[0, 2, 4]])


def test_exponential_race_matches_softmax():
    torch.manual_seed(1234)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    temperature = 0.8
    n = 20_000
    out = Sampler()(logits.expand(n, -1).contiguous(), tensors([temperature] * n))
    counts = torch.bincount(out, minlength=6).float()
    expected = torch.softmax(logits / temperature, -1) * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 20.5, chi2          # chi-square, 5 degrees of freedom: p < 0.001
    hot = Sampler()(logits.expand(n, -1).contiguous(), tensors([5.0] * n))
    assert torch.bincount(hot, minlength=6).min() > 0     # a high temperature flattens: every token drawn


def test_top_k_and_top_p_restrict_support():
    torch.manual_seed(0)
    logits = torch.tensor([[3.0, 2.5, 2.0, 0.0, -1.0, -2.0]]).repeat(2000, 1)
    top2 = Sampler()(logits, tensors([1.0] * 2000, top_k=[2] * 2000))
    assert set(top2.tolist()) == {0, 1}
    probs = torch.softmax(logits[0], -1)           # 0.49, 0.30, 0.18, ...: top_p 0.8 keeps 3 tokens
    assert probs[:2].sum() < 0.8 < probs[:3].sum()
    nucleus = Sampler()(logits, tensors([1.0] * 2000, top_p=[0.8] * 2000))
    assert set(nucleus.tolist()) == {0, 1, 2}
    masked = apply_top_k_top_p_ref(logits[:2], torch.tensor([0, 1]), torch.tensor([1.0, 1.0]))
    assert torch.isfinite(masked[0]).all() and torch.isfinite(masked[1]).sum() == 1


def test_seed_reproduces_a_sample_whatever_the_batch():
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))
    first = Sampler()(logits, tensors([1.0, 1.0, 1.0], row_seeds=[11, 12, 13]))
    # The same seeded row, now alone and in a different batch position.
    again = Sampler()(logits[[2, 0]], tensors([1.0, 1.0], row_seeds=[13, 99]))
    assert again[0] == first[2]
    draws = {Sampler()(logits[:1], tensors([1.0], row_seeds=[s])).item() for s in range(20)}
    assert len(draws) > 1            # different seeds do draw differently


def test_a_top_p_that_rounds_to_zero_keeps_the_top_token():
    """1e-46 is 0 in fp32: every token's mass before it is >= 0, so only the rule that the top
    token always survives keeps the row from being all -inf (which samples token 0)."""
    logits = torch.tensor([[0.5, 3.0, 1.0, -2.0]])
    masked = apply_top_k_top_p_ref(logits, None, torch.tensor([1e-46], dtype=torch.float32))
    assert masked[0].isfinite().tolist() == [False, True, False, False]
