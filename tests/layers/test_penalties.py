"""Penalties and min_p (layers/penalties.py) against their definitions, written out a token at a time."""
import math
import random

import numpy as np
import pytest
import torch

from mini_engine.layers.penalties import (PenaltyState, allowed_token_tensors, apply_logit_bias, apply_min_p,
                                         apply_penalties, ban_tokens, banned_token_tensors, keep_allowed_tokens,
                                         logit_bias_tensors, output_counts_ref, penalty_tensors)
from mini_engine.kernels.top_k_sampling import TOP_K_MAX
from mini_engine.layers.sampler import Sampler, SamplingTensors
from mini_engine.runner.batch import BatchRow
from mini_engine.sampling_params import SamplingParams
from tests.penalty_definition import penalised_by_definition

VOCAB = 50
# On the GPU where there is one: there the host's arrays cross by pinned, asynchronous copies.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_rows(seed: int, num_rows: int = 5):
    """Token histories (prompt then output; some with no output yet), their prompt lengths and
    penalties, every value non-neutral somewhere."""
    rng = random.Random(seed)
    histories, num_prompt, params = [], [], []
    for _ in range(num_rows):
        n = rng.randrange(1, 8)
        histories.append([rng.randrange(VOCAB) for _ in range(n + rng.randrange(0, 12))])
        num_prompt.append(n)
        params.append(SamplingParams(presence_penalty=rng.uniform(-2, 2), frequency_penalty=rng.uniform(-2, 2),
                                     repetition_penalty=rng.uniform(0.5, 2.0)))
    return histories, num_prompt, params


def before_newest(histories: list[list[int]]) -> list[np.ndarray]:
    return [np.asarray(h[:-1], dtype=np.int64) for h in histories]


def filled_state(histories, num_prompt, state_rows, num_state_rows: int = 8, device: str = DEVICE) -> PenaltyState:
    """A state whose rows state_rows hold the histories' counts, filled as the runner fills them:
    the host sends the tokens before the newest (it may not know the newest yet), the device
    reads the newest. The other rows hold junk, as a row released by another request does."""
    state = PenaltyState.allocate(num_state_rows, VOCAB, torch.device(device))
    state.output_counts.random_(0, 5)
    state.prompt_seen.random_(0, 2)
    newest = torch.tensor([h[-1] for h in histories], device=device)
    state.fill(state_rows, before_newest(histories), num_prompt, newest)
    return state


@pytest.mark.parametrize("seed", range(4))
def test_a_fill_then_records_equal_the_token_by_token_count(seed):
    """A row filled from part of a history, then given the rest a sampled token at a time, holds
    the counts of the whole history: prompt tokens as seen, output tokens counted."""
    histories, num_prompt, _ = random_rows(seed)
    state_rows = [6, 1, 3, 0, 4]
    # A row is filled when its request first samples in it: the prompt at least.
    cut = [random.Random(seed + i).randrange(n, len(h) + 1) for i, (h, n) in enumerate(zip(histories, num_prompt))]
    state = filled_state([h[:c] for h, c in zip(histories, cut)], num_prompt, state_rows)
    for position in range(max(len(h) for h in histories)):
        j = [i for i, (h, c) in enumerate(zip(histories, cut)) if c <= position < len(h)]
        if j:
            state.record(torch.tensor([state_rows[i] for i in j], device=DEVICE),
                         torch.tensor([histories[i][position] for i in j], device=DEVICE))
    counts, prompt = output_counts_ref(histories, num_prompt, VOCAB)
    assert torch.equal(state.output_counts[state_rows].cpu(), counts)
    assert torch.equal(state.prompt_seen[state_rows].cpu(), prompt)
    assert counts.sum() > 0 and prompt.sum() > 0


def test_the_newest_token_counts_where_it_belongs():
    """A history whose newest token is the prompt's last marks it seen; one past the prompt (a
    preempted request filling its row again) counts it as output."""
    state = filled_state([[3, 4, 9], [3, 4, 9]], [3, 2], [0, 1])
    assert state.prompt_seen[0].nonzero().flatten().tolist() == [3, 4, 9] and state.output_counts[0].sum() == 0
    assert state.prompt_seen[1].nonzero().flatten().tolist() == [3, 4]
    assert state.output_counts[1].nonzero().flatten().tolist() == [9] and state.output_counts[1, 9] == 1


