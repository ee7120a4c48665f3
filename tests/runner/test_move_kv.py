"""ModelRunner.move_kv, the host tier's copies (kv_offloading_size): a block stored to a host slot
and loaded into another block comes back bit for bit, every layer's K and V, and nothing else of
the pool moves. On CUDA (run on the H200) the copies cross to pinned memory and back on the
device's stream; on CPU they are plain copies."""
import pytest
import torch

from mini_engine.config import EngineConfig
from mini_engine.runner.model_runner import ModelRunner


@pytest.mark.parametrize("device, kv_cache_dtype", [
    ("cpu", "auto"),
    pytest.param("cuda", "auto", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
    pytest.param("cuda", "fp8", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
])
def test_a_block_goes_to_the_host_and_comes_back_whole(tiny_checkpoint, device, kv_cache_dtype):
    runner = ModelRunner(EngineConfig(tiny_checkpoint, device=device, num_kv_blocks=8, block_size=16,
                                      kv_cache_dtype=kv_cache_dtype, kv_offloading_size=2**-16, enforce_eager=True))
    assert runner.num_host_kv_blocks >= 2
    assert runner.host_kv_cache.is_pinned() == (device == "cuda")
    kv = runner.kv_cache
    kv.copy_(torch.randn(kv.shape, device=kv.device).to(kv.dtype))
    before = kv.clone()
    runner.move_kv(stores=[(3, 1), (5, 0)], loads=[])
    kv[:, :, 3].zero_()                 # the block handed out again and overwritten
    runner.move_kv(stores=[], loads=[(1, 6), (0, 2)])
    after = kv.cpu().view(torch.uint8)
    expect = before.clone()
    expect[:, :, 3] = 0
    expect[:, :, 6], expect[:, :, 2] = before[:, :, 3], before[:, :, 5]
    assert torch.equal(after, expect.cpu().view(torch.uint8))
