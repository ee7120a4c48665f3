import math

import pytest
import torch

pytest.importorskip("triton")
from mini_engine.kernels import sampling  # noqa: E402
from mini_engine.kernels.sampling import _chunk_stats, _select, sample  # noqa: E402
from mini_engine.layers.sampler import Sampler, SamplingTensors  # noqa: E402

NEG_INF = float("-inf")


def spread_seeds(num: int, device, salt: int = 0) -> torch.Tensor:
    return ((torch.arange(num) * 1_000_003 + salt) % 2**31).to(device)


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


# ---- the vocabulary split across programs ----

CHUNK_SIZES = (None, 64, 100, 256)      # None: the default (one chunk at these vocabularies); 100: not a power of 2


@pytest.mark.parametrize("chunk_size", [None, 100])
def test_a_rows_token_does_not_depend_on_the_batch(device, chunk_size):
    """Each row's programs read that row alone: the same row (logits, temperature, seed) gives the same
    token alone, in another order, repeated, or among rows it has never met."""
    gen = torch.Generator().manual_seed(8)
    logits = (2 * torch.randn(6, 700, generator=gen)).to(device)
    logits[2, 350:] = NEG_INF
    temperatures = torch.tensor([1.0, 0.0, 0.7, 1.0, 2.0, 0.3], device=device)
    seeds = torch.randint(0, 2**31, (6,), generator=gen).to(device)
    tokens = sample(logits, temperatures, seeds, chunk_size)
    for rows in ([3], [5, 0], [4, 2, 1], [1, 3, 3, 0]):
        assert torch.equal(sample(logits[rows], temperatures[rows], seeds[rows], chunk_size), tokens[rows]), rows
    strangers = (5 * torch.randn(3, 700, generator=gen)).to(device)
    mixed = torch.cat([strangers[:2], logits[[4]], strangers[2:]])
    mixed_t = torch.tensor([0.0, 1.5, 2.0, 1.0], device=device)
    mixed_seeds = torch.tensor([1, 2, seeds[4].item(), 3], device=device)
    assert sample(mixed, mixed_t, mixed_seeds, chunk_size)[2] == tokens[4]


@pytest.mark.parametrize("block_v", [None, 16])        # 16: several tiles a chunk, ties within a lane
def test_ties_across_chunks_go_to_the_lowest_column(device, monkeypatch, block_v):
    if block_v:
        monkeypatch.setattr(sampling, "_BLOCK_V", block_v)
    vocab_size = 1000
    logits = torch.randn(5, vocab_size, generator=torch.Generator().manual_seed(3)).to(device)
    logits[0, [70, 86, 200]] = 9.0          # chunks 1 and 3 at chunk size 64; 70 and 86: one lane of 16
    logits[1, [63, 64]] = 9.0               # either side of a chunk boundary
    logits[2, [999, 5, 640]] = 9.0          # the last, partial chunk, the first and a middle one
    logits[3, [130, 131]] = 9.0             # the same chunk, neighbouring lanes
    logits[4] = 1.0                         # every column ties
    zeros, seeds = torch.zeros(5, device=device), torch.arange(5, device=device)
    for chunk_size in CHUNK_SIZES:
        assert sample(logits, zeros, seeds, chunk_size).tolist() == [70, 63, 5, 130, 0], chunk_size


def test_single_finite_column_always_wins(device):
    vocab_size = 777
    where = [0, 63, 64, 500, 776]           # first, either side of a boundary, middle, last (partial chunk)
    logits = torch.full((2 * len(where), vocab_size), NEG_INF, device=device)
    for row, col in enumerate(where + where):
        logits[row, col] = -30.0 if row % 2 else 30.0
    temperatures = torch.tensor([0.0] * len(where) + [1e-3, 1.0, 5.0, 100.0, 1.0], device=device)
    for chunk_size in CHUNK_SIZES:
        for step in range(3):
            tokens = sample(logits, temperatures, torch.arange(len(temperatures), device=device) + 1000 * step,
                            chunk_size)
            assert tokens.tolist() == where + where, (chunk_size, step)
    all_masked = torch.full((2, vocab_size), NEG_INF, device=device)
    assert sample(all_masked, torch.tensor([1.0, 0.0], device=device), torch.zeros(2, dtype=torch.int64, device=device),
                  64).tolist() == [0, 0]


def chunk_stats_ref(logits: torch.Tensor, temperatures: torch.Tensor, chunk_size: int):
    """_chunk_stats in float64: each chunk's max logit, sum of exp2((l - max) * log2(e) / T) and first
    column of the max, for every row (the kernel writes the sum for sampling rows, the column for
    greedy ones)."""
    rows, vocab_size = logits.shape
    scale = math.log2(math.e) / torch.where(temperatures > 0, temperatures.double(), 1.0)
    num_chunks = -(-vocab_size // chunk_size)
    x = torch.full((rows, num_chunks * chunk_size), NEG_INF, dtype=torch.float64)
    x[:, :vocab_size] = logits.double().cpu()
    x = x.view(rows, num_chunks, chunk_size)
    top = x.amax(-1)
    total = torch.exp2((x - torch.where(top > NEG_INF, top, 0.0)[..., None]) * scale.cpu()[:, None, None]).sum(-1)
    col = (x == top[..., None]).int().argmax(-1) + chunk_size * torch.arange(num_chunks)
    return top, total, col


@pytest.mark.parametrize("vocab_size, chunk_size, block_v", [(5000, None, None), (1000, 100, 16), (1000, 64, None)])
def test_chunk_stats_match_float64(device, monkeypatch, vocab_size, chunk_size, block_v):
    """The first kernel against float64: whole and partial tiles and chunks, a chunk of -inf (max -inf,
    sum 0, no NaN), a row of -inf, a greedy row and a temperature of 1e-3 (a scale of ~1,443, where
    a difference rounded after scaling would show). Each row's max; a sampling row's sum (its
    column is the chunk's first); a greedy row's column of the max (its sum 0: nothing reads it)."""
    if block_v:
        monkeypatch.setattr(sampling, "_BLOCK_V", block_v)
    chunk_size = chunk_size or sampling.SAMPLE_CHUNK_SIZE
    gen = torch.Generator().manual_seed(9)
    logits = 3 * torch.randn(5, vocab_size, generator=gen)
    logits[2, 100:300] = NEG_INF
    logits[3] = NEG_INF
    temperatures = torch.tensor([0.0, 0.7, 1.0, 1.0, 1e-3])
    top, total, col = (t.cpu() for t in _chunk_stats(logits.to(device), temperatures.to(device), chunk_size))
    ref_top, ref_total, ref_col = chunk_stats_ref(logits, temperatures, chunk_size)
    greedy = temperatures == 0
    assert not total.isnan().any() and (total[ref_top == NEG_INF] == 0).all()
    torch.testing.assert_close(top.double(), ref_top, rtol=1e-6, atol=0)
    torch.testing.assert_close(total[~greedy].double(), ref_total[~greedy], rtol=1e-5, atol=0)
    assert (total[greedy] == 0).all()
    assert torch.equal(col[greedy].long(), ref_col[greedy])
    first_cols = chunk_size * torch.arange(top.shape[1])
    assert torch.equal(col[~greedy].long(), first_cols.expand(int((~greedy).sum()), -1))


# ---- the distribution ----

def chi_square_bound(dof: int, z: float = 5.0) -> float:
    """Upper quantile of chi-square(dof) z standard deviations out (Wilson-Hilferty, which errs high):
    z = 5 is a false-alarm probability of 3e-7."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def draw(row: torch.Tensor, temperature: float, num_draws: int, chunk_size: int, salt: int = 0,
         edit_stats=None) -> torch.Tensor:
    """num_draws samples of one row, one seed each. The first kernel runs once, on the row alone: its
    statistics depend on nothing else, so each draw gets a copy of them (the interpreter pays some
    milliseconds a program). edit_stats(chunk_max, chunk_sum, chunk_col) may change them first."""
    temps = torch.full((num_draws,), temperature, device=row.device)
    seeds = spread_seeds(num_draws, row.device, salt)
    stats = _chunk_stats(row[None], temps[:1], chunk_size)
    if edit_stats is None:      # the shortcut is the real thing: the first draws through sample() itself
        assert torch.equal(_select(row[None], temps[:1], seeds[:1], *stats, chunk_size),
                           sample(row[None], temps[:1], seeds[:1], chunk_size))
    else:
        edit_stats(*stats)
    stats = [s.expand(num_draws, -1).contiguous() for s in stats]
    return _select(row.expand(num_draws, -1), temps, seeds, *stats, chunk_size)


def assert_softmax_distribution(tokens: torch.Tensor, row: torch.Tensor, temperature: float):
    """Chi-square goodness of fit of the draws against softmax(row / T) in float64. Columns expected
    fewer than 5 times are pooled into one bin (with the least likely other column if the pool is
    still under 5). A -inf column is never drawn."""
    num_draws = tokens.numel()
    probs = (row.double().cpu() / temperature).softmax(-1)
    counts = torch.bincount(tokens.cpu(), minlength=row.numel()).double()
    assert counts[probs == 0].sum() == 0
    expected = probs * num_draws
    pooled = expected < 5
    if expected[pooled].sum() < 5:
        pooled[torch.where(pooled, math.inf, expected).argmin()] = True
    expected = torch.cat([expected[~pooled], expected[pooled].sum()[None]])
    observed = torch.cat([counts[~pooled], counts[pooled].sum()[None]])
    chi2 = ((observed - expected) ** 2 / expected).sum().item()
    dof = expected.numel() - 1
    assert chi2 < chi_square_bound(dof), f"chi2 {chi2:.1f}, dof {dof}, observed {observed.tolist()}"


@pytest.mark.parametrize("temperature, chunk_size, block_v", [(1.0, 8, None), (0.6, 10, 4)])
def test_distribution_matches_softmax_across_chunks(device, monkeypatch, temperature, chunk_size, block_v):
    """40 columns, three of them -inf, in chunks of 8 (five chunks of one tile), or of 10 in tiles of
    4 (4 + 4 + 2: the running max and sum carried across tiles, and the scan's prefix)."""
    if block_v:
        monkeypatch.setattr(sampling, "_BLOCK_V", block_v)
    row = torch.randn(40, generator=torch.Generator().manual_seed(7))
    row[[3, 17, 31]] = NEG_INF
    assert_softmax_distribution(draw(row.to(device), temperature, 300, chunk_size), row, temperature)


def test_distribution_in_a_late_partial_chunk(device):
    """Most of the mass in the last chunk: columns 35-39 of 40 in chunks of 7 (not a power of 2, so
    each chunk ends inside a tile), the rest spread thin. The chunk search has to walk the whole
    prefix, and the last chunk stops at the end of the row."""
    row = torch.full((40,), -2.0)
    row[35:] = torch.tensor([1.0, 2.5, NEG_INF, 2.0, 0.5])
    assert_softmax_distribution(draw(row.to(device), 0.8, 200, 7), row, 0.8)


def test_distribution_either_side_of_a_chunk_boundary(device):
    """Most of the mass on columns 7 | 8 and 15 | 16, the boundaries of chunks of 8: an off-by-one in
    the chunk or the column search moves draws across them."""
    row = torch.full((24,), -3.0)
    row[[7, 8, 15, 16]] = torch.tensor([2.0, 1.0, 0.0, 1.5])
    assert_softmax_distribution(draw(row.to(device), 1.0, 200, 8), row, 1.0)


def zero_probability_row(device) -> tuple[torch.Tensor, list[int]]:
    """32 columns in chunks of 8; every chunk ends with columns of probability 0: -inf, or -200, whose
    exp2((l - max) * log2(e)) underflows in fp32. Chunk 1 is all -200 (its weight is 0), and the row
    ends with them, after the column where the largest draws (u near 1) land."""
    row = torch.full((32,), NEG_INF)
    row[0:6] = torch.tensor([0.5, -1.0, 1.0, 0.0, 0.3, -0.5])
    row[6] = -200.0
    row[8:16] = -200.0
    row[16:21] = torch.tensor([1.5, 0.0, -0.3, 0.8, 0.2])
    row[22] = -200.0
    row[24:29] = torch.tensor([0.1, 1.2, -1.0, 0.4, 2.0])
    row[[29, 31]] = -200.0
    return row.to(device), [6, 7, *range(8, 16), 21, 22, 23, 29, 30, 31]


def test_zero_probability_columns_are_never_drawn(device):
    row, dead = zero_probability_row(device)
    tokens = draw(row, 1.0, 200, 8)
    assert not torch.isin(tokens, torch.tensor(dead, device=device)).any()
    assert_softmax_distribution(tokens, row.cpu(), 1.0)
    lone = torch.full((1, 32), -200.0, device=device)
    lone[0, 13] = 3.0                     # every other column underflows: always column 13
    for step in range(3):
        assert sample(lone, torch.ones(1, device=device), spread_seeds(1, device, step), 8).item() == 13


def test_select_when_a_chunks_columns_fall_short_of_its_weight(device):
    """The kernels group their sums differently, so a chunk's columns can add up to a hair less than
    the weight the first kernel gave it, and a draw at the very end of its interval reaches no column.
    Too rare to meet through seeds, so here the statistics overstate chunk 1's weight fourfold: three
    quarters of the draws that land in it reach no column and take its last column of nonzero
    probability (9), never the dead columns after it, nor the next chunk's columns that its last
    tile also covers (chunks of 6, tiles of 8)."""
    row = torch.full((24,), NEG_INF)
    row[0:5] = torch.tensor([0.5, 1.0, 0.0, -0.5, -200.0])
    row[6:11] = torch.tensor([1.0, 0.2, 0.8, 0.5, -200.0])
    row[12:18] = torch.tensor([0.3, 1.2, -0.4, 0.9, 0.1, -200.0])
    row[18:23] = torch.tensor([0.7, -0.2, 1.1, 0.4, -200.0])
    row = row.to(device)
    dead = torch.tensor([4, 5, 10, 11, 17, 22, 23], device=device)

    def overstate(chunk_max, chunk_sum, chunk_col):
        chunk_sum[0, 1] *= 4

    tokens = draw(row, 1.0, 200, 6, salt=1, edit_stats=overstate)
    assert not torch.isin(tokens, dead).any()
    assert (tokens == 9).sum() > 50       # ~95 expected; ~11 without the overstatement

    def vanish(chunk_max, chunk_sum, chunk_col):
        # A chunk max so far above every key that exp2(key - max) is 0 on all of the chunk's columns:
        # its own argmax column is the answer.
        chunk_max[0, 3] = 300.0

    assert draw(row, 1.0, 5, 6, salt=2, edit_stats=vanish).tolist() == [20] * 5


# ---- precision and layers ----

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_input_equals_fp32_of_the_rounded_logits(device, dtype):
    gen = torch.Generator().manual_seed(4)
    low = (4 * torch.randn(6, 900, generator=gen)).to(dtype).to(device)
    low[1, 10:] = NEG_INF
    temperatures = torch.tensor([0.0, 1.0, 0.8, 0.0, 1.5, 1.0], device=device)
    seeds = torch.randint(0, 2**31, (6,), generator=gen).to(device)
    for chunk_size in (None, 128):
        expected = sample(low.float(), temperatures, seeds, chunk_size)
        assert torch.equal(sample(low, temperatures, seeds, chunk_size), expected), chunk_size


def test_sampler_layer_passes_bf16_straight_to_the_kernel(device, monkeypatch):
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 600, generator=gen).to(torch.bfloat16).to(device)
    temps = torch.tensor([0.0, 1.0, 0.5, 1.0], device=device)
    params = SamplingTensors(temperatures=temps, top_k=None, top_p=None, seeds=torch.arange(4, device=device),
                             row_seeds=[0, 1, 2, 3], all_greedy=False)
    expected = sample(logits.float(), temps, params.seeds)
    monkeypatch.setattr(torch.Tensor, "float", lambda self: pytest.fail("the Triton path copied the logits to fp32"))
    assert torch.equal(Sampler(use_triton=True)(logits, params), expected)
    params.all_greedy, params.temperatures = True, torch.zeros(4, device=device)
    assert torch.equal(Sampler(use_triton=True)(logits, params), logits.argmax(-1))


def test_default_chunking_at_qwen3_vocabulary(device):
    """151,936 columns: 38 chunks of 4096 a row, the last one partial."""
    vocab_size = 151936
    gen = torch.Generator().manual_seed(6)
    logits = (3 * torch.randn(5, vocab_size, generator=gen)).to(device)
    live = [5, 4095, 4096, 80000, vocab_size - 1]          # the first chunk, either side of a boundary, the last
    logits[2:] = NEG_INF
    logits[2:, live] = torch.tensor([0.0, 1.0, 1.0, 0.5, 1.5], device=device)
    temperatures = torch.tensor([0.0, 0.9, 1.0, 1.0, 1.0], device=device)
    seeds = torch.tensor([5, 123456789, 1, 2, 3], device=device)
    tokens = sample(logits, temperatures, seeds)
    assert tokens[0] == logits[0].argmax()
    assert set(tokens[2:].tolist()) <= set(live)
    assert sample(logits[1:2], temperatures[1:2], seeds[1:2]) == tokens[1]


def test_distribution_at_qwen3_vocabulary(device):
    """The distribution over all 38 default chunks of a 151,936-column row: live columns in the
    first chunk, on either side of a boundary, beyond chunk 16 (BLOCK_CHUNKS' smallest size) and in
    the last, partial one, most of the mass past column 65,536."""
    vocab_size = 151936
    live = [5, 4095, 4096, 40000, 65535, 65536, 70000, 100000, 131072, 150000, vocab_size - 1]
    row = torch.full((vocab_size,), NEG_INF)
    row[live] = torch.tensor([-1.0, -0.5, 0.0, -1.0, 0.0, 1.0, 0.5, 1.0, 0.0, 0.5, 1.5])
    assert_softmax_distribution(draw(row.to(device), 1.0, 300, sampling.SAMPLE_CHUNK_SIZE), row, 1.0)
