"""vLLM's prompt_logprobs: each prompt token's log-probability given the tokens before it, its
rank, and the top ones, against transformers' log-softmax over the prompt, whatever the scheduler
does with the prompt (chunks, preemption, a prefix the cache holds, parallel sampling)."""
import pytest
import torch

from mini_engine import LLM, SamplingParams
from tests.engine.test_greedy_vs_transformers import mixed_prompts, shared_prefix_prompts
from tests.hf_reference import hf_logits

TOP = 3


def check(path: str, prompt: list[int], prompt_logprobs) -> None:
    expected = hf_logits(path, prompt).log_softmax(-1)
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for position in range(1, len(prompt)):
        got, row, token = prompt_logprobs[position], expected[position - 1], prompt[position]
        assert got.logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert got.rank == int((row > row[token]).sum()) + 1
        values, ids = row.topk(TOP)
        assert [t for t, _ in got.top] == ids.tolist()
        assert torch.allclose(torch.tensor([v for _, v in got.top]), values, atol=1e-4)


def run(path, prompts, params, **engine_kwargs):
    llm = LLM(path, device="cpu", **engine_kwargs)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks, "KV blocks leaked"
    return outputs, llm.engine


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_prompt_logprobs_equal_transformers_beside_requests_without(tiny_checkpoint, async_scheduling):
    """Every other request asks; the others' outputs are those of a run where none asks."""
    prompts = mixed_prompts()
    asks = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=TOP if i % 2 == 0 else None)
            for i in range(len(prompts))]
    outputs, _ = run(tiny_checkpoint, prompts, asks, num_kv_blocks=256, async_scheduling=async_scheduling)
    plain, _ = run(tiny_checkpoint, prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                   num_kv_blocks=256, async_scheduling=async_scheduling)
    for i, (prompt, out, ref) in enumerate(zip(prompts, outputs, plain)):
        if i % 2 == 0:
            check(tiny_checkpoint, prompt, out.prompt_logprobs)
        else:
            assert out.prompt_logprobs is None
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_chunked_prefill_and_preemption(tiny_checkpoint):
    """Prompts in chunks of 7 tokens (a chunk's last position predicts the next chunk's first) in a
    pool too small for all: a preempted prompt computes its positions again, to the same values."""
    prompts = mixed_prompts()
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=TOP)
    outputs, engine = run(tiny_checkpoint, prompts, params, num_kv_blocks=16, block_size=4, max_num_batched_tokens=7,
                          enable_prefix_caching=False)
    assert engine.num_preemptions > 0
    for prompt, out in zip(prompts, outputs):
        check(tiny_checkpoint, prompt, out.prompt_logprobs)


def test_a_cached_prefix_is_computed_again_for_them(tiny_checkpoint):
    """vLLM's rule: the prefix cache does not serve a prompt whose log-probabilities are asked
    for (the cached positions have no logits); it still serves the requests that do not ask, and
    the n - 1 later completions of one that does."""
    prompts = shared_prefix_prompts()
    params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=TOP if i % 2 else None)
              for i in range(len(prompts))]
    outputs, engine = run(tiny_checkpoint, prompts, params, num_kv_blocks=256, block_size=4,
                          max_num_batched_tokens=40)
    assert engine.prefix_cache_hit_tokens > 0
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        if i % 2:
            assert out.num_cached_tokens == 0
            check(tiny_checkpoint, prompt, out.prompt_logprobs)
        else:
            assert out.prompt_logprobs is None
    prompt = prompts[-1]
    out = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=256, block_size=4).generate(
        [prompt], SamplingParams(temperature=1.0, seed=1, max_tokens=4, ignore_eos=True, n=3, prompt_logprobs=TOP),
        use_tqdm=False)[0]
    check(tiny_checkpoint, prompt, out.prompt_logprobs)
    assert out.num_cached_tokens > 0 and len(out.outputs) == 3


def test_prompt_logprobs_are_checked(tiny_checkpoint):
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=64)
    for name in ("prompt_logprobs", "logprobs"):       # vLLM's max_logprobs, 20 by default
        with pytest.raises(ValueError, match=f"{name}=21 asks for more top tokens than the engine's max_logprobs=20"):
            llm.generate([[1, 2, 3]], SamplingParams(**{name: 21}), use_tqdm=False)
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1, prompt_logprobs=20),
                            use_tqdm=False)[0].prompt_logprobs[1].top) == 20
    one = llm.generate([[5]], SamplingParams(max_tokens=2, prompt_logprobs=0), use_tqdm=False)[0]
    assert one.prompt_logprobs == [None]
    zero = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, prompt_logprobs=0), use_tqdm=False)[0]
    assert [lp.top for lp in zero.prompt_logprobs[1:]] == [[], []]
