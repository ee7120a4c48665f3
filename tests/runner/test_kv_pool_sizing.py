"""kv_cache_memory_bytes (vLLM's): the KV pool's bytes on each device, in place of what
gpu_memory_utilization leaves (cpu_kv_blocks on the CPU); a draft model's slots count in them."""
import pytest

from mini_engine import LLM

BLOCK_BYTES = 8192      # the tiny checkpoint's block of 16 tokens: 2 layers x K and V x 2 heads x 16 x fp32


def test_the_pool_holds_the_blocks_its_bytes_hold(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, device="cpu", block_size=16, kv_cache_memory_bytes=100 * BLOCK_BYTES + 5)
    assert llm.engine.block_manager.num_blocks == 100
    assert llm.engine.runner.kv_cache.nbytes == 100 * BLOCK_BYTES


def test_a_draft_models_slots_count_in_the_bytes(tiny_checkpoint):
    """A draft that is the target costs each slot as much again: half the blocks."""
    llm = LLM(tiny_checkpoint, device="cpu", block_size=16, kv_cache_memory_bytes=100 * BLOCK_BYTES,
              speculative_config={"method": "draft_model", "model": tiny_checkpoint, "num_speculative_tokens": 2})
    assert llm.engine.block_manager.num_blocks == 50


def test_too_few_bytes_for_a_sequence_warn_and_name_the_option(tiny_checkpoint):
    with pytest.warns(UserWarning, match="fewer than one max_model_len=512 sequence.*Raise kv_cache_memory_bytes"):
        LLM(tiny_checkpoint, device="cpu", block_size=16, kv_cache_memory_bytes=3 * BLOCK_BYTES)


@pytest.mark.parametrize("options, message", [
    (dict(kv_cache_memory_bytes=0), "kv_cache_memory_bytes must be an integer number of bytes >= 1"),
    (dict(kv_cache_memory_bytes=1.5e6), "kv_cache_memory_bytes must be an integer number of bytes >= 1"),
    (dict(kv_cache_memory_bytes=True), "kv_cache_memory_bytes must be an integer number of bytes >= 1"),
    (dict(kv_cache_memory_bytes=2**20, num_kv_blocks=8), "give num_kv_blocks or kv_cache_memory_bytes, not both"),
    (dict(kv_cache_memory_bytes=BLOCK_BYTES - 1), "kv_cache_memory_bytes=8191 holds no KV block"),
])
def test_bad_sizes_are_clear_errors(tiny_checkpoint, options, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_checkpoint, device="cpu", block_size=16, **options)
