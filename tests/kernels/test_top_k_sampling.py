"""The top-k sampler's kernels against their PyTorch references. Through Triton's interpreter a
chunk of 4,096 columns is slow, so most tests shrink the blocks (chunks of 64 columns in groups of
16, the best 8 kept, lists of 64 sorted whole up to 16): the same code, each of its three ways
to the best of a row reached at small vocabularies."""
import pytest
import torch

pytest.importorskip("triton")
from mini_engine.kernels import top_k_sampling  # noqa: E402
from mini_engine.kernels.sampling import apply_top_k_top_p_ref, uniforms  # noqa: E402
from mini_engine.kernels.top_k_sampling import (candidate_keys_ref, decode_keys, sample_top_k,  # noqa: E402
                                                sample_top_k_ref)

NOT_DRAWN = -5


@pytest.fixture
def small_blocks(monkeypatch):
    for name, value in (("CHUNK", 64), ("GROUP", 16), ("TOP_K_MAX", 8), ("SHORT_LIST", 16), ("LIST_SIZE", 64)):
        monkeypatch.setattr(top_k_sampling, name, value)


def structured_rows(vocab: int) -> torch.Tensor:
    """Plain noise, a constant row (every column a candidate: the list overflows, and the row is
    searched whole), one of -inf with a few finite columns, logits on a coarse grid (ties within
    and across chunks; a long list), -0.0 beside 0.0, and a row whose best lie in its last,
    partial chunk."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(6, vocab, generator=gen)
    rows[1] = 0.25
    rows[2] = float("-inf")
    rows[2, [3, vocab // 2, vocab - 1]] = torch.tensor([1.0, 2.0, 1.0])
    rows[3] = (rows[3] * 2).round() / 2
    rows[4] = torch.where(torch.arange(vocab) % 2 == 0, 0.0, -0.0)
    rows[4, 7] = 1.0
    rows[5, -5:] += 10.0
    return rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_candidates_are_the_stable_sorts_first(device, small_blocks, dtype):
    """The kernels' best keys of every drawn row equal the stable sort's first TOP_K_MAX, ties to the
    lower column, -inf left out; through a short list, a long one and an overflowing one. 150
    columns: chunks of 64, 64 and 22."""
    logits = structured_rows(150).to(dtype).to(device)
    n = logits.shape[0]
    out = torch.full((n,), NOT_DRAWN, device=device)
    best, counts = sample_top_k(logits, torch.ones(n, device=device),
                                torch.full((n,), 3, dtype=torch.int32, device=device), torch.ones(n, device=device),
                                torch.arange(n, device=device), out)
    assert torch.equal(best.cpu(), candidate_keys_ref(logits.cpu()))
    counts = counts.tolist()
    assert counts[1] == 150 and counts[2] == 3 and any(16 < c <= 64 for c in counts)   # the three ways
    values, cols = decode_keys(best.cpu())
    sorted_values, sorted_cols = logits.cpu().float().sort(dim=-1, descending=True, stable=True)
    finite = best.cpu() != top_k_sampling.MIN_KEY
    assert torch.equal(cols[finite], sorted_cols[:, :8][finite]) and torch.equal(values[finite],
                                                                                sorted_values[:, :8][finite])
    assert finite.sum(-1).tolist() == [8, 8, 3, 8, 8, 8]


def test_candidates_at_the_default_blocks(device):
    """The module's own blocks (chunks of 4,096 in groups of 1,024, the best 64): two full chunks and
    a partial one."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 2 * 4096 + 400, generator=gen).to(torch.bfloat16).to(device)
    logits[1, 5000:5070] += 10.0                                # the best 64 in one chunk
    out = torch.full((2,), NOT_DRAWN, device=device)
    best, counts = sample_top_k(logits, torch.ones(2, device=device),
                                torch.tensor([20, 64], dtype=torch.int32, device=device), torch.ones(2, device=device),
                                torch.arange(2, device=device), out)
    assert torch.equal(best.cpu(), candidate_keys_ref(logits.cpu()))
    assert set(decode_keys(best.cpu())[1][1].tolist()) < set(range(5000, 5070))


def near_an_edge(logits: torch.Tensor, temperature: float, k: int, top_p: float, u: float) -> bool:
    """Is the row's draw or nucleus within float32 rounding of a boundary (where the kernel's float32
    and the reference's float64 may part)?"""
    v = logits.double().sort(descending=True, stable=True).values[:k]
    weight = torch.exp((v - v[0]) / temperature)
    total = weight.sum()
    before = weight.cumsum(0) - weight
    if ((before - top_p * total).abs() < 1e-5 * total).any():
        return True
    kept = torch.where(before < top_p * total, weight, 0.0)
    kept[0] = weight[0]
    prefix = kept.cumsum(0)
    return bool(((prefix - u * prefix[-1]).abs() < 1e-5 * prefix[-1]).any())


def test_draws_equal_the_reference_at_the_same_uniform(device, small_blocks):
    """Each drawn row's token is the reference's for the same uniform, over top_k (1 to all 8,
    and more than the row's columns), top_p and temperature; greedy rows and rows without top_k
    keep what out held."""
    vocab = 100
    gen = torch.Generator().manual_seed(2)
    n = 40
    logits = (torch.randn(n, vocab, generator=gen) * 2).to(device)
    logits[5] = float("-inf")                           # every weight 0: the first candidate
    logits[6, 40:] = float("-inf")
    top_k = torch.randint(1, 9, (n,), generator=gen, dtype=torch.int32)
    top_k[[7, 8]] = 0
    top_p = torch.rand(n, generator=gen) * 0.9 + 0.1
    top_p[::4] = 1.0
    temperatures = torch.rand(n, generator=gen) * 1.5 + 0.2
    temperatures[[9, 10]] = 0.0
    seeds = torch.randint(0, 2**31, (n,), generator=gen)
    out = torch.full((n,), NOT_DRAWN, device=device)
    sample_top_k(logits, temperatures.to(device), top_k.to(device), top_p.to(device), seeds.to(device), out)
    u = uniforms(seeds.to(device)).cpu()
    ref = sample_top_k_ref(logits.cpu(), temperatures, top_k, top_p, u, torch.full((n,), NOT_DRAWN))
    edges = [r for r in range(n) if top_k[r] > 0 and temperatures[r] > 0 and r != 5
             and near_an_edge(logits[r].cpu(), float(temperatures[r]), int(top_k[r]), float(top_p[r]), float(u[r]))]
    assert len(edges) <= 2
    same = [r for r in range(n) if r not in edges]
    assert out.cpu()[same].tolist() == ref[same].tolist()
    assert out.cpu()[[7, 8, 9, 10]].tolist() == [NOT_DRAWN] * 4 and out[5] == 0


def test_reference_draws_follow_the_restricted_softmax():
    """sample_top_k_ref over a fine grid of uniforms: each token drawn in proportion to its
    probability under the definition (apply_top_k_top_p_ref, then softmax at the temperature)."""
    gen = torch.Generator().manual_seed(3)
    row = torch.randn(1, 50, generator=gen)
    row[0, 10] = row[0, 11] = row.max() + 0.5             # a tie at the top
    grid = 4_000
    u = (torch.arange(grid) + 0.5) / grid
    for k, p, t in ((5, 1.0, 1.0), (20, 0.7, 0.8), (50, 0.95, 1.3), (3, 0.01, 1.0)):
        logits = row.expand(grid, -1)
        tokens = sample_top_k_ref(logits, torch.full((grid,), t), torch.full((grid,), k), torch.full((grid,), p), u,
                                  torch.zeros(grid, dtype=torch.int64))
        probs = apply_top_k_top_p_ref(row / t, torch.tensor([k]), torch.tensor([p])).softmax(-1)[0].double()
        freq = torch.bincount(tokens, minlength=50).double() / grid
        assert (freq - probs).abs().max() < 2 / grid, (k, p, t)
