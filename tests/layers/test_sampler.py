"""The PyTorch sampler (the CPU path and the reference for the Triton kernel)."""
import torch

import pytest

from mini_engine.kernels.sampling import TOP_K_SELECT_LIMIT, apply_top_k_top_p, apply_top_k_top_p_ref
from mini_engine.layers.sampler import Sampler, SamplingTensors


def tensors(temps, top_k=None, top_p=None, row_seeds=None):
    b = len(temps)
    row_seeds = row_seeds if row_seeds is not None else [None] * b
    return SamplingTensors(
        temperatures=torch.tensor(temps, dtype=torch.float32),
        top_k=torch.tensor(top_k) if top_k is not None else None,
        top_p=torch.tensor(top_p, dtype=torch.float32) if top_p is not None else None,
        seeds=torch.tensor([s or 0 for s in row_seeds]), row_seeds=row_seeds,
        all_greedy=all(t == 0 for t in temps), row_top_k=top_k)


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


@pytest.mark.parametrize("seed", range(4))
def test_selected_top_k_sets_equal_the_sorted_reference(seed):
    """Rows that keep top-k sets of 1 to TOP_K_SELECT_LIMIT tokens (several groups of one top_k),
    some with a nucleus inside, one with a top_p that rounds to 0, one greedy, and rows that keep
    their whole vocabulary or a set beyond the limit (sorted): masked and scaled exactly as the
    sort over the vocabulary of the scaled logits does; bf16 logits too (distinct values: ties
    are the next test's)."""
    gen = torch.Generator().manual_seed(seed)
    rows, vocab = 12, 5000
    logits = torch.randn(rows, vocab, generator=gen) * 3
    top_k = torch.randint(1, TOP_K_SELECT_LIMIT + 1, (rows,), generator=gen)
    top_k[:6] = torch.tensor([1, 20, TOP_K_SELECT_LIMIT, 20, 0, TOP_K_SELECT_LIMIT + 1])
    top_p = torch.rand(rows, generator=gen) * 0.9 + 0.1
    top_p[3:5] = 1.0
    top_p[5] = 1e-46
    temps = torch.rand(rows, generator=gen) + 0.3
    temps[6] = 0.0

    def ref(x, k, p):
        return apply_top_k_top_p_ref(x.float() / torch.where(temps > 0, temps, 1.0)[:, None], k, p)
    for k in (top_k, torch.full((rows,), 20), torch.zeros(rows, dtype=torch.long)):   # several groups, one
        for p in (top_p, None):
            expected = ref(logits, k, p)
            assert torch.equal(apply_top_k_top_p(logits, k, p, k.tolist(), temps), expected)
    assert (ref(logits, top_k, None).isfinite().sum(-1) == torch.where(top_k > 0, top_k, vocab)).all()
    bf16 = (torch.stack([torch.randperm(200, generator=gen) for _ in range(rows)]) - 100).to(torch.bfloat16)
    k_small = top_k.clamp(max=150)
    out = apply_top_k_top_p(bf16, k_small, top_p, k_small.tolist(), temps)
    assert out.dtype == torch.float32 and torch.equal(out, ref(bf16, k_small, top_p))
    # A top_k above the vocabulary keeps all of it.
    small = logits[:, :300]
    big_k = torch.full((rows,), 500)
    assert torch.equal(apply_top_k_top_p(small, big_k, top_p, big_k.tolist(), temps), ref(small, big_k, top_p))


def test_a_rows_sets_do_not_depend_on_the_rows_beside_it():
    """bf16 logits tie often: which of the tokens tied at the k-th place or at the nucleus' edge a
    row keeps must not change with the other rows of its step (a seeded request then draws the
    same whatever shares its step). Row 0 alone, and beside rows with no top_k, a wider top_k and
    the same one."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randint(0, 6, (4, 3000), generator=gen) * 0.5).to(torch.bfloat16)
    temps = torch.tensor([0.7, 1.0, 0.9, 0.5])
    for k0 in (2, 20, 200):
        for p in (None, torch.tensor([0.3, 0.9, 0.5, 1.0])):
            ks = torch.tensor([k0, 0, 500, k0])
            alone = apply_top_k_top_p(logits[:1], ks[:1], None if p is None else p[:1], [k0], temps[:1])
            batch = apply_top_k_top_p(logits, ks, p, ks.tolist(), temps)
            assert torch.equal(alone[0], batch[0])
            if p is None:
                assert torch.isfinite(alone[0]).sum() == k0


def test_the_sampler_draws_from_the_reference_sets():
    """The sampler's seeded draws with top-k/top-p equal the exponential race run over the
    reference's masked logits with the same noise."""
    from mini_engine.kernels.sampling import exponential_noise_ref, sample_ref
    logits = torch.randn(6, 3000, generator=torch.Generator().manual_seed(5))
    top_k, top_p, seeds = [20, 20, 5, 40, 1, 0], [0.95, 1.0, 0.5, 0.9, 0.95, 0.3], [1, 2, 3, 4, 5, 6]
    drawn = Sampler()(logits, tensors([0.6] * 6, top_k=top_k, top_p=top_p, row_seeds=seeds))
    masked = apply_top_k_top_p_ref(logits / 0.6, torch.tensor(top_k), torch.tensor(top_p))
    expected = sample_ref(masked, torch.ones(6), exponential_noise_ref(6, 3000, seeds, logits.device))
    assert torch.equal(drawn, expected)
