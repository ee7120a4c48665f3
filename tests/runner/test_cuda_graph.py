"""What can be checked of the CUDA-graph runner without a GPU: the batch-size ladder, the memory
it reserves, and that a step staged for a graph lands where the graph reads (capture and replay
are checked on the H200 by benchmarks/gpu_correctness.py: graph logits bitwise equal to the same
padded batch run eagerly)."""
import dataclasses

import torch

from mini_engine.config import EngineConfig
from mini_engine.runner.batch import BatchRow
from mini_engine.runner.cuda_graph import CUDAGraphRunner, graph_batch_sizes
from mini_engine.runner.model_runner import ModelRunner
from mini_engine.sampling_params import SamplingParams


def test_batch_size_ladder():
    assert graph_batch_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(1) == [1]


def test_reserved_bytes_cover_the_static_buffers(tiny_checkpoint):
    """The KV pool is sized leaving room for the graphs' logits buffer: the estimate must be exact."""
    runner = ModelRunner(EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=8, max_model_len=100))
    graphs = CUDAGraphRunner(runner.model, 24, torch.device("cpu"))
    assert CUDAGraphRunner.buffer_bytes(24, runner.model_config.vocab_size, runner.dtype) == graphs.logits.nbytes


def _decode_rows(n, block_size, params):
    rows = []
    for i in range(n):
        ctx = 5 + 7 * i
        rows.append(BatchRow([100 + i], ctx, list(range(10 * i, 10 * i + ctx // block_size + 1)), True, params))
    return rows


def test_a_step_staged_for_a_graph_lands_where_the_graph_reads(tiny_checkpoint):
    """A graph reads its inputs from the views it was captured on (a padding-only step laid out for
    its batch size). A real step staged for that size must fill exactly those views, its rows
    first and padding rows (slot -1, context 1, block 0) after; the data must be the eager
    step's, and the graph's tables max_model_len wide."""
    runner = ModelRunner(EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=64, max_model_len=100,
                                      max_num_seqs=24, block_size=4))
    params = SamplingParams(temperature=0, max_tokens=4)
    rows = _decode_rows(13, 4, params)
    captured_ids, captured_pos, captured_meta = runner.prepare_inputs([], graph_size=16)[:3]
    assert captured_meta.slot_mapping.tolist() == [-1] * 16 and captured_meta.seq_lens.tolist() == [1] * 16
    eager_ids, eager_pos, eager_meta, _ = (t.clone() if isinstance(t, torch.Tensor) else t
                                           for t in runner.prepare_inputs(rows))
    eager_meta = dataclasses.replace(eager_meta, **{f: getattr(eager_meta, f).clone() for f in
                                                    ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")})
    ids, pos, meta, _ = runner.prepare_inputs(rows, graph_size=16)
    for staged, captured in ((ids, captured_ids), (pos, captured_pos), (meta.slot_mapping, captured_meta.slot_mapping),
                             (meta.seq_lens, captured_meta.seq_lens), (meta.block_tables, captured_meta.block_tables),
                             (meta.query_start_loc, captured_meta.query_start_loc)):
        assert staged.data_ptr() == captured.data_ptr() and staged.shape == captured.shape
    assert torch.equal(ids[:13], eager_ids) and torch.equal(pos[:13], eager_pos)
    assert torch.equal(meta.slot_mapping[:13], eager_meta.slot_mapping) and meta.slot_mapping[13:].tolist() == [-1] * 3
    assert torch.equal(meta.seq_lens[:13], eager_meta.seq_lens) and meta.seq_lens[13:].tolist() == [1] * 3
    assert meta.query_start_loc.tolist() == list(range(17))
    width = eager_meta.block_tables.shape[1]
    assert meta.block_tables.shape == (16, 25)                     # ceil(100 / 4)
    assert torch.equal(meta.block_tables[:13, :width], eager_meta.block_tables)
    assert (meta.block_tables[:13, width:] == -1).all() and (meta.block_tables[13:] == 0).all()
    assert meta.num_decodes == 16 and meta.max_query_len == 1 and meta.max_seq_len == 100


def test_tokens_from_the_previous_launch_fill_the_staged_ids(tiny_checkpoint):
    """Rows whose input token was sampled by the launch still in flight take it on the device,
    in the staged buffer itself (so a graph replay reads it)."""
    runner = ModelRunner(EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=64, max_model_len=100,
                                      max_num_seqs=24, block_size=4))
    rows = _decode_rows(5, 4, SamplingParams(temperature=0, max_tokens=4))
    rows[1].prev_token_index, rows[3].prev_token_index = 2, 0
    runner.prev_sampled_tokens = torch.tensor([7, 8, 9])
    ids = runner.prepare_inputs(rows, graph_size=8)[0]
    assert ids.tolist() == [100, 9, 102, 7, 104, 0, 0, 0]


def test_staged_arrays_start_aligned(tiny_checkpoint):
    """Every staged array starts 128 bytes from another into its buffer (whose base the CUDA
    allocator aligns to 512): Triton specialises its kernels on pointer alignment, so views whose
    alignment moved with the step's sizes compiled new kernel variants mid-run. Odd sizes too."""
    runner = ModelRunner(EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=64, max_model_len=100,
                                      max_num_seqs=24, block_size=4))
    params = SamplingParams(temperature=0, max_tokens=4)
    for n, graph_size in ((13, None), (13, 16), (1, 1), (7, None)):
        rows = _decode_rows(n, 4, params)
        rows[0].prev_token_index = 0
        runner.prev_sampled_tokens = torch.tensor([3])
        ids, pos, meta, logits_indices = runner.prepare_inputs(rows, graph_size)
        for t in (ids, pos, logits_indices, meta.slot_mapping):
            assert (t.data_ptr() - runner.inputs.int64.data_ptr()) % 128 == 0
        for t in (meta.seq_lens, meta.query_start_loc, meta.block_tables):
            assert (t.data_ptr() - runner.inputs.int32.data_ptr()) % 128 == 0
