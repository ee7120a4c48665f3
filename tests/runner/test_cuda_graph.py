"""What can be checked of the CUDA-graph runner without a GPU (capture and replay are checked on
the H200 by benchmarks/gpu_correctness.py: graph logits bitwise equal to the same padded batch)."""
import dataclasses

import torch

from mini_engine.config import EngineConfig
from mini_engine.runner.cuda_graph import CUDAGraphRunner, graph_batch_sizes
from mini_engine.runner.model_runner import ModelRunner


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
