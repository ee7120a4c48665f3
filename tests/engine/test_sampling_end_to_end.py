import pytest
import torch

from mini_engine import LLM, SamplingParams


def test_seeded_request_reproduces_whatever_the_batch(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=128)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=42, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=7, ignore_eos=True)
    prompt = [5, 17, 33, 2, 9]
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    crowded = llm.generate([[40, 41], prompt, [7] * 9], [other, seeded, other], use_tqdm=False)
    assert crowded[1].outputs[0].token_ids == alone
    unseeded = {tuple(o.outputs[0].token_ids) for o in
                llm.generate([prompt] * 6, SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True),
                             use_tqdm=False)}
    assert len(unseeded) > 1


def test_stop_tokens_and_eos_end_a_request(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=128)
    prompt = [5, 17, 33, 2, 9]
    free_run = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    assert free_run.finish_reason == "length" and len(free_run.token_ids) == 12
    stop_at = free_run.token_ids[4]
    first = free_run.token_ids.index(stop_at)
    stopped = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                  stop_token_ids=[stop_at]), use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == free_run.token_ids[:first + 1]
    # The checkpoint's EOS ends a request unless ignore_eos. Pretend the model's EOS is stop_at.
    engine = llm.engine
    assert engine.eos_token_ids == {2}                      # read from config.json
    engine.eos_token_ids = frozenset({stop_at})
    eos = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert eos.finish_reason == "stop" and eos.token_ids == free_run.token_ids[:first + 1]
    ignored = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == free_run.token_ids
    assert engine.num_free_blocks == engine.block_manager.num_blocks


def test_logprobs_of_greedy_tokens(tiny_checkpoint):
    """Asked for, each output token comes with its log-probability and the row's top tokens: a
    greedy token is the top one, with the same value; not asked for, there are none."""
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=64)
    out = llm.generate([5, 17, 33], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 6
    for token, lp in zip(out.token_ids, out.logprobs):
        assert len(lp.top) == 3 and lp.top[0] == (token, lp.logprob) and lp.logprob <= 0
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    # The values are log-softmax of the raw logits: transformers' own, over the same tokens.
    from tests.hf_reference import hf_logits
    prompt = [5, 17, 33]
    expected = hf_logits(tiny_checkpoint, prompt + out.token_ids).log_softmax(-1)[len(prompt) - 1:-1]
    for j, lp in enumerate(out.logprobs):
        top_values, top_ids = expected[j].topk(3)
        assert [t for t, _ in lp.top] == top_ids.tolist()
        assert torch.allclose(torch.tensor([v for _, v in lp.top]), top_values, atol=1e-4)
    plain = llm.generate([5, 17, 33], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert plain.logprobs is None and plain.token_ids == out.token_ids


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_min_tokens_holds_back_stop_tokens_and_eos(tiny_checkpoint, async_scheduling):
    """vLLM's min_tokens: the first min_tokens tokens are never a stop token nor EOS (their logits
    are -inf), and after them the request stops as before. The oracle: transformers' logits, those
    tokens masked for the first min_tokens steps, greedy."""
    from tests.hf_reference import hf_logits
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=64, async_scheduling=async_scheduling)
    prompt = [5, 17, 33, 2, 9]
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    stop = free[0].outputs[0].token_ids[1]                       # a token the greedy run writes early
    llm.engine.eos_token_ids = frozenset({free[0].outputs[0].token_ids[0]})    # and one it writes first

    def oracle(min_tokens: int) -> list[int]:
        out = []
        for j in range(12):
            logits = hf_logits(tiny_checkpoint, prompt + out)[-1].clone()
            if j < min_tokens:
                logits[[stop, *llm.engine.eos_token_ids]] = float("-inf")
            out.append(int(logits.argmax()))
            if out[-1] in (stop, *llm.engine.eos_token_ids):
                break
        return out
    runner = llm.engine.runner
    runner.model_config.eos_token_ids = tuple(llm.engine.eos_token_ids)   # what the sampler bans
    for min_tokens in (0, 3, 12):
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop],
                                                  min_tokens=min_tokens), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == oracle(min_tokens), min_tokens
        assert len(out.token_ids) >= min_tokens and out.finish_reason == ("stop" if len(out.token_ids) < 12 else "length")
    assert len(oracle(0)) == 1 and len(oracle(3)) > 3                  # the ban changed the outputs
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks
