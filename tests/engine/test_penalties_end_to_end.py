"""Penalised greedy outputs against an oracle that recomputes the whole sequence through
transformers every token and applies the penalties by their definitions, whatever the scheduler
does: with async scheduling a decode row's newest token is still on the device when its step is
built, so these are the tests of how the engine counts it."""
import functools

import pytest

from mini_engine import LLM, SamplingParams
from mini_engine.engine.sequence import PENDING_TOKEN, Sequence
from tests.engine.test_greedy_vs_transformers import mixed_prompts, shared_prefix_prompts
from tests.hf_reference import hf_greedy, hf_logits, hf_model
from tests.penalty_definition import penalised_by_definition

MAX_TOKENS = 10

# One request in three has no penalty: it must stay plain greedy beside the others.
PENALTIES = [dict(repetition_penalty=1.4), dict(presence_penalty=1.2, frequency_penalty=0.5), dict(),
             dict(frequency_penalty=1.5, repetition_penalty=0.8), dict(presence_penalty=-0.7)]


def params_for(i: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **PENALTIES[i % len(PENALTIES)])


@functools.lru_cache(maxsize=None)
def oracle(path: str, prompt: tuple[int, ...], i: int) -> list[int]:
    params, tokens = params_for(i), list(prompt)
    for _ in range(MAX_TOKENS):
        logits = penalised_by_definition(hf_logits(path, tokens)[-1], tokens, len(prompt), params)
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


def run(path: str, prompts, **engine_kwargs):
    llm = LLM(path, device="cpu", **engine_kwargs)
    outputs = llm.generate(prompts, [params_for(i) for i in range(len(prompts))], use_tqdm=False)
    engine = llm.engine
    assert engine.num_free_blocks == engine.block_manager.num_blocks, "KV blocks leaked"
    return [o.outputs[0].token_ids for o in outputs], engine


def expected(path, prompts):
    return [oracle(path, tuple(p), i) for i, p in enumerate(prompts)]


def test_the_oracle_is_transformers_generate_for_repetition_and_plain_greedy(tiny_checkpoint):
    """Where transformers has the processor (repetition_penalty) or none is needed, the oracle's
    loop gives what transformers' own generate gives; and each penalty changes some outputs."""
    torch = pytest.importorskip("torch")
    prompts = mixed_prompts()
    plain = [hf_greedy(tiny_checkpoint, p, MAX_TOKENS) for p in prompts]
    for prompt, greedy in zip(prompts, plain):
        ids = torch.tensor([prompt])
        generated = hf_model(tiny_checkpoint).generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
            repetition_penalty=PENALTIES[0]["repetition_penalty"], eos_token_id=None, pad_token_id=0)
        assert oracle(tiny_checkpoint, tuple(prompt), 0) == generated[0, len(prompt):].tolist()
        assert oracle(tiny_checkpoint, tuple(prompt), 2) == greedy
    for i in (0, 1, 3, 4):
        assert any(oracle(tiny_checkpoint, tuple(p), i) != g for p, g in zip(prompts, plain)), PENALTIES[i]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_mixed_batch(tiny_checkpoint, async_scheduling):
    prompts = mixed_prompts()
    got, _ = run(tiny_checkpoint, prompts, num_kv_blocks=256, async_scheduling=async_scheduling)
    assert got == expected(tiny_checkpoint, prompts)


def test_chunked_prefill_and_preemption(tiny_checkpoint):
    """Prompts in chunks of 7 tokens, and a pool too small for all: preempted sequences recompute
    their output tokens as a prompt chunk, which must still count as output."""
    prompts = mixed_prompts()
    got, engine = run(tiny_checkpoint, prompts, num_kv_blocks=16, block_size=4, max_num_batched_tokens=7,
                      enable_prefix_caching=False)
    assert engine.num_preemptions > 0
    assert got == expected(tiny_checkpoint, prompts)


def test_prefix_cache_hits(tiny_checkpoint):
    """A prompt whose prefix comes from the cache computes only its tail, yet its whole prompt
    counts for the repetition penalty."""
    prompts = shared_prefix_prompts()
    got, engine = run(tiny_checkpoint, prompts, num_kv_blocks=256, block_size=4, max_num_batched_tokens=40)
    assert engine.prefix_cache_hit_tokens > 0
    assert got == expected(tiny_checkpoint, prompts)


