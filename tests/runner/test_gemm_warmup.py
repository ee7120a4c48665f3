"""The row counts at which ModelRunner.load_gemm_kernels launches each cuBLAS product at start-up,
against the token counts eager steps can have once padded (benchmarks/NOTES.md entry 33: a
kernel's first launch waits for the device to drain)."""
import pytest

from mini_engine.runner.model_runner import EAGER_TOKEN_MULTIPLE, gemm_row_counts, padded_token_count


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
