"""Speculative decoding by n-gram lookup (speculative_config, mini_engine/speculative.py): the
proposer, the acceptance rule, the engine over random request streams with a stand-in model that
reads its own KV cache, and the tiny model's outputs against plain decoding's."""
import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from mini_engine import LLM, SamplingParams
from mini_engine.config import EngineConfig
from mini_engine.detokenizer import IncrementalDetokenizer
from mini_engine.engine.engine import LLMEngine
from mini_engine.engine.scheduler import Scheduler
from mini_engine.engine.block_manager import BlockManager
from mini_engine.engine.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from mini_engine.layers.sampler import SampleLogprobs
from mini_engine.runner.batch import StepHandle
from mini_engine.speculative import NgramIndex, SpecDecodeStats, SpeculativeConfig, ngram_drafts, num_accepted
from tests.engine.test_scheduler_properties import MODEL, add_greedy_requests

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


# ---- the proposer and the rule ----

@pytest.mark.parametrize("tokens, min_n, max_n, k, drafts", [
    ([1, 2, 3, 9, 1, 2, 3], 1, 3, 2, [9, 1]),          # the 3-gram [1, 2, 3] occurred: what followed it
    ([1, 2, 3, 9, 1, 2, 3], 1, 3, 10, [9, 1, 2, 3]),   # k cut by the sequence's end
    ([5, 3, 7, 4, 3, 6, 3], 1, 3, 1, [7]),             # only the 1-gram [3] occurred: its earliest
    ([5, 3, 7, 4, 3, 6, 3], 2, 3, 1, []),              # ... which min_n 2 refuses
    ([4, 1, 2, 8, 1, 2, 6, 1, 2], 1, 2, 1, [8]),       # the longest n wins, at its earliest occurrence
    ([1, 2, 3, 4], 1, 4, 3, []),                       # nothing repeats
    ([7], 1, 3, 3, []),                                # one token: nothing before it
    ([7, 7], 1, 3, 3, [7]),
])
def test_ngram_drafts(tokens, min_n, max_n, k, drafts):
    assert ngram_drafts(tokens, NgramIndex(), min_n, max_n, k) == drafts


def test_ngram_drafts_match_a_plain_search():
    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = rng.integers(0, 4, size=rng.integers(1, 30)).tolist()
        min_n, k = int(rng.integers(1, 3)), int(rng.integers(1, 5))
        max_n = min_n + int(rng.integers(0, 3))
        want = []
        for n in range(max_n, min_n - 1, -1):
            if n >= len(tokens):
                continue
            suffix = tokens[-n:]
            starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == suffix]
            if starts:
                want = tokens[starts[0] + n:starts[0] + n + k]
                break
        assert ngram_drafts(tokens, NgramIndex(), min_n, max_n, k) == want
        # An index kept across a growing sequence gives the same drafts as a fresh one.
        kept = NgramIndex()
        for end in range(1, len(tokens)):
            ngram_drafts(tokens[:end], kept, min_n, max_n, k)
        assert ngram_drafts(tokens, kept, min_n, max_n, k) == want


@pytest.mark.parametrize("drafts, sampled, accepted", [
    ([5, 6, 7], [5, 6, 7, 8], 3), ([5, 6, 7], [5, 9, 7, 8], 1), ([5, 6, 7], [4, 6, 7, 8], 0), ([], [3], 0)])
def test_num_accepted(drafts, sampled, accepted):
    assert num_accepted(drafts, sampled) == accepted


def test_stats_count_each_position():
    stats = SpecDecodeStats()
    stats.record(3, 2)
    stats.record(4, 0)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 7, 2)
    assert stats.accepted_per_position == [1, 1, 0, 0]
    assert stats.acceptance_rate == 2 / 7 and stats.mean_acceptance_length == 2.0


# ---- the configuration ----

def test_lookup_bounds_default_as_vllm():
    resolve = SpeculativeConfig.resolve
    assert resolve({"method": "ngram", "num_speculative_tokens": 2}) == SpeculativeConfig("ngram", 2, 5, 5)
    assert resolve({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}).prompt_lookup_min == 3
    assert resolve({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}).prompt_lookup_max == 2


@pytest.mark.parametrize("given, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
    ({"num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram"}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "is above"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "Qwen/Qwen3-0.6B"}, "draft_model method's"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "Qwen/Qwen3-0.6B"}, "unknown fields"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size must be"),
    ("ngram", "must be a dict"),
])
def test_bad_configs_are_refused(tiny_checkpoint, given, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(tiny_checkpoint, device="cpu", speculative_config=given)


def test_not_for_pooling(tiny_checkpoint):
    with pytest.raises(ValueError, match="pooling runner samples nothing"):
        EngineConfig(tiny_checkpoint, device="cpu", runner="pooling", speculative_config=NGRAM)


# ---- the engine, with a stand-in model that reads its own KV cache ----

def next_token(last: int, before: int) -> int:
    """The stand-in's next token after ..., before, last: a recurrence on 13 tokens, so outputs
    repeat and the n-gram drafts are often right (and sometimes wrong)."""
    return (3 * last + before) % 13 + 1


def unbanned(token: int, banned) -> int:
    """The stand-in's min_tokens: a stop token it may not sample yet gives way to the next one."""
    while token in banned:
        token = token % 13 + 1
    return token


def expected_output(prompt: list[int], max_tokens: int, stops: list[int], min_tokens: int = 0,
                    bad: tuple[int, ...] = ()) -> list[int]:
    """The stand-in's output: its recurrence, under min_tokens' ban of stop tokens and a ban of the
    one-token bad words `bad`."""
    tokens = list(prompt)
    for j in range(max_tokens):
        token = next_token(tokens[-1], tokens[-2] if len(tokens) > 1 else 0)
        tokens.append(unbanned(token, (*bad, *(stops if j < min_tokens else ()))))
        if tokens[-1] in stops:
            break
    return tokens[len(prompt):]


class CacheReadingRunner:
    """Every row writes its tokens into their KV slots first (as each layer does before attention
    reads), then each sampling row answers next_token of the last two tokens of its context, read
    from the slots its block table names. A row that read a slot holding a rejected draft, or a slot
    nobody wrote, would answer a token off the expected output."""

    def __init__(self, num_kv_blocks, block_size, budget, max_num_seqs):
        self.num_kv_blocks, self.block_size = num_kv_blocks, block_size
        self.budget, self.max_num_seqs = budget, max_num_seqs
        self.slots = {}
        self.num_steps = self.num_draft_rows = self.num_async_rows = 0
        self.prev = []              # the previous launch's samples, where an async row takes its token

    def slot(self, row, position):
        block = row.block_table[position // self.block_size]
        assert block >= 0, "a position outside the sequence's blocks"
        return block, position % self.block_size

    def launch(self, rows):
        assert sum(len(r.token_ids) for r in rows) <= self.budget
        assert len(rows) <= self.max_num_seqs
        self.num_steps += 1
        starts = {}
        for r in rows:
            starts.setdefault(id(r.block_table), []).append(r.start_position)
            tokens = list(r.token_ids)
            if r.prev_token_index >= 0:         # its input token is the step in flight's sample
                assert tokens[-1] == PENDING_TOKEN
                tokens[-1] = self.prev[r.prev_token_index]
                self.num_async_rows += 1
            assert PENDING_TOKEN not in tokens
            for i, token in enumerate(tokens):
                self.slots[self.slot(r, r.start_position + i)] = token
        # A sequence's draft rows follow its decode row, a position each.
        for positions in starts.values():
            assert positions == list(range(positions[0], positions[0] + len(positions)))
            self.num_draft_rows += len(positions) - 1
        samples, logprobs = [], []
        for r in rows:
            if r.sample:
                last = r.start_position + len(r.token_ids) - 1
                before = self.slots[self.slot(r, last - 1)] if last else 0
                p = r.params
                banned = (*(r.banned_tokens or ()), *(p.stop_token_ids if r.num_output_tokens < p.min_tokens else ()))
                samples.append(unbanned(next_token(self.slots[self.slot(r, last)], before), banned))
                # A logprob that names its token, where the request asks: each kept token must keep its own.
                logprobs.append(SampleLogprobs(-samples[-1], []) if p.logprobs is not None else None)
        self.prev = samples
        return StepHandle.done(samples, logprobs)

    def check_cached_blocks(self, block_manager):
        """Every block the prefix cache holds is full, and its slots hold the tokens its key names."""
        for block in block_manager.blocks:
            if block.key is not None:
                tokens = block.key[1]
                assert len(tokens) == self.block_size
                assert [self.slots.get((block.block_id, i)) for i in range(self.block_size)] == list(tokens)


def make_engine(num_blocks, block_size, max_num_seqs, budget, prefix_caching, speculative_config, max_model_len=256,
                async_scheduling=True):
    config = EngineConfig("unused", device="cpu", block_size=block_size, num_kv_blocks=num_blocks,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                          enable_prefix_caching=prefix_caching, model_config=MODEL,
                          speculative_config=speculative_config, async_scheduling=async_scheduling)
    return LLMEngine(config, runner=CacheReadingRunner(num_blocks, block_size, budget, max_num_seqs))


def run(engine, requests):
    seqs = add_greedy_requests(engine, requests)
    for _ in range(5_000):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        engine.runner.check_cached_blocks(engine.block_manager)
    else:
        raise AssertionError("the engine did not finish")
    return seqs


@settings(max_examples=80, deadline=None)
@given(requests=st.lists(st.tuples(st.lists(st.integers(1, 13), min_size=1, max_size=40), st.integers(1, 40),
                                   st.lists(st.integers(1, 13), max_size=2)), min_size=1, max_size=8),
       num_blocks=st.integers(6, 40), block_size=st.sampled_from([1, 2, 4, 16]), max_num_seqs=st.integers(1, 12),
       budget=st.integers(1, 64), prefix_caching=st.booleans(), k=st.integers(1, 6),
       lookup=st.sampled_from([(1, 1), (1, 3), (2, 4), (3, 3)]), disable_by=st.sampled_from([None, 1, 2, 4]),
       async_scheduling=st.booleans())
def test_random_streams_give_plain_decodings_tokens(requests, num_blocks, block_size, max_num_seqs, budget,
                                                    prefix_caching, k, lookup, disable_by, async_scheduling):
    """Whatever the drafts, the pool (preemptions included), the budget, the prefix cache, and
    steps that switch between drafts (synchronous) and none (asynchronous) as the batch crosses
    disable_by_batch_size, every request's output is the stand-in's own, it stops at its first stop
    token or its max_tokens, and every block is free at the end."""
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lookup[0],
            "prompt_lookup_max": lookup[1], "disable_by_batch_size": disable_by}
    engine = make_engine(num_blocks, block_size, max_num_seqs, budget, prefix_caching, spec,
                         async_scheduling=async_scheduling)
    seqs = run(engine, requests)
    assume(seqs)
    for seq, prompt, max_tokens, stops in seqs:
        want = expected_output(prompt, max_tokens, stops)
        assert seq.output_token_ids == want
        assert seq.finish_reason == ("stop" if want[-1] in stops else "length")
        assert seq.spec_token_ids == []
    stats = engine.spec_decode_stats
    assert stats.num_accepted_tokens <= stats.num_draft_tokens
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
    assert engine.num_free_blocks == num_blocks
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)


def test_repeating_outputs_take_fewer_steps():
    """The recurrence's state is its last two tokens and it cycles every 52 tokens: once the cycle
    has been seen, a matching 2-gram predicts the next four tokens exactly, so with
    prompt_lookup_min 2 every draft is right, and after the first cycle a step gives five tokens:
    250 tokens in ~54 + 196 / 5 steps, not 250."""
    engine = make_engine(128, 4, 8, 256, True, dict(NGRAM, prompt_lookup_min=2))
    seq, prompt, _, _ = run(engine, [([1, 2], 250, [])])[0]
    assert seq.output_token_ids == expected_output(prompt, 250, [])
    stats = engine.spec_decode_stats
    assert stats.acceptance_rate == 1.0 and stats.num_accepted_tokens > 150, stats
    assert engine.runner.num_steps < 100
    assert engine.num_free_blocks == 128


def test_drafts_stop_at_max_tokens_and_max_model_len():
    """A step never verifies a draft whose token the request could not keep: every row lies
    before max_tokens' last position and max_model_len."""
    engine = make_engine(64, 4, 8, 256, False, NGRAM, max_model_len=40)
    limits = []
    original = engine.runner.launch

    def launch(rows):
        limits.extend(r.start_position + len(r.token_ids) for r in rows)
        return original(rows)
    engine.runner.launch = launch
    seqs = run(engine, [([1, 2], 23, []), ([3, 4, 5], 37, [])])
    assert [s.num_output_tokens for s, *_ in seqs] == [23, 37]
    assert max(limits) <= 39
    assert [s.finish_reason for s, *_ in seqs] == ["length", "length"]


def test_penalised_requests_get_no_drafts():
    engine = make_engine(64, 4, 8, 256, True, NGRAM)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, repetition_penalty=1.2)
    seq = engine.add_request([1, 2], params)
    while engine.has_unfinished_requests():
        engine.step()
    assert seq.num_output_tokens == 60 and engine.spec_decode_stats.num_drafts == 0


def test_stop_string_inside_a_steps_tokens_cuts_them(tokenized_model):
    """update_until_stop feeds a step's tokens one at a time: the text and the count of tokens up
    to the one that completed the stop string, as steps of one token would give them."""
    llm = LLM(tokenized_model, device="cpu", num_kv_blocks=64)
    ids = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    text = llm.engine.detokenize(ids)
    k = next(k for k in range(4, len(text) - 1) if text[k:k + 2].isascii() and text[k:k + 2].isalpha())
    stop = text[k:k + 2]
    one_by_one = IncrementalDetokenizer(llm.engine.tokenizer, [stop])
    for used, token in enumerate(ids, 1):
        one_by_one.update([token], False)
        if one_by_one.stopped:
            break
    at_once = IncrementalDetokenizer(llm.engine.tokenizer, [stop])
    _, got = at_once.update_until_stop(ids, finished=False)
    assert at_once.stopped and got == used < len(ids)
    assert at_once.text == one_by_one.text == text[:text.find(stop)]


# ---- the tiny model: the same tokens as plain decoding ----

PROMPTS = [[5, 6, 7, 8] * 6, [9, 10, 11] * 5 + [12], list(range(20, 60)), [3, 3, 3, 3]]


@pytest.fixture(scope="module")
def plain(tiny_checkpoint):
    return LLM(tiny_checkpoint, device="cpu", num_kv_blocks=256)


@pytest.fixture(scope="module")
def speculative(tiny_checkpoint):
    return LLM(tiny_checkpoint, device="cpu", num_kv_blocks=256, speculative_config=NGRAM)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=7, max_tokens=48, ignore_eos=True, logprobs=3),
    SamplingParams(temperature=1.0, seed=1, top_k=5, top_p=0.8, min_p=0.05, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, min_tokens=30, stop_token_ids=[33, 177]),
    SamplingParams(temperature=0, max_tokens=40, logit_bias={7: 3.0, 8: -100}, allowed_token_ids=list(range(0, 64))),
    SamplingParams(temperature=0.8, seed=3, max_tokens=40, ignore_eos=True, n=2),
], ids=["greedy", "seeded-logprobs", "top-k-top-p-min-p", "min-tokens", "bias-allowed", "n=2"])
def test_same_tokens_as_plain_decoding(plain, speculative, params):
    """Greedy and seeded outputs are plain decoding's, token for token: a seeded request's j-th
    token is drawn from the stream (seed, j) either way, and a draft is kept only where the
    request's own draw equals it. Logprobs are those of the same positions."""
    speculative.engine.spec_decode_stats = SpecDecodeStats()
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    got = speculative.generate(PROMPTS, params, use_tqdm=False)
    for w, g in zip(want, got):
        for wc, gc in zip(w.outputs, g.outputs, strict=True):
            assert gc.token_ids == wc.token_ids and gc.finish_reason == wc.finish_reason
            if params.logprobs is not None:
                assert len(gc.logprobs) == len(wc.logprobs)
                for a, b in zip(wc.logprobs, gc.logprobs):
                    assert b.logprob == pytest.approx(a.logprob, abs=1e-4)
                    assert [t for t, _ in b.top] == [t for t, _ in a.top]
    stats = speculative.engine.spec_decode_stats
    assert stats.num_draft_tokens > 0, "the prompts repeat: the proposer must find drafts"
    engine = speculative.engine
    assert engine.num_free_blocks == engine.block_manager.num_blocks


def test_some_drafts_are_accepted(speculative, plain):
    """The tiny random model falls into loops under greedy decoding: some drafts must be right, or
    the comparisons above only ever saw rejections."""
    speculative.engine.spec_decode_stats = SpecDecodeStats()
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    got = speculative.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids
                                                    for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    assert speculative.engine.spec_decode_stats.num_accepted_tokens > 10, speculative.engine.spec_decode_stats


def test_preemption_with_drafts(tiny_checkpoint, plain):
    """A pool too small for every request at once: sequences with drafts are preempted and
    recomputed, and the outputs are still plain decoding's."""
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=24, block_size=4, speculative_config=NGRAM)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.engine.num_preemptions > 0 and llm.engine.spec_decode_stats.num_draft_tokens > 0
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks


STOP_PROMPTS = ["the the the the the the", "abc abc abc abc", "The quick brown fox"]


def stop_inside_a_step(engine, prompt: str, max_tokens: int = 60) -> tuple[str, list[int]] | None:
    """Runs prompt greedily, alone, on a speculative engine, and finds a stop string that a step's
    first token completes where the step brought more tokens: (the stop string, the output's
    tokens up to that one), or None where no step allows it."""
    seq = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    starts, num_tokens = [], 0          # where each step of several tokens began in the output
    while engine.has_unfinished_requests():
        for out in engine.step():
            if len(out.new_token_ids) > 1:
                starts.append(num_tokens)
            num_tokens += len(out.new_token_ids)
    ids = seq.output_token_ids
    text = engine.detokenize(ids)
    for j in starts:
        # The shortest end of the text up to token j that the text holds nowhere before.
        upto = engine.detokenize(ids[:j + 1])
        ends = [upto[-n:] for n in range(1, min(len(upto), 12) + 1)]
        stop = next((e for e in ends if text.find(e) == len(upto) - len(e)), None)
        if stop is not None and "\ufffd" not in stop and text.startswith(upto):
            return stop, ids[:j + 1]
    return None


def test_a_stop_string_inside_a_steps_tokens(tokenized_model):
    """A stop string completed by a step's first token when the step brought more: the output ends
    at that token, as plain decoding's does, and the tokens after it are dropped with their logprobs."""
    plain_llm = LLM(tokenized_model, device="cpu", num_kv_blocks=64)
    spec_llm = LLM(tokenized_model, device="cpu", num_kv_blocks=64, speculative_config=NGRAM)
    cases = 0
    for prompt in STOP_PROMPTS:
        found = stop_inside_a_step(spec_llm.engine, prompt)
        if found is None:
            continue
        stop, ids = found
        params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, stop=[stop], logprobs=1)
        want = plain_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        got = spec_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, "stop")
        assert got.token_ids == ids and len(got.logprobs) == len(ids)
        cases += 1
    assert cases >= 1, "no step of several tokens ended where a stop string could be cut"
    assert spec_llm.engine.num_free_blocks == spec_llm.engine.block_manager.num_blocks


def test_large_batches_run_asynchronously_without_drafts():
    """disable_by_batch_size (vLLM's): while more requests run or wait than it, steps propose no
    drafts and keep async scheduling (rows take their input token from the step in flight); once
    the batch is that small, drafts come, and the outputs are the stand-in's throughout."""
    spec = dict(NGRAM, prompt_lookup_min=2, disable_by_batch_size=2)
    engine = make_engine(256, 4, 8, 512, True, spec)
    requests = [([1, 2], 200, []), ([3, 4], 30, []), ([5, 6], 30, []), ([7, 8], 30, [])]
    seqs = run(engine, requests)
    for seq, prompt, max_tokens, stops in seqs:
        assert seq.output_token_ids == expected_output(prompt, max_tokens, stops)
    runner = engine.runner
    assert runner.num_async_rows > 0 and runner.num_draft_rows > 0
    assert engine.spec_decode_stats.num_accepted_tokens > 100
    assert engine.num_free_blocks == 256


def test_the_tiny_model_across_disable_by_batch_size(tiny_checkpoint, plain):
    """The tiny model with drafts only once two requests are left: asynchronous steps first, then
    synchronous ones with drafts, and plain decoding's tokens throughout."""
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=256,
              speculative_config=dict(NGRAM, disable_by_batch_size=2))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (90, 20, 30, 100)]
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.engine.spec_decode_stats.num_accepted_tokens > 0
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks


def test_the_proposer_backs_off_while_it_finds_nothing():
    """The stand-in's tokens count up and wrap at 61, so no n-gram repeats before position 61. While
    the proposer finds nothing, it looks less and less often, and the steps between keep async
    scheduling; once the count wraps, drafts are found again (within MAX_DRAFT_BACKOFF_STEPS steps)
    and every one is right."""
    from mini_engine.engine.engine import MAX_DRAFT_BACKOFF_STEPS
    from tests.engine.test_scheduler_properties import FakeRunner
    config = EngineConfig("unused", device="cpu", block_size=4, num_kv_blocks=64, max_num_seqs=4,
                          max_num_batched_tokens=256, max_model_len=256, model_config=MODEL,
                          speculative_config=dict(NGRAM, prompt_lookup_min=2))
    rows = []
    runner = FakeRunner(64, config, rows.append)
    engine = LLMEngine(config, runner=runner)
    seq = engine.add_request([1, 2], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert seq.output_token_ids == [p % 61 + 1 for p in range(2, 202)]
    before_wrap = [step for step in rows if step[0].start_position < 61]
    asynchronous = sum(step[0].prev_token_index >= 0 for step in before_wrap)
    assert asynchronous > 0.7 * len(before_wrap), (asynchronous, len(before_wrap))
    assert engine.spec_decode_stats.acceptance_rate == 1.0
    # From position 62 on (tokens 1, 2 again), a 2-gram repeats: the drafts come at most
    # MAX_DRAFT_BACKOFF_STEPS steps of one token later, and every step after has them, but those
    # that max_tokens leaves no room (its last token).
    first = next(i for i, step in enumerate(rows) if len(step) > 1)
    assert rows[first][0].start_position <= 62 + MAX_DRAFT_BACKOFF_STEPS
    assert all(len(step) > 1 or step[0].start_position >= 200 for step in rows[first:])
    assert engine.num_free_blocks == 64


def test_drafts_of_a_sequence_left_out_of_a_step_are_dropped():
    """A decode whose drafts were proposed but that the step left out (a higher-priority prompt's
    chunk took the whole budget) keeps no drafts: a later step without the proposer (async, past
    disable_by_batch_size) must not verify them, nor feed its row a token still in flight."""
    config = EngineConfig("unused", device="cpu", block_size=4, num_kv_blocks=128, max_num_seqs=8,
                          max_num_batched_tokens=8, max_model_len=256, model_config=MODEL,
                          scheduling_policy="priority",
                          speculative_config=dict(NGRAM, prompt_lookup_min=1, disable_by_batch_size=2))
    engine = LLMEngine(config, runner=CacheReadingRunner(128, 4, 8, 8))
    params = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    prompts = [list(range(1, 14)), list(range(1, 13)) * 3, [3, 4]]
    seq = engine.add_request(prompts[0], params(40), priority=5)
    for _ in range(3):
        engine.step()
    others = [engine.add_request(prompts[1], params(5), priority=0)]
    engine.step()
    engine.step()           # the prompt's chunk takes the budget: seq is proposed drafts, not scheduled
    others.append(engine.add_request(prompts[2], params(5), priority=9))     # 3 requests: no proposer
    while engine.has_unfinished_requests():
        engine.step()
    assert seq.output_token_ids == expected_output(prompts[0], 40, [])
    for other, prompt in zip(others, prompts[1:]):
        assert other.output_token_ids == expected_output(prompt, 5, [])
    assert engine.num_free_blocks == 128


def test_stop_strings_match_plain_decoding(tokenized_model):
    """A stop string completed by the token of an asynchronous step (one without drafts) that the
    next, synchronous, step returns together with its own tokens for the same request: those later
    tokens are dropped too, as is everything after the stop in plain decoding."""
    plain_llm = LLM(tokenized_model, device="cpu", num_kv_blocks=64)
    spec_llm = LLM(tokenized_model, device="cpu", num_kv_blocks=64, speculative_config=NGRAM)
    engine, steps = spec_llm.engine, itertools.count()
    engine.speculates = lambda: next(steps) % 2 == 1        # every step with drafts follows one without
    for prompt in ["def add(a, b):\n    return a + b\n", *STOP_PROMPTS]:
        for stop in [" ", "o", "e", "a", "\n", "b"]:
            params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop], logprobs=1)
            want = plain_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
            got = spec_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
            assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
            assert len(got.logprobs) == len(want.logprobs)
    assert spec_llm.engine.num_free_blocks == spec_llm.engine.block_manager.num_blocks


