"""vLLM's long_prefill_token_threshold: no request computes more prompt tokens a step than it, so
a long prompt's chunks share their steps with other requests; greedy outputs are unchanged."""
import random

import pytest

from mini_engine import LLM, SamplingParams
from mini_engine.config import EngineConfig


def record_schedules(llm) -> list[list[int]]:
    """Each step's tokens per request, as the engine's scheduler gives them from now on."""
    scheduled, schedule = [], llm.engine.scheduler.schedule

    def recording(*args, **kwargs):
        out = schedule(*args, **kwargs)
        scheduled.append(list(out.num_new_tokens))
        return out

    llm.engine.scheduler.schedule = recording
    return scheduled


def test_chunks_stay_under_the_threshold_and_outputs_do_not_change(tiny_checkpoint):
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 200) for _ in range(n)] for n in (90, 7, 61, 3, 120, 33)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(tiny_checkpoint, num_kv_blocks=128).generate(prompts, params, use_tqdm=False)
    llm = LLM(tiny_checkpoint, num_kv_blocks=128, long_prefill_token_threshold=24)
    scheduled = record_schedules(llm)
    capped = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in capped] == [o.outputs[0].token_ids for o in plain]
    assert max(n for step in scheduled for n in step) == 24     # the long prompts came in chunks of 24
    assert any(len(step) > 1 and max(step) == 24 for step in scheduled)     # beside other requests
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("value", [-1, 2.5])
def test_a_bad_threshold_is_refused(tiny_checkpoint, value):
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        EngineConfig(tiny_checkpoint, long_prefill_token_threshold=value)


def test_generate_admits_enough_requests_to_fill_a_step(tiny_checkpoint):
    """LLM.generate adds requests until the waiting ones would fill a step: with the threshold, a
    prompt fills at most that much of it, so a step of 64 tokens runs 8 prompts' chunks of 8."""
    llm = LLM(tiny_checkpoint, num_kv_blocks=128, max_num_batched_tokens=64, long_prefill_token_threshold=8)
    scheduled = record_schedules(llm)
    llm.generate([[i + 1] * 64 for i in range(8)], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert scheduled[0] == [8] * 8