@pytest.mark.parametrize("seed", range(4))
def test_penalties_equal_their_definitions(seed):
    histories, num_prompt, params = random_rows(seed)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(histories) + 2, VOCAB, generator=gen)
    logits[0, histories[0][0]] = float("-inf")            # banned or biased away before the penalties
    # Rows 1 and 3 of the batch have no penalties: they pass through.
    rows, state_rows = [0, 2, 4, 5, 6], [5, 0, 7, 2, 3]
    pt = penalty_tensors(rows, state_rows, params, filled_state(histories, num_prompt, state_rows))
    got = logits.clone().to(DEVICE)
    apply_penalties(got, pt)
    got = got.cpu()
    for i in (1, 3):
        assert torch.equal(got[i], logits[i])
    for row, history, n, p in zip(rows, histories, num_prompt, params):
        want = penalised_by_definition(logits[row], history, n, p)
        torch.testing.assert_close(got[row], want, rtol=1e-6, atol=1e-6)
        assert not torch.equal(got[row], logits[row])
    assert got[0, histories[0][0]] == float("-inf")


def test_repetition_penalty_equals_transformers():
    transformers = pytest.importorskip("transformers")
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, VOCAB, generator=gen)
    histories = [[1, 4, 4, 9], [7], [0, 49, 3, 3, 12]]
    params = [SamplingParams(repetition_penalty=r) for r in (1.3, 0.7, 2.0)]
    pt = penalty_tensors([0, 1, 2], [0, 1, 2], params, filled_state(histories, [2, 1, 5], [0, 1, 2]))
    got = logits.clone().to(DEVICE)
    apply_penalties(got, pt)
    for i, (history, p) in enumerate(zip(histories, params)):
        processor = transformers.RepetitionPenaltyLogitsProcessor(p.repetition_penalty)
        want = processor(torch.tensor([history]), logits[i:i + 1].clone())[0]
        torch.testing.assert_close(got[i].cpu(), want)


def test_min_p_keeps_the_tokens_at_least_min_p_times_the_likeliest():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, VOCAB, generator=gen) * 3
    min_p = torch.tensor([0.1, 0.0, 0.5, 0.3, 1.0])
    temperatures = torch.tensor([1.0, 0.8, 0.0, 0.6, 2.0])
    got = logits.clone()
    apply_min_p(got, min_p, temperatures)
    for row in range(5):
        if min_p[row] == 0 or temperatures[row] == 0:           # off, and greedy: left alone
            assert torch.equal(got[row], logits[row])
            continue
        probs = (logits[row].double() / temperatures[row].item()).softmax(-1)
        keep = probs >= min_p[row].item() * probs.max()
        assert torch.equal(torch.isfinite(got[row]), keep)
        assert torch.equal(got[row][keep], logits[row][keep])
        assert 0 < keep.sum() < VOCAB or min_p[row] == 1.0
    assert torch.isfinite(got[4]).sum() == 1                     # min_p 1: the likeliest alone


def test_sampler_applies_penalties_before_greedy_and_min_p_before_sampling():
    """A greedy row takes the penalised argmax; a sampled row never draws a token min_p removed."""
    logits = torch.zeros(2, VOCAB)
    # At temperature 1 and min_p 0.1: 8 just above a tenth of 7's probability, 9 just below.
    logits[:, 7], logits[:, 8], logits[:, 9] = 5.0, 5.0 - math.log(10) + 0.01, 5.0 - math.log(10) - 0.01
    pt = penalty_tensors([0], [0], [SamplingParams(frequency_penalty=2.0)], filled_state([[1, 7, 7]], [1], [0], device="cpu"))
    params = SamplingTensors(temperatures=torch.tensor([0.0, 1.0]), top_k=None, top_p=None,
                             seeds=torch.tensor([0, 0]), row_seeds=[None, None], all_greedy=False,
                             penalties=pt, min_p=torch.tensor([0.0, 0.1]))
    sampler = Sampler()
    draws = torch.stack([sampler(logits, params) for _ in range(200)])
    assert (draws[:, 0] == 8).all()          # 7's logit 5 - 2 x 2.0 is below 8's 2.71
    assert set(draws[:, 1].tolist()) <= {7, 8} and set(draws[:, 1].tolist()) == {7, 8}


def test_only_what_the_graphs_sampler_cannot_apply_leaves_it():
    """A decode graph samples with temperature, and top-k up to TOP_K_MAX with any top-p; a step
    with a penalty, min_p, a larger top-k or top-p alone on a row that samples takes the eager
    sampler. min_p, top-k and top-p on a greedy row change nothing (vLLM drops them)."""
    from mini_engine.runner.batch import BatchRow
    from mini_engine.runner.model_runner import ModelRunner

    def leaves(**params):
        plain = BatchRow([1], 0, [0], True, SamplingParams(temperature=0.7))
        return ModelRunner.samples_outside_graph([plain, BatchRow([1], 0, [0], True, SamplingParams(**params))])
    assert not leaves(temperature=0.0, min_p=0.2) and not leaves(temperature=1.0)
    assert leaves(temperature=1.0, min_p=0.2) and leaves(temperature=0.0, repetition_penalty=1.1)
    assert leaves(temperature=0.0, presence_penalty=-0.5) and leaves(temperature=1.0, top_p=0.9)
    assert leaves(temperature=1.0, top_k=TOP_K_MAX + 1) and leaves(temperature=1.0, top_k=5, min_p=0.1)
    assert not leaves(temperature=1.0, top_k=5) and not leaves(temperature=0.6, top_k=20, top_p=0.95)
    assert not leaves(temperature=1.0, top_k=TOP_K_MAX) and not leaves(temperature=0.0, top_k=100, top_p=0.5)
    assert leaves(temperature=0.0, allowed_token_ids=[3])


def test_logit_bias_is_added_to_its_tokens_alone_before_the_penalties():
    """vLLM's order: the bias first, so the repetition penalty sees the biased logit's sign."""
    logits = torch.zeros(3, VOCAB)
    logits[:, 3] = -1.0
    params = [SamplingParams(logit_bias={3: 2.0, 7: -100}), SamplingParams(), SamplingParams(logit_bias={0: 0.5})]
    bias = logit_bias_tensors(params, torch.device(DEVICE))
    got = logits.clone().to(DEVICE)
    apply_logit_bias(got, bias)
    got = got.cpu()
    want = logits.clone()
    want[0, 3], want[0, 7], want[2, 0] = 1.0, -100.0, 0.5
    assert torch.equal(got, want)
    pt = penalty_tensors([0], [0], [SamplingParams(repetition_penalty=2.0)], filled_state([[3, 3]], [1], [0], device="cpu"))
    sampled = SamplingTensors(temperatures=torch.zeros(3), top_k=None, top_p=None,
                              seeds=torch.zeros(3, dtype=torch.long), row_seeds=[None] * 3, all_greedy=True,
                              penalties=pt, logit_bias=logit_bias_tensors(params, torch.device("cpu")))
    logits[0, 5] = 0.75                 # 3's biased and penalised logit is 1 / 2: below 5's
    assert Sampler()(logits, sampled)[0] == 5
    logits[0, 5] = 0.25                 # above it: 3 wins (applied after, the bias would leave 0)
    assert Sampler()(logits, sampled)[0] == 3


def test_min_tokens_bans_the_stop_tokens_of_rows_still_short_of_it():
    """A row short of its min_tokens may not sample its stop_token_ids, nor EOS, even where it
    ignores EOS (as vLLM's); ids outside the vocabulary (never sampled anyway) are left out, and
    rows past it are free."""
    params = [SamplingParams(min_tokens=3, stop_token_ids=[7, 99]), SamplingParams(min_tokens=3, stop_token_ids=[7]),
              SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=[4]), SamplingParams(stop_token_ids=[7])]
    rows_of = [BatchRow([1], 0, [], True, p, num_output_tokens=n) for p, n in zip(params, [2, 3, 0, 0])]
    rows, tokens = banned_token_tensors(rows_of, (2,), VOCAB, torch.device(DEVICE))
    assert list(zip(rows.tolist(), tokens.tolist())) == [(0, 2), (0, 7), (2, 2), (2, 4)]
    assert banned_token_tensors([BatchRow([1], 0, [], True, params[1], num_output_tokens=5)], (2,), VOCAB,
                                torch.device("cpu")) is None
    # A bad word's bans join them (engine/bad_words.py), ids past the vocabulary left out.
    with_words = rows_of + [BatchRow([1], 0, [], True, SamplingParams(), banned_tokens=[9, 3, VOCAB])]
    bans = banned_token_tensors(with_words, (2,), VOCAB, torch.device("cpu"))
    assert list(zip(*(t.tolist() for t in bans))) == [(0, 2), (0, 7), (2, 2), (2, 4), (4, 9), (4, 3)]
    logits = torch.randn(4, VOCAB)
    banned = logits.clone().to(DEVICE)
    ban_tokens(banned, (rows, tokens))
    banned = banned.cpu()
    assert torch.isinf(banned).sum() == 4 and banned[0, 7] == banned[2, 4] == float("-inf")
    assert torch.equal(banned[1], logits[1]) and torch.equal(banned[3], logits[3])