def test_structured_outputs_get_no_drafts(tokenized_model):
    """A request held to a grammar gets no drafts (a draft row has no grammar mask): its output is
    plain decoding's, and matches the grammar, beside a free request that does get drafts."""
    pytest.importorskip("xgrammar")
    from mini_engine.structured_outputs import StructuredOutputsParams
    plain_llm = LLM(tokenized_model, device="cpu", num_kv_blocks=64)
    spec_llm = LLM(tokenized_model, device="cpu", num_kv_blocks=64, speculative_config=NGRAM)
    held = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                          structured_outputs=StructuredOutputsParams(regex="(ab )+c"))
    free = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = ["abc abc abc abc", "the the the the the the"]
    want = plain_llm.generate(prompts, [held, free], use_tqdm=False)
    got = spec_llm.generate(prompts, [held, free], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert spec_llm.engine.spec_decode_stats.num_drafts > 0
    assert spec_llm.engine.num_free_blocks == spec_llm.engine.block_manager.num_blocks


def test_drafts_reach_but_never_pass_the_last_position():
    """Prompts that hold a whole cycle of the stand-in's recurrence: every draft is right, so drafts
    run up to the end, and still no row lies past the request's last token (max_tokens'; a request
    past max_model_len is refused), whose sample could never be kept."""
    cycle = [1, 2] + expected_output([1, 2], 60, [])
    max_model_len = len(cycle) + 17
    engine = make_engine(128, 4, 8, 256, False, dict(NGRAM, prompt_lookup_min=2), max_model_len=max_model_len)
    ends = {}
    original = engine.runner.launch

    def launch(rows):
        for r in rows:
            ends[id(r.block_table)] = max(ends.get(id(r.block_table), 0), r.start_position + len(r.token_ids))
        return original(rows)
    engine.runner.launch = launch
    seqs = run(engine, [(cycle, 13, []), (cycle, 17, [])])
    assert [s.num_output_tokens for s, *_ in seqs] == [13, 17]
    assert engine.spec_decode_stats.num_accepted_tokens > 10
    # The last token's K and V are never computed: a row's end is at most the sequence's length - 1.
    assert [ends[id(s.block_table)] for s, *_ in seqs] == [len(cycle) + 12, max_model_len - 1]


CYCLE = [1, 2] + expected_output([1, 2], 60, [])    # more than the recurrence's 52-token cycle


def test_a_stop_token_among_accepted_drafts_ends_the_output():
    """A prompt that holds a whole cycle: from the first decode on, the drafts are the cycle's next
    tokens and all are accepted. A stop token that a draft row samples ends the output there, in
    the middle of the step's kept tokens, with one logprob for each token kept."""
    continuation = expected_output(CYCLE, 8, [])
    for j in range(2, 5):                          # the draft rows' samples of the first step with drafts
        if continuation[j] in continuation[:j]:
            continue
        engine = make_engine(64, 4, 8, 256, True, dict(NGRAM, prompt_lookup_min=2))
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[continuation[j]],
                                logprobs=0)
        seq = engine.add_request(CYCLE, params)
        while engine.has_unfinished_requests():
            engine.step()
        assert seq.output_token_ids == continuation[:j + 1] and seq.finish_reason == "stop"
        assert [-lp.logprob for lp in seq.logprobs] == continuation[:j + 1]
        assert engine.spec_decode_stats.num_accepted_tokens >= j - 1
        assert engine.num_free_blocks == 64


@pytest.mark.parametrize("min_tokens", [1, 2, 3, 5, 8, 13])
def test_min_tokens_counts_each_draft_rows_output_token(min_tokens):
    """min_tokens bans stop tokens by the output token a row samples: a draft row's is its
    sequence's count plus its place (the stand-in draws the next token where one is banned)."""
    continuation = expected_output(CYCLE, 30, [])
    accepted = 0
    for stop in sorted(set(continuation[:12])):
        engine = make_engine(64, 4, 8, 256, True, dict(NGRAM, prompt_lookup_min=2))
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop],
                                min_tokens=min_tokens)
        seq = engine.add_request(CYCLE, params)
        while engine.has_unfinished_requests():
            engine.step()
        assert seq.output_token_ids == expected_output(CYCLE, 30, [stop], min_tokens), (stop, min_tokens)
        accepted += engine.spec_decode_stats.num_accepted_tokens
    assert accepted > 0