def test_tokens_before_newest():
    seq = Sequence("r", [5, 6, 7], SamplingParams(presence_penalty=1.0))
    assert seq.tokens_before_newest().tolist() == [5, 6]
    seq.token_ids += [8, PENDING_TOKEN]            # the newest may be in flight
    assert seq.tokens_before_newest().tolist() == [5, 6, 7, 8]
    seq.token_ids.append(PENDING_TOKEN)            # a token before the newest may not
    with pytest.raises(RuntimeError, match="in flight"):
        seq.tokens_before_newest()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_penalty_rows_are_reused_and_all_returned(tiny_checkpoint, async_scheduling):
    """Three times as many penalised requests as max_num_seqs, in a pool that forces preemptions:
    each running request has its own row of counts, rows pass from ended or preempted requests to
    new ones (a new owner's fill clears what the last one and its in-flight step left), and after
    the run every row is free again."""
    prompts = mixed_prompts() * 3
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=16, block_size=4, max_num_seqs=3,
              async_scheduling=async_scheduling, enable_prefix_caching=False)
    scheduler = llm.engine.scheduler
    rows_seen = []
    original = scheduler.schedule

    def schedule(**kwargs):
        out = original(**kwargs)
        rows = [s.penalty_row for s in scheduler.running if s.sampling_params.penalized]
        assert -1 not in rows and len(set(rows)) == len(rows), rows
        rows_seen.extend(rows)
        return out
    scheduler.schedule = schedule
    outputs = llm.generate(prompts, [params_for(i) for i in range(len(prompts))], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected(tiny_checkpoint, prompts)
    assert llm.engine.num_preemptions > 0 and set(rows_seen) == {0, 1, 2}
    assert sorted(scheduler.free_penalty_rows) == [0, 1, 2], "penalty rows leaked"


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_logit_bias_forces_and_bans_tokens(tiny_checkpoint, async_scheduling):
    """+100 on a token makes it every greedy output; -100 on the greedy output's first token makes
    the first token the runner-up, which transformers' logits name; rows without one beside them
    stay greedy."""
    prompts = mixed_prompts()[:3]
    plain = [hf_greedy(tiny_checkpoint, p, MAX_TOKENS) for p in prompts]
    banned = plain[1][0]
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=64, async_scheduling=async_scheduling)
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias={77: 100}),
              SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias={banned: -100}),
              SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got[0] == [77] * MAX_TOKENS and plain[0] != got[0]
    assert got[1][0] == hf_logits(tiny_checkpoint, prompts[1])[-1].topk(2).indices[1] and banned not in got[1]
    assert got[2] == plain[2]
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_allowed_token_ids_restrict_greedy_and_sampled_rows(tiny_checkpoint, async_scheduling):
    """vLLM's allowed_token_ids: a greedy row takes the argmax of transformers' logits over its
    allowed tokens (the runner-up of them where the bias bans the best), a sampled row draws
    only from them, and a row without any beside them stays greedy."""
    prompts = mixed_prompts()[:3]
    plain = [hf_greedy(tiny_checkpoint, p, MAX_TOKENS) for p in prompts]
    allowed = sorted({plain[0][0], (plain[0][0] + 1) % 256, 5, 77, 200})
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=64, async_scheduling=async_scheduling)
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, allowed_token_ids=allowed,
                             logit_bias={plain[0][0]: -100}),
              SamplingParams(temperature=5.0, seed=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                             allowed_token_ids=[8, 9, 10, 11]),
              SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    tokens = list(prompts[0])
    for _ in range(MAX_TOKENS):
        logits = hf_logits(tiny_checkpoint, tokens)[-1].clone()
        logits[plain[0][0]] -= 100
        tokens.append(allowed[int(logits[allowed].argmax())])
    assert got[0] == tokens[len(prompts[0]):]
    assert set(got[1]) <= {8, 9, 10, 11} and len(set(got[1])) > 1 and got[2] == plain[2]
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks


def test_allowed_token_ids_are_checked():
    for bad in ([], [-1], [True], [1.5]):
        with pytest.raises(ValueError, match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)
    assert SamplingParams(allowed_token_ids=(4, 2, 4)).allowed_token_ids_array.tolist() == [2, 4]


def test_allowed_token_ids_outside_the_vocabulary_are_refused(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=64)
    with pytest.raises(ValueError, match="outside the vocabulary of 256"):
        llm.generate([[1, 2, 3]], SamplingParams(allowed_token_ids=[3, 256]), use_tqdm=False)
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks and not llm.engine.requests


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("fail_at", [1, 2, 3])
def test_a_failed_launch_retried_counts_nothing_twice(tiny_checkpoint, monkeypatch, async_scheduling, fail_at):
    """A launch that fails after its sampler ran (here: computing logprobs) has counted a token the
    host never gets; a caller of LLMEngine.step that retries must see the penalties of the tokens
    the request holds, and nothing else (found by a review: the retry gave the runner-up)."""
    import mini_engine.runner.model_runner as model_runner
    prompt = mixed_prompts()[2]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1,
                            frequency_penalty=2.0, repetition_penalty=1.5)
    engine = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=64, async_scheduling=async_scheduling).engine
    seq = engine.add_request(prompt, params, "r")
    real, calls = model_runner.logprob_tensors, [0]

    def flaky(*args):
        calls[0] += 1
        if calls[0] == fail_at:
            raise RuntimeError("a step failed")
        return real(*args)
    monkeypatch.setattr(model_runner, "logprob_tensors", flaky)
    failures = 0
    while engine.has_unfinished_requests():
        try:
            engine.step()
        except RuntimeError:
            failures += 1
    tokens = list(prompt)
    for _ in range(MAX_TOKENS):
        tokens.append(int(penalised_by_definition(hf_logits(tiny_checkpoint, tokens)[-1], tokens, len(prompt),
                                                  params).argmax()))
    assert failures == 1 and seq.output_token_ids == tokens[len(prompt):]
    assert engine.num_free_blocks == engine.block_manager.num_blocks


def test_an_allowed_set_that_min_tokens_bans_whole_is_refused(tiny_checkpoint):
    """Nothing would be left to sample (a review's repro sampled token 0, outside the set)."""
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=64)
    eos = llm.engine.config.model_config.eos_token_ids[0]
    for params in (SamplingParams(allowed_token_ids=[eos], min_tokens=3, max_tokens=5),
                   SamplingParams(allowed_token_ids=[9, 10], stop_token_ids=[9, 10], min_tokens=2, max_tokens=5)):
        with pytest.raises(ValueError, match="nothing is left to sample"):
            llm.generate([[1, 2, 3]], params, use_tqdm=False)
    out = llm.generate([[1, 2, 3]], SamplingParams(allowed_token_ids=[eos, 9], min_tokens=2, max_tokens=3,
                                                   temperature=0), use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:2] == [9, 9]
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks
