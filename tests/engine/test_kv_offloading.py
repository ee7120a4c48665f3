"""KV offloading (vLLM's kv_offloading_size, backend "native"): blocks the KV pool evicts are kept
in host memory and loaded back on a prefix hit. Greedy outputs stay transformers', whatever the
pool lost, and the loaded K and V are what the outputs are computed from."""
import os

import pytest
from safetensors.torch import load_file

from mini_engine import LLM, SamplingParams
from tests.engine.test_greedy_vs_transformers import expected, mixed_prompts

BLOCK_BYTES = 2048      # the tiny checkpoint's block of 4 tokens: 2 layers x K and V x 2 heads x 16 x fp32


def host_gib(num_blocks: int) -> float:
    return num_blocks * BLOCK_BYTES / 2**30


def prompts_of(length: int, count: int = 6) -> list[list[int]]:
    return mixed_prompts(seed=3, lengths=(length,) * count)


def run(llm: LLM, prompts, max_tokens: int = 8):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.engine
    assert engine.num_free_blocks == engine.block_manager.num_blocks, "KV blocks leaked"
    return [o.outputs[0].token_ids for o in outputs], outputs


@pytest.mark.parametrize("max_num_seqs, max_num_batched_tokens", [(1, 64), (3, 16)])
def test_prefixes_the_pool_lost_come_back_from_the_host_tier(tiny_checkpoint, max_num_seqs, max_num_batched_tokens):
    """A pool of 16 blocks of 4 tokens holds one or two of six 40-token prompts: running them again,
    the pool has lost every earlier prompt, and the host tier gives each its first 9 blocks.
    The second case also chunks the prompts, 16 tokens a step, and preempts."""
    prompts = prompts_of(40)
    want = expected(tiny_checkpoint, prompts, 8)
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=16, block_size=4, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=max_num_batched_tokens, kv_offloading_size=host_gib(64))
    assert llm.engine.runner.num_host_kv_blocks == 64
    bm = llm.engine.block_manager
    got, _ = run(llm, prompts)
    assert got == want
    hit_before = bm.host_cache_hit_tokens
    got, outputs = run(llm, prompts)
    assert got == want
    assert bm.host_cache_hit_tokens - hit_before >= 5 * 36, "the host tier served too little"
    assert sum(o.num_cached_tokens for o in outputs) >= 5 * 36
    if max_num_seqs > 1:
        assert llm.engine.num_preemptions > 0


def test_what_a_hit_loads_is_what_the_model_reads(tiny_checkpoint):
    """Noise written over the host tier after the first run reaches the second run's outputs: the
    hits were loaded, not computed again. (The last prompt's blocks were still in the pool: the
    second run stores them afresh before it needs them.)"""
    prompts = prompts_of(40)
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=16, block_size=4, max_num_seqs=1,
              kv_offloading_size=host_gib(64))
    first, _ = run(llm, prompts)
    for slot in llm.engine.runner.host_kv_slots:
        slot.normal_()
    second, _ = run(llm, prompts)
    assert sum(a != b for a, b in zip(first, second)) >= 5


def test_reset_prefix_cache_keeps_the_host_tier_unless_reset_connector(tiny_checkpoint):
    """As vLLM's reset_prefix_cache: the pool forgets its blocks, which the host tier then holds;
    reset_connector=True forgets those too."""
    prompts = prompts_of(24, count=3)
    want = expected(tiny_checkpoint, prompts, 8)
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=256, block_size=4, kv_offloading_size=host_gib(64))
    bm = llm.engine.block_manager
    assert run(llm, prompts)[0] == want
    assert bm.host_cache_hit_tokens == 0 and not bm.host.entries     # a pool this large evicted nothing
    assert llm.reset_prefix_cache()
    got, outputs = run(llm, prompts)
    assert got == want
    assert [o.num_cached_tokens for o in outputs] == [20, 20, 20] and bm.host_cache_hit_tokens == 60
    assert bm.prefix_cache_hit_tokens == 0
    assert llm.reset_prefix_cache(reset_connector=True)
    got, outputs = run(llm, prompts)
    assert got == want and [o.num_cached_tokens for o in outputs] == [0, 0, 0]


def test_sleep_level_1_keeps_the_host_tier_and_new_weights_forget_it(tiny_checkpoint):
    """Level 1's weights come back as they were: the pool's blocks wait in the host tier and serve
    the next run. Level 2 and load_weights bring new weights: the host tier forgets everything."""
    prompts = prompts_of(24, count=3)
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=256, block_size=4, kv_offloading_size=host_gib(64),
              enable_sleep_mode=True)
    host = llm.engine.block_manager.host
    first, _ = run(llm, prompts)
    llm.sleep(level=1)
    assert len(host.entries) == 3 * 7             # 31 tokens computed (the last sampled is not): 7 blocks
    llm.wake_up()
    got, outputs = run(llm, prompts)
    assert got == first and [o.num_cached_tokens for o in outputs] == [20, 20, 20]
    llm.sleep(level=2)
    assert not host.entries
    llm.wake_up()
    llm.load_weights(load_file(os.path.join(tiny_checkpoint, "model.safetensors")).items())
    got, outputs = run(llm, prompts)
    assert got == first and [o.num_cached_tokens for o in outputs] == [0, 0, 0]
    assert llm.reset_prefix_cache() and host.entries
    llm.load_weights(load_file(os.path.join(tiny_checkpoint, "model.safetensors")).items())
    assert not host.entries


def test_a_failed_step_forgets_the_host_tier(tiny_checkpoint, monkeypatch):
    """A step that fails may have scheduled stores it never made: the host tier is reset with the pool."""
    prompts = prompts_of(40)
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=16, block_size=4, max_num_seqs=1,
              kv_offloading_size=host_gib(64))
    run(llm, prompts)
    assert llm.engine.block_manager.host.entries
    runner = llm.engine.runner

    def fail(*args):
        raise RuntimeError("the device is gone")
    monkeypatch.setattr(runner, "launch", fail)
    with pytest.raises(RuntimeError, match="the device is gone"):
        llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.block_manager.host.entries


@pytest.mark.parametrize("options, message", [
    (dict(kv_offloading_size=0), "kv_offloading_size must be a finite number of GiB > 0"),
    (dict(kv_offloading_size="1"), "kv_offloading_size must be a finite number of GiB > 0"),
    (dict(kv_offloading_size=float("inf")), "kv_offloading_size must be a finite number of GiB > 0"),
    (dict(kv_offloading_size=float("nan")), "kv_offloading_size must be a finite number of GiB > 0"),
    (dict(kv_offloading_size=1, kv_offloading_backend="lmcache"), "kv_offloading_backend must be 'native'"),
    (dict(kv_offloading_size=1, enable_prefix_caching=False), "needs enable_prefix_caching"),
    (dict(kv_offloading_size=1, runner="pooling"), "a pooling runner's prompts take nothing"),
    (dict(kv_offloading_size=1, speculative_config={"method": "draft_model", "model": "SELF",
                                                     "num_speculative_tokens": 2}), "not with a draft model"),
    (dict(kv_offloading_size=host_gib(0.5), block_size=4), "holds no KV block"),
])
def test_bad_offloading_options_are_clear_errors(tiny_checkpoint, options, message):
    if options.get("speculative_config", {}).get("model") == "SELF":
        options["speculative_config"]["model"] = tiny_checkpoint
    with pytest.raises(ValueError, match=message):
        LLM(tiny_checkpoint, device="cpu", num_kv_blocks=16, **options)
