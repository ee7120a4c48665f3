"""ModelRunner.move_kv, the host tier's copies (kv_offloading_size): a block stored to a host slot
and loaded into another block comes back bit for bit, every layer's K and V, and nothing else of
the pool moves. On CUDA (run on the H200) the copies cross to pinned memory and back on the
device's stream; on CPU they are plain copies."""
import pytest
import torch

from mini_engine.config import EngineConfig
from mini_engine.runner.model_runner import ModelRunner, host_tier_chunks


def test_the_host_tier_is_pinned_in_chunks_that_pin_what_they_ask():
    """PyTorch's pinned allocator rounds an allocation up to a power of two: every chunk's bytes
    round to at most what the chunk was given, all of them together to at most the tier's size,
    and the chunks lose less than a slot each (and the end, less than two)."""
    for num_bytes, slot_bytes in [(12 * 2**30, 7 * 2**20), (3 * 2**13, 2**13), (10**9 + 7, 114688 * 64),
                                  (2**20, 3 * 2**20), (5 * 2**30, 2**31 + 1)]:
        chunks = host_tier_chunks(num_bytes, slot_bytes)
        pinned = [1 << (n * slot_bytes - 1).bit_length() for n in chunks]
        assert sum(pinned) <= num_bytes
        assert sum(chunks) * slot_bytes >= num_bytes - (len(chunks) + 2) * slot_bytes
    assert host_tier_chunks(3 * 2**13, 2**13) == [2, 1]
    assert host_tier_chunks(2**20, 3 * 2**20) == []
    assert sum(host_tier_chunks(12 * 2**30, 7 * 2**20)) == 12 * 146


@pytest.mark.parametrize("device, kv_cache_dtype", [
    ("cpu", "auto"),
    pytest.param("cuda", "auto", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
    pytest.param("cuda", "fp8", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
])
def test_a_block_goes_to_the_host_and_comes_back_whole(tiny_checkpoint, device, kv_cache_dtype):
    # 24 KiB: chunks of 16 and 8 KiB (host_tier_chunks), 3 slots of 8 KiB on the CPU (fp32), 6 of
    # bf16 or 12 of fp8 on CUDA; slot 2 lies in the second chunk on the CPU.
    runner = ModelRunner(EngineConfig(tiny_checkpoint, device=device, num_kv_blocks=8, block_size=16,
                                      kv_cache_dtype=kv_cache_dtype, kv_offloading_size=3 * 2**13 / 2**30,
                                      enforce_eager=True))
    assert runner.num_host_kv_blocks == 3 * 2**13 // (runner.kv_bytes_per_token * 16)
    assert all(slot.is_pinned() == (device == "cuda") for slot in runner.host_kv_slots)
    kv = runner.kv_cache
    kv.copy_(torch.randn(kv.shape, device=kv.device).to(kv.dtype))
    before = kv.clone()
    runner.move_kv(stores=[(3, 2), (5, 0)], loads=[])
    kv[:, :, 3].zero_()                 # the block handed out again and overwritten
    runner.move_kv(stores=[], loads=[(2, 6), (0, 2)])
    after = kv.cpu().view(torch.uint8)
    expect = before.clone()
    expect[:, :, 3] = 0
    expect[:, :, 6], expect[:, :, 2] = before[:, :, 3], before[:, :, 5]
    assert torch.equal(after, expect.cpu().view(torch.uint8))
