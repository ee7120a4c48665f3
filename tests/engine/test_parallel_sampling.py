"""SamplingParams.n: several completions of one prompt (vLLM's parallel sampling), each its own
sequence, sharing the prompt's KV blocks through the prefix cache."""
import pytest

from mini_engine import LLM, SamplingParams
from tests.hf_reference import hf_greedy


def test_completions_draw_as_requests_seeded_seed_plus_index(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=128)
    prompt = [5, 17, 33, 2, 9]
    out = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)
    assert len(out) == 1 and [c.index for c in out[0].outputs] == [0, 1, 2]
    assert "_" not in out[0].request_id and out[0].prompt_token_ids == prompt
    alone = [llm.generate(prompt, SamplingParams(temperature=1.0, seed=5 + k, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids for k in range(3)]
    assert [c.token_ids for c in out[0].outputs] == alone
    assert len({tuple(a) for a in alone}) == 3


def test_the_prompt_is_computed_once(tiny_checkpoint):
    """Completions restricted to their top token are all the greedy output, and the second and
    third find the prompt's full blocks in the prefix cache (blocks of 4: 12 of its 14 tokens, the
    last block's 2 and the token that samples computed by each)."""
    prompt = list(range(3, 17))
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=64, block_size=4)
    out = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, top_k=1, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [hf_greedy(tiny_checkpoint, prompt, 6)] * 3
    assert llm.engine.prefix_cache_hit_tokens == 2 * 12 == out.num_cached_tokens * 2
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks


def test_n_asks_for_different_completions():
    """As vLLM: n > 1 at temperature 0 would repeat one completion, and n has vLLM's bound."""
    with pytest.raises(ValueError, match="n must be 1 when sampling greedily"):
        SamplingParams(n=2, temperature=0)
    with pytest.raises(ValueError, match="n must be an integer in"):
        SamplingParams(n=16385)
    assert SamplingParams(n=16384).n == 16384


def test_prompts_with_and_without_n_keep_their_order(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=128)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    params = [SamplingParams(n=2, temperature=0.5, seed=3, max_tokens=4, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
              SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=5, ignore_eos=True)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [2, 1, 3]
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [len(c.token_ids) for o in outs for c in o.outputs] == [4, 4, 3, 5, 5, 5]
    assert outs[1].outputs[0].token_ids == hf_greedy(tiny_checkpoint, prompts[1], 3)


def test_a_bad_prompt_after_one_with_n_fails_the_call_and_frees_everything(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=64)
    with pytest.raises(ValueError, match="prompt 1"):
        llm.generate([[5, 6, 7], [10 ** 9]], SamplingParams(n=4, max_tokens=3), use_tqdm=False)
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks
    assert not llm.engine.has_unfinished_requests()