def decoding_sequence(block_manager, request_id: str, prompt: list[int], drafts: list[int]) -> Sequence:
    """A running sequence in decode state (its prompt's K and V computed, one sampled token
    after it), holding drafts."""
    seq = Sequence(request_id, list(prompt), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    seq.token_ids.append(7)
    assert block_manager.allocate_slots(seq, len(prompt))
    seq.num_computed_tokens, seq.status = len(prompt), SequenceStatus.RUNNING
    seq.spec_token_ids = list(drafts)
    return seq


@pytest.mark.parametrize("max_num_seqs, budget, num_blocks, waiting, granted", [
    (16, 256, 64, 0, [4, 4, 4]),        # room for all
    (8, 256, 64, 0, [4, 1, 0]),         # rows: 3 decode rows and 5 drafts
    (8, 256, 64, 1, [4, 0, 0]),         # a new prompt's row admitted first takes one of them
    (16, 7, 64, 0, [4, 0, 0]),          # the token budget: 3 decode tokens and 4 drafts
    (16, 9, 64, 0, [4, 2, 0]),
    (16, 256, 6, 0, [0, 0, 0]),         # no free block for the drafts' slots past each block
])
def test_drafts_take_only_what_the_step_leaves(max_num_seqs, budget, num_blocks, waiting, granted):
    """Scheduler.grant_drafts over drafts set by hand: rows (max_num_seqs), the token budget and
    free blocks, in the running order; a new prompt admitted in the step counts first; a draft never
    preempts; a preempted sequence's drafts are dropped."""
    bm = BlockManager(num_blocks, 4, enable_prefix_caching=False)
    scheduler = Scheduler(max_num_seqs, budget, bm, max_model_len=256)
    # Each sequence's 7 prompt tokens and its sampled token fill two blocks: its drafts need a third.
    running = [decoding_sequence(bm, f"r{i}", [i + 1] * 7, [5, 6, 7, 8]) for i in range(3)]
    scheduler.running = list(running)
    if waiting:
        scheduler.add(Sequence("new", [9], SamplingParams(temperature=0, max_tokens=4)))
    free_before = bm.num_free_blocks
    out = scheduler.schedule(with_drafts=True)
    assert [len(seq.spec_token_ids) for seq in running] == granted
    assert not out.preempted and scheduler.num_preemptions == 0
    assert len(out.seqs) + sum(granted) <= max_num_seqs and sum(out.num_new_tokens) <= budget
    assert [out.num_new_tokens[out.seqs.index(seq)] for seq in running] == [1 + g for g in granted]
    assert bm.num_free_blocks == free_before - sum(1 for g in granted if g) - waiting
    scheduler.preempt(running[0])
    assert running[0].spec_token_ids == []


def test_a_new_request_ends_the_proposers_back_off():
    """After a request whose tokens never repeat has pushed the back-off to its longest, a new one
    whose prompt holds a whole cycle gets drafts at its first decode step."""
    from mini_engine.engine.engine import MAX_DRAFT_BACKOFF_STEPS
    engine = make_engine(128, 4, 8, 256, True, dict(NGRAM, prompt_lookup_min=4, prompt_lookup_max=4))
    engine.add_request([1], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.next_draft_backoff == MAX_DRAFT_BACKOFF_STEPS and engine.spec_decode_stats.num_drafts == 0
    seq = engine.add_request(CYCLE, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    engine.step()                       # the prompt
    engine.step()                       # the first decode, with drafts
    assert engine.spec_decode_stats.num_drafts == 1 and seq.num_output_tokens == 1 + 5     # its prompt's, then 5


def test_bad_words_hold_in_draft_rows(tokenized_model):
    """A one-token bad word is banned in every row of a step, draft rows too: the outputs are plain
    decoding's under the same ban, with drafts accepted along the way."""
    plain_llm = LLM(tokenized_model, device="cpu", num_kv_blocks=64)
    spec_llm = LLM(tokenized_model, device="cpu", num_kv_blocks=64, speculative_config=NGRAM)
    tokenizer, cases = spec_llm.engine.tokenizer, 0
    for prompt in STOP_PROMPTS:
        free = plain_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                                  use_tqdm=False)[0].outputs[0].token_ids
        # The output's most frequent token whose text is a word of its own (so a bad word bans it).
        words = [tokenizer.decode([t]) for t in free]
        words = [w for w in words if w.strip().isalpha() and tokenizer.encode(w.strip()).ids == [free[words.index(w)]]]
        if not words:
            continue
        word = max(set(words), key=words.count).strip()
        params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, bad_words=[word])
        want = plain_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        got = spec_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert got.token_ids == want.token_ids != free
        cases += 1
    assert cases and spec_llm.engine.spec_decode_stats.num_accepted_tokens > 0


class DigitTokenizer:
    """A tokenizer for the stand-in's bad words: the word "t7" is token 7, with or without a space."""

    def encode(self, text: str, add_special_tokens: bool = False):
        return type("Encoding", (), {"ids": [int(text.strip()[1:])]})


def test_a_bad_word_is_banned_in_draft_rows_too():
    """The whole-cycle prompt holds the bad word's token, so drafts propose it; every row of a step,
    draft rows included, bans it, and the output is the stand-in's under the ban."""
    continuation = expected_output(CYCLE, 40, [])
    for bad in sorted(set(continuation[:8])):
        engine = make_engine(64, 4, 8, 256, True, dict(NGRAM, prompt_lookup_min=1))
        engine.tokenizer, engine.limits = DigitTokenizer(), dataclasses.replace(engine.limits, has_tokenizer=True)
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, bad_words=[f"t{bad}"])
        seq = engine.add_request(CYCLE, params)
        while engine.has_unfinished_requests():
            engine.step()
        assert seq.output_token_ids == expected_output(CYCLE, 40, [], bad=(bad,)), bad
        assert bad not in seq.output_token_ids and engine.spec_decode_stats.num_draft_tokens > 0
