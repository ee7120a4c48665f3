"""Log-probabilities travel to the host with the sampled tokens, on the tokens' copy: a step that
asks for them does not wait for its results, so async scheduling stays on (the step's handle is
still in flight when launch returns), and the values are transformers' log-softmax."""
import pytest
import torch

from mini_engine import LLM, SamplingParams
from tests.hf_reference import hf_logits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="a step runs ahead of the host only on CUDA")


def test_a_step_with_logprobs_does_not_wait_for_them(tiny_checkpoint, monkeypatch):
    llm = LLM(tiny_checkpoint, device="cuda", dtype="float32", num_kv_blocks=64, max_num_seqs=8)
    runner = llm.engine.runner
    in_flight = []
    launch = runner.launch

    def recording_launch(rows):
        handle = launch(rows)
        in_flight.append(handle.tokens is None)
        return handle
    monkeypatch.setattr(runner, "launch", recording_launch)
    prompts = [[5, 17, 33], [40, 41, 42, 43, 44]]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.8, seed=2, max_tokens=6, ignore_eos=True)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(in_flight), "a step waited for its own results"
    out = outs[0].outputs[0]
    assert len(out.logprobs) == 6 and outs[1].outputs[0].logprobs is None
    expected = hf_logits(tiny_checkpoint, prompts[0] + out.token_ids).log_softmax(-1)[len(prompts[0]) - 1:-1]
    for j, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        top_values, top_ids = expected[j].topk(3)
        assert [t for t, _ in lp.top] == top_ids.tolist() and lp.top[0] == (token, lp.logprob)
        # Triton's float32 dots run in TF32 on the GPU: 2.6e-3 apart seen on the H200.
        assert torch.allclose(torch.tensor([v for _, v in lp.top]), top_values, atol=1e-2)
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks


def test_prompt_logprobs_on_the_gpu(tiny_checkpoint):
    """The prompt's log-probabilities (an eager step's hidden states, in groups of rows through
    lm_head) are transformers' log-softmax, in chunks of 7 tokens, and the outputs are unchanged."""
    llm = LLM(tiny_checkpoint, device="cuda", dtype="float32", num_kv_blocks=64, max_num_seqs=8,
              max_num_batched_tokens=7)
    prompt = [5, 17, 33, 40, 41, 42, 43, 44, 90, 91, 92, 7, 8, 200, 201, 3]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    plain = llm.generate([prompt], params, use_tqdm=False)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=3),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids and plain.prompt_logprobs is None
    expected = hf_logits(tiny_checkpoint, prompt).log_softmax(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for position in range(1, len(prompt)):
        lp, row = out.prompt_logprobs[position], expected[position - 1]
        assert abs(lp.logprob - row[prompt[position]].item()) < 1e-2
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks
