import numpy as np
import pytest
import torch

pytest.importorskip("triton")
from mini_engine.kernels.paged_attention import (  # noqa: E402
    DECODE_PROGRAMS_PER_SM, DECODE_STAGES, paged_attention, paged_attention_ref, paged_decode_attention,
    paged_decode_attention_torch, paged_prefill_attention, prefill_block_q, prefill_work)

HEAD_DIM = 32
TOL = {torch.float32: dict(atol=2e-3, rtol=2e-3), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


def make_batch(query_lens, seq_lens, num_heads, num_kv_heads, block_size, device, dtype=torch.bfloat16, seed=0,
               head_dim=HEAD_DIM):
    """A paged batch: each sequence's blocks are scattered over a shuffled pool (with spare blocks
    nobody owns), block tables padded with -1, and K/V for every slot already in the cache."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    pool = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq) + 2), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        block_tables[b, :n] = pool[used:used + n]
        used += n
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(device, dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(device, dtype)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(device, dtype)
    query_start_loc = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    return (q, k_cache, v_cache, block_tables.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc.to(device))


def check(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc):
    ref = paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, q.shape[-1] ** -0.5)
    torch.testing.assert_close(out, ref, **TOL[q.dtype])


# Ragged contexts: length 1, block boundaries (b - 1, b, b + 1 for b = 16), many blocks.
DECODE_SEQ_LENS = [1, 15, 16, 17, 33, 130]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 1)])     # GQA ratios 1, 2, 8
@pytest.mark.parametrize("block_size", [1, 16, 256])                             # 256 > every context
def test_decode_matches_reference(device, num_heads, num_kv_heads, block_size):
    batch = make_batch([1] * len(DECODE_SEQ_LENS), DECODE_SEQ_LENS, num_heads, num_kv_heads, block_size, device)
    out = paged_attention(*batch, HEAD_DIM ** -0.5, max_query_len=1, max_seq_len=max(DECODE_SEQ_LENS))
    check(out, *batch)


@pytest.mark.parametrize("num_splits,tile_n", [(1, 16), (3, 16), (8, 32), (40, 16)])  # 40: most splits empty
@pytest.mark.parametrize("row_blocks_limit", [None, 0])      # the block-table row up front, or each tile's ids
def test_decode_splits_match_reference(device, num_splits, tile_n, row_blocks_limit):
    batch = make_batch([1] * len(DECODE_SEQ_LENS), DECODE_SEQ_LENS, 4, 2, 4, device)
    out = paged_decode_attention(*batch, HEAD_DIM ** -0.5, max_seq_len=max(DECODE_SEQ_LENS),
                                 num_splits=num_splits, tile_n=tile_n, row_blocks_limit=row_blocks_limit)
    check(out, *batch)


@pytest.mark.parametrize("num_stages", sorted(DECODE_PROGRAMS_PER_SM))
def test_decode_stage_counts_match_reference(device, num_stages):
    """The engine's stage count and the others the sweeps launch (on the GPU each compiles its own
    pipeline)."""
    assert DECODE_STAGES in DECODE_PROGRAMS_PER_SM
    batch = make_batch([1] * len(DECODE_SEQ_LENS), DECODE_SEQ_LENS, 4, 2, 16, device)
    out = paged_decode_attention(*batch, HEAD_DIM ** -0.5, max_seq_len=max(DECODE_SEQ_LENS), num_stages=num_stages)
    check(out, *batch)


def test_decode_row_blocks():
    """The row a decode program keeps covers every block a tile can reach (the row rounded up to
    whole tiles), in one of three sizes so that tables of any width compile at most three variants;
    a row longer than the largest falls back to per-tile loads (0)."""
    from mini_engine.kernels.paged_attention import ROW_BLOCKS_SIZES, _row_blocks
    assert ROW_BLOCKS_SIZES == (128, 512, 1024)
    assert _row_blocks(128, 16, 64) == 128             # max_model_len 2,048 at block size 16
    assert _row_blocks(3, 16, 64) == 128
    assert _row_blocks(129, 16, 64) == 512             # 2,064 tokens: reaches block 131
    assert _row_blocks(512, 16, 64) == 512
    assert _row_blocks(513, 16, 64) == 1024
    assert _row_blocks(640, 64, 64) == 1024            # Qwen3's default max_model_len, 40,960, on CUDA
    assert _row_blocks(1024, 64, 64) == 1024
    assert _row_blocks(1025, 64, 64) == 0
    assert _row_blocks(130, 1, 16) == 512              # block size 1: 144 entries with whole tiles


def test_decode_with_a_1024_entry_row_matches_reference(device):
    """A table wider than 512 entries (one-token blocks, so that a short context reaches it)
    takes the 1,024-entry row; one wider than that, per-tile ids."""
    from mini_engine.kernels.paged_attention import _row_blocks
    for seq_lens in ([700, 37], [1100, 5]):
        batch = make_batch([1, 1], seq_lens, 4, 2, 1, device)
        assert _row_blocks(batch[3].shape[1], 1, 16) == (1024 if seq_lens[0] < 1024 else 0)
        out = paged_decode_attention(*batch, HEAD_DIM ** -0.5, max_seq_len=max(seq_lens), num_splits=3, tile_n=16)
        check(out, *batch)


def test_decode_with_graph_upper_bound(device):
    """Under CUDA graphs max_seq_len is max_model_len, far above every real context: the split
    count comes from it, and the short contexts leave most splits empty."""
    batch = make_batch([1, 1], [40, 3], 4, 2, 16, device)
    out = paged_attention(*batch, HEAD_DIM ** -0.5, max_query_len=1, max_seq_len=4096)
    check(out, *batch)


# Mixed batch: decode rows, a fresh prefill, chunks that follow cached context (prefix hits,
# earlier chunks), chunks crossing block boundaries, and a decode row after the prefills.
MIXED_QUERY_LENS = [1, 1, 9, 17, 5, 1, 33]
MIXED_SEQ_LENS = [7, 40, 9, 30, 16 + 5, 50, 33 + 48]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_mixed_batch_matches_reference(device, num_heads, num_kv_heads, block_size):
    batch = make_batch(MIXED_QUERY_LENS, MIXED_SEQ_LENS, num_heads, num_kv_heads, block_size, device, seed=1)
    out = paged_attention(*batch, HEAD_DIM ** -0.5, max_query_len=max(MIXED_QUERY_LENS),
                          max_seq_len=max(MIXED_SEQ_LENS))
    check(out, *batch)


@pytest.mark.parametrize("block_m,tile_n", [(16, 16), (32, 64)])
def test_prefill_small_query_blocks(device, block_m, tile_n):
    """Several query blocks per sequence (block_m 16 with 8 heads per KV head: 2 tokens a block)."""
    batch = make_batch(MIXED_QUERY_LENS, MIXED_SEQ_LENS, 8, 1, 4, device, seed=2)
    out = paged_prefill_attention(*batch, HEAD_DIM ** -0.5, block_m=block_m, tile_n=tile_n)
    check(out, *batch)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton's interpreter compiles nothing to count")
def test_prefill_compiles_once_whatever_the_table_width(device):
    """A mixed step's block table is as wide as its longest sequence, and that width is the prefill
    kernel's row stride. Specialised on it, the kernel compiled a second variant the first time the
    width was a multiple of 16, in the middle of a benchmark run (benchmarks/NOTES.md, entry 42)."""
    from mini_engine.kernels.paged_attention import _paged_prefill_kernel

    def kernel_caches():
        return [cache[0] if isinstance(cache, tuple) else cache
                for cache in _paged_prefill_kernel.device_caches.values()]

    # Variants that earlier tests compiled (a table width that is a multiple of 16 among them)
    # would hide a second one here.
    for cache in kernel_caches():
        cache.clear()
    counts = []
    for longest in (60, 56, 120):       # block size 4: tables 17, 16 and 32 wide
        batch = make_batch([5, 3], [longest, 10], 4, 2, 4, device, seed=longest)
        assert batch[3].shape[1] == (longest + 3) // 4 + 2
        check(paged_prefill_attention(*batch, HEAD_DIM ** -0.5), *batch)
        counts.append(sum(len(cache) for cache in kernel_caches()))
    assert counts[0] >= 1                                   # the count sees the compile at all
    assert counts == [counts[0]] * 3, counts


def test_prefill_work_items():
    """One item for every block of block_q query tokens, sequence by sequence; none for a sequence
    with no query tokens; each item's first query position counts the cached context before it."""
    work = prefill_work([1, 0, 5, 2], [7, 3, 12, 2], block_q=2)
    assert work.dtype == np.int32
    assert work.tolist() == [[0, 0, 1, 6],
                             [2, 1, 2, 7], [2, 3, 2, 9], [2, 5, 1, 11],
                             [3, 6, 2, 0]]
    assert prefill_work([], [], block_q=4).shape == (0, 4)


def test_prefill_over_a_staged_work_list(device):
    """The engine passes the work list it staged; a batch of any width takes one pass."""
    query_lens, seq_lens = [1, 3] * 40, [5, 9] * 40
    batch = make_batch(query_lens, seq_lens, 4, 2, 4, device, seed=3)
    work = torch.from_numpy(prefill_work(query_lens, seq_lens, prefill_block_q(2))).to(device)
    check(paged_attention(*batch, HEAD_DIM ** -0.5, max_query_len=3, max_seq_len=9, prefill_work=work), *batch)


@pytest.mark.parametrize("max_query_len", [1, 9])
def test_fp32_and_out_argument(device, max_query_len):
    query_lens = [1, 1, 1] if max_query_len == 1 else [1, 9, 3]
    batch = make_batch(query_lens, [20, 12, 64], 4, 2, 16, device, dtype=torch.float32, seed=3)
    out = torch.full_like(batch[0], float("nan"))
    result = paged_attention(*batch, HEAD_DIM ** -0.5, max_query_len=max_query_len, max_seq_len=64, out=out)
    assert result.data_ptr() == out.data_ptr()
    check(out, *batch)


@pytest.mark.parametrize("head_dim", [8, 80])       # below tl.dot's 16, and not a power of two
@pytest.mark.parametrize("max_query_len", [1, 9])
def test_head_dim_padded(device, head_dim, max_query_len):
    query_lens = [1, 1, 1] if max_query_len == 1 else [1, 9, 3]
    batch = make_batch(query_lens, [20, 12, 64], 4, 2, 16, device, seed=4, head_dim=head_dim)
    out = paged_attention(*batch, head_dim ** -0.5, max_query_len=max_query_len, max_seq_len=64)
    check(out, *batch)
    if max_query_len == 1:      # and through the split path's partial buffers
        check(paged_decode_attention(*batch, head_dim ** -0.5, max_seq_len=64, num_splits=3, tile_n=16), *batch)


def test_decode_split_count():
    """Enough programs to fill every slot where the batch is small (three a SM at 3 stages, as many
    as fit at other counts); one split once the batch alone fills them; never more than the
    longest context has tiles."""
    from mini_engine.kernels.paged_attention import decode_num_splits
    assert decode_num_splits(1, 8, 2048, 128, 132, 3) == 16          # capped by the 16 tiles of 2,048 tokens
    assert decode_num_splits(1, 8, 2048, 64, 132, 3) == 32
    assert decode_num_splits(15, 8, 2048, 64, 132, 3) == 4           # 120 programs x 4 fill 396 slots
    assert decode_num_splits(31, 8, 2048, 64, 132, 3) == 2
    assert decode_num_splits(48, 8, 2048, 64, 132, 3) == 2           # 384 programs: not quite every slot
    assert decode_num_splits(50, 8, 2048, 64, 132, 3) == 1           # 400 >= 3 x 132
    assert decode_num_splits(256, 8, 2048, 64, 132, 3) == 1
    assert decode_num_splits(4, 8, 100, 64, 132, 3) == 2             # 100 tokens: two tiles
    assert decode_num_splits(15, 8, 2048, 64, 132, 4) == 3           # two a SM: 264 slots
    assert decode_num_splits(15, 8, 2048, 64, 132, 2) == 5           # four a SM: 528 slots
    assert decode_num_splits(15, 8, 2048, 64, 132, 5) == 4           # outside the table: as 3 stages


def test_decode_splits_in_a_given_workspace(device):
    """The splits' partial results in a caller's workspace (the runner's one scratch for every
    layer), sized by decode_workspace_numel for any batch up to its maximum; a workspace too
    small for the launch is a clear error, not a write past its end."""
    from mini_engine.kernels.paged_attention import _split_partials, decode_num_splits, decode_workspace_numel
    from mini_engine.kernels.triton_utils import num_sms
    max_len = max(DECODE_SEQ_LENS)
    numel = decode_workspace_numel(len(DECODE_SEQ_LENS), 4, 2, HEAD_DIM, max_len, torch.device(device))
    for num_seqs in (1, 2, len(DECODE_SEQ_LENS)):
        lens = DECODE_SEQ_LENS[-num_seqs:]
        batch = make_batch([1] * num_seqs, lens, 4, 2, 16, device, seed=num_seqs)
        workspace = torch.full((numel,), float("nan"), device=device)
        out = paged_decode_attention(*batch, HEAD_DIM ** -0.5, max_seq_len=max_len, workspace=workspace)
        check(out, *batch)
        splits = decode_num_splits(num_seqs, 2, max_len, 64, num_sms(batch[0].device), DECODE_STAGES)
        assert workspace.isnan().all().item() == (splits == 1)       # written where the launch splits
    # One sequence, one KV head of two query heads, three splits: 6 partial rows, so the maxima and
    # sums start at the next multiple of 4 rows, not right after the accumulators.
    batch = make_batch([1], [130], 2, 1, 16, device)
    workspace = torch.full((decode_workspace_numel(1, 2, 1, HEAD_DIM, 130, torch.device(device)),), float("nan"),
                           device=device)
    assert decode_num_splits(1, 1, 130, 64, num_sms(batch[0].device), DECODE_STAGES) == 3
    check(paged_decode_attention(*batch, HEAD_DIM ** -0.5, max_seq_len=130, workspace=workspace), *batch)
    views = _split_partials(workspace, 1, 2, 3, HEAD_DIM, workspace.device)
    spans = sorted((v.data_ptr(), v.data_ptr() + v.numel() * 4) for v in views)
    assert all(start % 16 == 0 for start, _ in spans)                  # aligned, as Triton specialises on it
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))    # apart
    batch = make_batch([1], [130], 4, 2, 16, device)
    with pytest.raises(ValueError, match="decode_workspace_numel"):
        paged_decode_attention(*batch, HEAD_DIM ** -0.5, max_seq_len=130, num_splits=3,
                               workspace=torch.empty(10, device=device))


def test_decode_rejects_more_sequences_than_the_grid_holds(device):
    """Sequences go on CUDA's grid z (at most 65,535): more is a clear error, not a launch failure."""
    num_seqs = 65536
    q = torch.zeros(num_seqs, 2, 16, device=device)
    cache = torch.zeros(1, 16, 1, 16, device=device)
    tables = torch.zeros(num_seqs, 1, dtype=torch.int32, device=device)
    lens = torch.ones(num_seqs, dtype=torch.int32, device=device)
    loc = torch.arange(num_seqs + 1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="65,535 sequences"):
        paged_decode_attention(q, cache, cache, tables, lens, loc, 0.25, max_seq_len=1)


@pytest.mark.parametrize("query_lens,seq_lens", [([1] * len(DECODE_SEQ_LENS), DECODE_SEQ_LENS),  # decode
                                                 ([1, 1, 9, 17], [15, 70, 9, 40])])            # mixed
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cache_matches_reference(device, query_lens, seq_lens, dtype, fp8):
    """kv_cache_dtype "fp8" and "fp8_e5m2": K and V stored in fp8, dequantised as they load. K
    spans the normal numbers, V reaches the subnormals (below 2^-6 in e4m3, 2^-14 in e5m2)."""
    q, k_cache, v_cache, block_tables, lens, starts = make_batch(query_lens, seq_lens, 4, 2, 16, device, dtype)
    v_scale = 0.01 if fp8 == torch.float8_e4m3fn else 1e-4
    k_cache, v_cache = (4 * k_cache).to(fp8), (v_scale * v_cache).to(fp8)
    assert (v_cache.float().abs() < torch.finfo(fp8).smallest_normal).any()
    out = paged_attention(q, k_cache, v_cache, block_tables, lens, starts, HEAD_DIM ** -0.5,
                          max_query_len=max(query_lens), max_seq_len=max(seq_lens))
    assert out.dtype == dtype
    check(out, q, k_cache, v_cache, block_tables, lens, starts)
    if max(query_lens) == 1:        # the eager decode path (kernels="none") dequantises too
        eager = paged_decode_attention_torch(q, k_cache, v_cache, block_tables, lens, max(seq_lens), HEAD_DIM ** -0.5)
        check(eager, q, k_cache, v_cache, block_tables, lens, starts)


def test_dot_dtype_by_cache_and_model_dtype():
    """What the kernels' dots take (on the GPU; "meta" tensors stand in for CUDA ones here): the
    model's dtype, but fp16 for a bf16 model reading an fp8 cache; fp32 copies on CPU (the
    interpreter)."""
    from mini_engine.kernels.paged_attention import _dot_dtype
    from mini_engine.kernels.triton_utils import tl

    def dot(q_dtype, cache_dtype, device="meta"):
        return _dot_dtype(torch.empty(1, dtype=q_dtype, device=device), torch.empty(1, dtype=cache_dtype,
                                                                                   device=device))
    fp8 = torch.float8_e4m3fn
    assert dot(torch.bfloat16, torch.bfloat16) == tl.bfloat16
    assert dot(torch.bfloat16, fp8) == tl.float16 and dot(torch.bfloat16, torch.float8_e5m2) == tl.float16
    assert dot(torch.float32, fp8) == tl.float32 and dot(torch.float16, fp8) == tl.float16
    assert dot(torch.bfloat16, fp8, "cpu") == tl.float32
