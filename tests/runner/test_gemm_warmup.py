"""The row counts at which ModelRunner.load_gemm_kernels launches each cuBLAS product at start-up
(benchmarks/NOTES.md entry 33: a kernel's first launch waits for the device to drain)."""
import pytest

from mini_engine.runner.model_runner import gemm_row_counts


@pytest.mark.parametrize("max_num_seqs,max_tokens", [(256, 16384), (8, 100), (256, 128), (1, 1), (64, 8192)])
def test_every_sampled_row_count_and_a_ladder_of_token_counts(max_num_seqs, max_tokens):
    sample_rows, token_rows = gemm_row_counts(max_num_seqs, max_tokens, token_stride=64)
    assert sample_rows == list(range(1, max_num_seqs + 1))
    assert token_rows == sorted(set(token_rows)) and token_rows[0] == 1 and token_rows[-1] == max_tokens
    small = min(max_num_seqs, max_tokens)
    assert token_rows[:small] == list(range(1, small + 1))      # every count a decode batch can have
    # Beyond those, no token count is more than one stride from a count that ran.
    assert all(b - a <= 64 for a, b in zip(token_rows, token_rows[1:]))
    assert all(n % 64 == 0 for n in token_rows[small:-1])