def test_a_logit_bias_is_made_into_arrays_once():
    """A step concatenates its rows' arrays (a whole-vocabulary bias walked as a dict took 256 ms a
    step); a completion of n keeps its prompt's."""
    p = SamplingParams(temperature=1.0, n=2, logit_bias={9: -3.0, 4: 100})
    tokens, biases = p.logit_bias_arrays
    assert tokens.tolist() == [9, 4] and biases.tolist() == [-3.0, 100.0]
    assert p.completion(1).logit_bias_arrays[0].tolist() == [9, 4] and SamplingParams().logit_bias_arrays is None
    rows, ids, values = logit_bias_tensors([SamplingParams(), p, SamplingParams(logit_bias={1: 0.5})],
                                           torch.device("cpu"))
    assert (rows.tolist(), ids.tolist(), values.tolist()) == ([1, 1, 2], [9, 4, 1], [-3.0, 100.0, 0.5])


def test_allowed_token_ids_keep_their_logits_alone():
    """A restricted row keeps its allowed tokens' logits and -inf elsewhere (an allowed token that
    a ban already set to -inf stays banned); the other rows are untouched."""
    logits = torch.randn(4, VOCAB)
    logits[2, 7] = float("-inf")
    params = [SamplingParams(), SamplingParams(allowed_token_ids=[9, 3, 9]), SamplingParams(allowed_token_ids=[7, 0]),
              SamplingParams()]
    got = logits.clone().to(DEVICE)
    keep_allowed_tokens(got, allowed_token_tensors(params, torch.device(DEVICE)))
    got = got.cpu()
    assert torch.equal(got[[0, 3]], logits[[0, 3]])
    assert torch.isfinite(got[1]).nonzero().flatten().tolist() == [3, 9] and torch.equal(got[1, [3, 9]], logits[1, [3, 9]])
    assert torch.isfinite(got[2]).nonzero().flatten().tolist() == [0] and got[2, 0] == logits[2, 0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a host that waits for the device shows only on CUDA")
def test_fills_bans_and_allowed_sets_do_not_wait_for_the_device():
    """`t[index] = 0` on a CUDA tensor copies the 0 from pageable memory, which waits for all the
    queued work: each fill of a penalty row held a mixed step's host for the step before (86 ms
    measured on the H200). With the device still busy when these return, none waited."""
    device = torch.device("cuda")
    busy = torch.randn(8192, 8192, device=device)
    state = PenaltyState.allocate(8, VOCAB, device)
    logits = torch.randn(4, VOCAB, device=device)
    params = [SamplingParams(allowed_token_ids=[1, 2]), SamplingParams()]
    allowed = allowed_token_tensors(params, device)
    banned = (torch.tensor([0, 3], device=device), torch.tensor([5, 6], device=device))
    newest, record_rows = torch.tensor([4, 9], device=device), torch.tensor([2, 5], device=device)
    torch.cuda.synchronize()
    for _ in range(8):
        busy @ busy                      # tens of milliseconds queued
    state.fill([2, 5], before_newest([[3, 4, 7, 4], [8, 9]]), [2, 1], newest)
    state.record(record_rows, newest)
    ban_tokens(logits, banned)
    keep_allowed_tokens(logits, allowed)
    assert not torch.cuda.current_stream().query(), "an operation waited for the device"
    torch.cuda.synchronize()
