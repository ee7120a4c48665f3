"""What can be checked of the CUDA-graph runner without a GPU (capture and replay are checked on
the H200 by benchmarks/gpu_correctness.py: graph logits bitwise equal to the same padded batch)."""
import dataclasses
import random

import pytest
import torch

from mini_engine.config import EngineConfig
from mini_engine.runner.cuda_graph import CUDAGraphRunner, graph_batch_sizes
from mini_engine.runner.batch import BatchRow
from mini_engine.runner.model_runner import ModelRunner
from mini_engine.sampling_params import SamplingParams


def test_batch_size_ladder():
    assert graph_batch_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(1) == [1]


def test_reserved_bytes_cover_the_static_buffers(tiny_checkpoint):
    """The KV pool is sized leaving room for the graphs' buffers: the estimate must be exact."""
    runner = ModelRunner(EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=8, max_model_len=100))
    graphs = CUDAGraphRunner(runner.model, 24, 100, 16, torch.device("cpu"))
    allocated = sum(t.nbytes for t in dataclasses.astuple(graphs.buffers))
    assert CUDAGraphRunner.buffer_bytes(24, 100, 16, runner.model_config.vocab_size, runner.dtype) == allocated


@pytest.mark.parametrize("kernels", ["none", "attention,rope_kv"])
@pytest.mark.parametrize("num_rows", [5, 8])
def test_two_batch_overlap_matches_one_batch(tiny_checkpoint, kernels, num_rows):
    """A graph's forward split into two overlapping halves gives the logits of the whole batch,
    with the padded rows (5 pads to 8) in the second half. On the CPU the two streams run in
    order, so this checks the split and the layer halves; the overlap itself is checked on the
    GPU (benchmarks/gpu_correctness.py, tests/runner/test_two_batch_overlap_gpu.py)."""
    runner = ModelRunner(EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=64, max_model_len=100,
                                      kernels=kernels))
    rng = random.Random(num_rows)
    params = SamplingParams(temperature=0, max_tokens=4)
    rows = []
    for i in range(num_rows):
        prompt_len = rng.randrange(5, 60)
        table = list(range(i * 6, i * 6 + 6))
        runner.execute([BatchRow([rng.randrange(256) for _ in range(prompt_len)], 0, table, True, params)])
        rows.append(BatchRow([rng.randrange(256)], prompt_len, table, True, params))
    graphs = CUDAGraphRunner(runner.model, 8, 100, runner.block_size, torch.device("cpu"), overlap_min_batch=2)
    with torch.inference_mode():
        ids, pos, meta, _ = runner.prepare_inputs(rows)
        bs = graphs.load(ids, pos, meta)
        assert bs == 8 and graphs.overlaps(bs)
        graphs.forward(bs)
        split = graphs.buffers.logits[:num_rows].clone()
        graphs.overlap_min_batch = None
        graphs.forward(bs)                    # rewrites the same K/V into the same slots
        whole = graphs.buffers.logits[:num_rows].clone()
        direct = runner.model.compute_logits(runner.model(ids, pos, meta))
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split, direct, rtol=1e-5, atol=1e-5)
    assert split.std() > 0.1                  # real logits, not a constant both paths agree on


def test_overlap_threshold_is_validated(tiny_checkpoint):
    with pytest.raises(ValueError, match="two_batch_overlap_min_batch"):
        EngineConfig(tiny_checkpoint, device="cpu", two_batch_overlap_min_batch=1)
