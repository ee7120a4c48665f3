"""Eager steps of more than max_num_seqs tokens pad to a multiple of EAGER_TOKEN_MULTIPLE rows, and
ModelRunner.load_gemm_kernels launches each cuBLAS product at start-up at every row count that
leaves (benchmarks/NOTES.md entry 33: a kernel's first launch waits for the device to drain).
Whole runs through padded steps are checked against transformers in
tests/engine/test_greedy_vs_transformers.py::test_every_triton_kernel."""
import pytest

from mini_engine.config import EngineConfig
from mini_engine.runner.batch import BatchRow
from mini_engine.runner.model_runner import EAGER_TOKEN_MULTIPLE, ModelRunner, gemm_row_counts, padded_token_count
from mini_engine.sampling_params import SamplingParams


@pytest.mark.parametrize("max_num_seqs,max_tokens", [(256, 16384), (8, 100), (256, 128), (1, 1), (64, 8190)])
def test_row_counts_cover_every_padded_step(max_num_seqs, max_tokens):
    sample_rows, token_rows = gemm_row_counts(max_num_seqs, max_tokens)
    assert sample_rows == list(range(1, max_num_seqs + 1))
    assert token_rows == sorted(set(token_rows))
    small = min(max_num_seqs, max_tokens)
    assert token_rows[:small] == list(range(1, small + 1))      # every count a decode batch can have
    assert all(n % EAGER_TOKEN_MULTIPLE == 0 for n in token_rows[small:])
    assert len(token_rows) <= small + max_tokens // EAGER_TOKEN_MULTIPLE + 1
    for n in range(1, max_tokens + 1):
        padded = padded_token_count(n, max_num_seqs)
        assert padded in token_rows and n <= padded < n + EAGER_TOKEN_MULTIPLE
        assert padded == n or n > max_num_seqs            # decode batches are never padded


def test_a_padded_step_adds_tokens_of_no_sequence(tiny_checkpoint):
    """The padding tokens follow the real ones, write no KV (slot -1) and lie past the last
    sequence's queries; rows, sequence lengths and the logits rows stay the real step's."""
    pytest.importorskip("triton")
    runner = ModelRunner(EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=64, max_model_len=256,
                                      max_num_seqs=2, max_num_batched_tokens=200, block_size=4, kernels="attention"))
    params = SamplingParams(temperature=0, max_tokens=1)
    rows = [BatchRow([7], 5, [0, 1], True, params),                         # a decode row first
            BatchRow(list(range(3, 12)), 0, [2, 3, 4], True, params)]       # a 9-token prefill
    t, meta = runner.prepare_inputs(rows)
    ids, logits_indices = t.input_ids, t.logits_indices
    assert (ids.shape[0] == t.positions.shape[0] == meta.slot_mapping.shape[0] == t.prev_index.shape[0]
            == EAGER_TOKEN_MULTIPLE)
    assert ids[:10].tolist() == [7] + list(range(3, 12)) and ids[10:].eq(0).all()
    assert meta.slot_mapping[:10].ge(0).all() and meta.slot_mapping[10:].eq(-1).all()
    assert meta.query_start_loc.tolist() == [0, 1, 10] and meta.seq_lens.tolist() == [6, 9]
    assert logits_indices.tolist() == [0, 9] and t.prev_index.eq(-1).all()
    # A step of no more tokens than a decode batch can have is never padded.
    t, meta = runner.prepare_inputs(rows[:1])
    assert t.input_ids.shape[0] == 1 and meta.slot_mapping.shape[0] == 1
    # Nor is any step where the varlen attention kernel is off (the reference gives each token a row).
    plain = ModelRunner(EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=64, max_model_len=256,
                                     max_num_seqs=2, max_num_batched_tokens=200, block_size=4, kernels="none"))
    assert plain.prepare_inputs(rows)[0].input_ids.shape[0] == 10
    # The step input buffers hold the largest step once padded (200 tokens -> 256).
    full = [rows[0], BatchRow([5] * 199, 0, list(range(2, 52)), True, params)]
    t, meta = runner.prepare_inputs(full)
    assert t.input_ids.shape[0] == 256 and meta.query_start_loc.tolist() == [0, 1, 200]
