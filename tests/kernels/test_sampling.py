import pytest
import torch

pytest.importorskip("triton")
from mini_engine.kernels.sampling import _U_MAX, _U_MIN, sample  # noqa: E402
from mini_engine.kernels.triton_utils import tl, triton  # noqa: E402
from mini_engine.layers.sampler import Sampler, SamplingTensors  # noqa: E402


@triton.jit
def _one_program_per_row_kernel(logits_ptr, temperatures_ptr, seeds_ptr, tokens_ptr, vocab_size, stride_logits,
                                U_MIN: tl.constexpr, U_MAX: tl.constexpr, BLOCK_V: tl.constexpr):
    """The reference: one program walks its row's whole vocabulary in column order, and column c's
    noise is picked out of Philox(seed, c // 4)'s four uniforms by c % 4 (the kernel under test
    makes the same noise four columns at a time)."""
    row = tl.program_id(0).to(tl.int64)
    temperature = tl.load(temperatures_ptr + row)
    seed = tl.load(seeds_ptr + row)
    # Greedy rows keep scale 1: their keys are the logits, so ties stay ties and argmax is exact.
    scale = tl.where(temperature > 0.0, 1.4426950408889634 / tl.where(temperature > 0.0, temperature, 1.0), 1.0)
    best_key = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_col = tl.zeros([BLOCK_V], tl.int32)
    for start in range(0, vocab_size, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        key = tl.load(logits_ptr + row * stride_logits + cols, mask=cols < vocab_size, other=float("-inf"))
        key = key.to(tl.float32) * scale
        if temperature > 0.0:
            u0, u1, u2, u3 = tl.rand4x(seed, cols // 4)
            word = cols % 4
            u = tl.where(word == 0, u0, tl.where(word == 1, u1, tl.where(word == 2, u2, u3)))
            key = key + -tl.math.log2(-tl.math.log2(tl.minimum(tl.maximum(u, U_MIN), U_MAX)))
        better = key > best_key
        best_key = tl.where(better, key, best_key)
        best_col = tl.where(better, cols, best_col)
    top = tl.max(best_key, axis=0)
    tl.store(tokens_ptr + row, tl.min(tl.where(best_key == top, best_col, vocab_size), axis=0).to(tl.int64))


def sample_one_program(logits, temperatures, seeds):
    tokens = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
    _one_program_per_row_kernel[(logits.shape[0],)](logits, temperatures, seeds, tokens, logits.shape[1],
                                                    logits.stride(0), U_MIN=_U_MIN, U_MAX=_U_MAX,
                                                    BLOCK_V=min(triton.next_power_of_2(logits.shape[1]), 1024))
    return tokens


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


# ---- the vocabulary split across programs ----

CHUNK_SIZES = (None, 64, 128, 256)      # None: the default (one chunk at these vocabularies)


@pytest.mark.parametrize("vocab_size", [700, 1000, 1024])     # 700, 1000: not a multiple of any chunk size
def test_split_equals_one_program_reference(device, vocab_size):
    gen = torch.Generator().manual_seed(vocab_size)
    logits = (3 * torch.randn(8, vocab_size, generator=gen)).to(device)
    logits[3, vocab_size - 1] = 50.0                              # greedy winner in the last, partial chunk
    temperatures = torch.tensor([0.0, 1.0, 0.5, 0.0, 2.0, 0.0, 0.7, 1.0], device=device)
    seeds = torch.randint(0, 2**31, (8,), generator=gen).to(device)
    expected = sample_one_program(logits, temperatures, seeds)
    assert expected[3] == vocab_size - 1
    for chunk_size in CHUNK_SIZES:
        assert torch.equal(sample(logits, temperatures, seeds, chunk_size), expected), chunk_size
    greedy = temperatures == 0                                      # mixed batch: greedy rows are argmax
    assert torch.equal(expected[greedy], logits[greedy].argmax(-1))
    assert not torch.equal(expected[~greedy], logits[~greedy].argmax(-1))


def test_ties_across_chunks_go_to_the_lowest_column(device):
    vocab_size = 1000
    logits = torch.randn(5, vocab_size, generator=torch.Generator().manual_seed(3)).to(device)
    logits[0, [70, 200]] = 9.0              # chunks 1 and 3 at chunk size 64
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
    logits = torch.full((2 * len(where), vocab_size), float("-inf"), device=device)
    for row, col in enumerate(where + where):
        logits[row, col] = -30.0 if row % 2 else 30.0
    temperatures = torch.tensor([0.0] * len(where) + [1e-3, 1.0, 5.0, 100.0, 1.0], device=device)
    for chunk_size in CHUNK_SIZES:
        for step in range(3):
            tokens = sample(logits, temperatures, torch.arange(len(temperatures), device=device) + 1000 * step,
                            chunk_size)
            assert tokens.tolist() == where + where, (chunk_size, step)
    all_masked = torch.full((1, vocab_size), float("-inf"), device=device)
    assert sample(all_masked, torch.ones(1, device=device), torch.zeros(1, dtype=torch.int64, device=device),
                  64).item() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_input_equals_fp32_of_the_rounded_logits(device, dtype):
    gen = torch.Generator().manual_seed(4)
    low = (4 * torch.randn(6, 900, generator=gen)).to(dtype).to(device)
    low[1, 10:] = float("-inf")
    temperatures = torch.tensor([0.0, 1.0, 0.8, 0.0, 1.5, 1.0], device=device)
    seeds = torch.randint(0, 2**31, (6,), generator=gen).to(device)
    for chunk_size in (None, 128):
        assert torch.equal(sample(low, temperatures, seeds, chunk_size), sample(low.float(), temperatures, seeds))


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
    """151,936 columns: 149 chunks of 1024 at B=2, the last one partial."""
    gen = torch.Generator().manual_seed(6)
    logits = (3 * torch.randn(2, 151936, generator=gen)).to(device)
    temperatures, seeds = torch.tensor([0.0, 0.9], device=device), torch.tensor([5, 123456789], device=device)
    expected = sample_one_program(logits, temperatures, seeds)
    assert expected[0] == logits[0].argmax()
    assert torch.equal(sample(logits, temperatures, seeds), expected)
