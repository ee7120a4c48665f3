"""Token sampling: argmax at temperature 0, otherwise inverse-CDF sampling with one uniform per row.

The PyTorch reference (sample_ref) runs the exponential race, argmax_i p_i / E_i with E_i ~ Exp(1):
no cumulative sum, but one random number per column. The Triton kernel ran it too, and there the
noise (Philox plus two logs per column) was most of the time: 148.5 us at 256 rows x 151,936
columns on the H200, against 46.8 us for the T = 0 path, which makes none, and ~20 us to read the
bf16 logits. So the kernel draws one uniform u per row instead and returns the first column whose
cumulative probability exceeds u: per column, what is left is one exp2.

The cumulative sum takes two kernels, so that no program walks a whole row: _chunk_stats_kernel,
one program per (row, chunk of SAMPLE_CHUNK_SIZE columns), writes the chunk's max logit and, for
a sampling row, its sum of exp2((l - max) * log2(e) / T) (proportional to softmax(l / T); the
normaliser is never divided out) or, for a greedy row, the first column holding the max.
_select_kernel, one program per row, rescales the chunks' sums to the row's max, picks the chunk
where u * total falls and rescans that one chunk for the column; greedy rows take the first column
of the max.

A row's token depends only on its logits, temperature, seed and the chunk size, never on the rest
of the batch. Not exactly independent of the chunk size: that groups the float sums, so a draw
within rounding of an interval's edge can move with it; hence one constant default. Probabilities
are exact up to float32 rounding of those sums (and u has 24 bits near 1).
"""
import torch

from mini_engine.host_to_device import to_device


def exponential_noise_ref(num_rows: int, vocab_size: int, seeds: list[int | None],
                          device: torch.device, generator: torch.Generator | None = None) -> torch.Tensor:
    """Exp(1) noise, [num_rows, vocab_size]. A row with a seed draws from its own generator, so its
    sample depends on nothing but its logits and its seed; the others share `generator` (the runner's,
    which every tensor-parallel rank draws alike), or torch's global one."""
    noise = torch.empty(num_rows, vocab_size, device=device, dtype=torch.float32).exponential_(generator=generator)
    for row, seed in enumerate(seeds):
        if seed is not None:
            gen = torch.Generator(device=device).manual_seed(seed)
            noise[row].exponential_(generator=gen)
    return noise


def apply_top_k_top_p_ref(logits: torch.Tensor, top_k: torch.Tensor | None,
                          top_p: torch.Tensor | None) -> torch.Tensor:
    """Sets to -inf every logit outside each row's top-k and nucleus (top-p) sets.
    top_k <= 0 and top_p >= 1 leave a row unrestricted. Ties go to the lower token id (a stable
    sort), so a row's sets do not depend on the rows beside it."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True, stable=True)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k <= 0, vocab, top_k).clamp(max=vocab)
        remove |= torch.arange(vocab, device=logits.device)[None, :] >= k[:, None]
    if top_p is not None:
        remove_outside_nucleus(sorted_logits, remove, top_p)
    mask = torch.zeros_like(remove).scatter_(-1, sorted_idx, remove)
    return logits.masked_fill(mask, float("-inf"))


def remove_outside_nucleus(sorted_logits: torch.Tensor, remove: torch.Tensor, top_p: torch.Tensor) -> None:
    """Marks in `remove` (over logits sorted best first, what top-k removed already marked) every
    logit outside its row's nucleus: those after the first whose probabilities reach top_p."""
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    remove |= mass_before >= top_p[:, None]
    remove[:, 0] = False            # the top token always survives, even a top_p that rounds to 0


# A top-k up to this many tokens is selected (torch.topk) rather than sorted out of the whole
# vocabulary: Qwen3's generation_config.json asks every request for top_k 20 and top_p 0.95.
TOP_K_SELECT_LIMIT = 1024


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                      row_top_k: list[int], temperatures: torch.Tensor) -> torch.Tensor:
    """apply_top_k_top_p_ref(logits.float() / temperatures[:, None], ...): fp32 logits at their
    temperatures (1 for a greedy row), -inf outside each row's sets. row_top_k: top_k on the host.

    Rows are taken in groups of one top_k. A group whose top_k is at most TOP_K_SELECT_LIMIT has
    its sets selected from the logits as they are (dividing by a positive temperature keeps
    their order), not sorted out of the vocabulary, and only those are scaled; its nucleus is
    taken within them, as the reference's is that of the top-k-restricted distribution too. By
    group, not by batch, so that a row's sets, ties included, depend on its own logits and
    parameters alone (a seeded request draws the same whatever shares its step)."""
    divisor = torch.where(temperatures > 0, temperatures, 1.0)[:, None]
    if top_k is None:
        return apply_top_k_top_p_ref(logits.float() / divisor, None, top_p)
    groups: dict[int, list[int]] = {}
    for row, k in enumerate(row_top_k):
        groups.setdefault(k if 1 <= k <= TOP_K_SELECT_LIMIT else 0, []).append(row)

    def restrict(k: int, where) -> torch.Tensor:
        p = None if top_p is None else top_p[where]
        if k == 0:
            return apply_top_k_top_p_ref(logits[where].float() / divisor[where], top_k[where], p)
        values, indices = logits[where].topk(min(k, logits.shape[-1]), dim=-1)
        # Best first, ties in token-id order, as the reference's stable sort has them: the
        # nucleus cuts a tie where the reference does.
        indices, order = indices.sort(dim=-1)
        values, order = values.gather(-1, order).sort(dim=-1, descending=True, stable=True)
        indices = indices.gather(-1, order)
        values = values.float() / divisor[where]
        if p is not None:
            remove = torch.zeros_like(values, dtype=torch.bool)
            remove_outside_nucleus(values, remove, p)
            values = values.masked_fill(remove, float("-inf"))
        out = torch.full((values.shape[0], logits.shape[-1]), float("-inf"), device=logits.device)
        return out.scatter_(-1, indices, values)

    if len(groups) == 1:                       # the usual step: every row asks for the same top_k
        return restrict(next(iter(groups)), slice(None))
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for k, rows in groups.items():
        where = to_device(torch.tensor(rows), logits.device)
        out[where] = restrict(k, where)
    return out


def sample_ref(logits: torch.Tensor, temperatures: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """logits [B, V] fp32 (already restricted by top-k/top-p), temperatures [B], noise Exp(1) [B, V]."""
    greedy = logits.argmax(-1)
    safe_t = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
    probs = (logits / safe_t[:, None]).softmax(-1)
    raced = (probs / noise).argmax(-1)
    return torch.where(temperatures > 0, raced, greedy)


# ---- Triton ----

from mini_engine.kernels.triton_utils import tl, triton  # noqa: E402


@triton.jit
def _scale(temperature):
    """Multiplier from logit differences to base 2: log2(e) / T, so that exp2((l - m) * scale) is
    proportional to softmax(l / T)."""
    return 1.4426950408889634 / tl.where(temperature > 0.0, temperature, 1.0)


@triton.jit
def _uniform(seed):
    """A row's one uniform in [0, 1) for this step, from Philox(seed): what every sampler draws with."""
    return tl.max(tl.rand(seed, tl.zeros([1], tl.int32)), axis=0)


@triton.jit
def _uniform_kernel(seeds_ptr, out_ptr):
    row = tl.program_id(0)
    tl.store(out_ptr + row, _uniform(tl.load(seeds_ptr + row)))


def uniforms(seeds: torch.Tensor) -> torch.Tensor:
    """[B] fp32: the uniform each row's draw takes from its seed (tests replay draws with it)."""
    out = torch.empty(seeds.shape[0], dtype=torch.float32, device=seeds.device)
    if seeds.shape[0]:
        _uniform_kernel[(seeds.shape[0],)](seeds, out)
    return out


@triton.jit
def _logits(row_ptr, cols, stop):
    # Both kernels read their logits with this one expression, so that they agree on every value.
    return tl.load(row_ptr + cols, mask=cols < stop, other=float("-inf")).to(tl.float32)


@triton.jit
def _fold_first_argmax(x, cols, top, col):
    """Folds a tile (logits x at columns cols) into a running max top and the first column col
    holding it. Strict: the first tile holding the max keeps it, as torch.argmax keeps the first
    of ties (and a run of -inf logits keeps the column it started with)."""
    tile_top = tl.max(x, axis=0)
    tile_col = tl.min(tl.where(x == tile_top, cols, 2**31 - 1), axis=0)
    return tl.maximum(top, tile_top), tl.where(tile_top > top, tile_col, col)


@triton.jit
def _chunk_stats_kernel(logits_ptr, temperatures_ptr, chunk_max_ptr, chunk_sum_ptr, chunk_col_ptr,
                        vocab_size, stride_logits, chunk_size, num_chunks, BLOCK_V: tl.constexpr):
    """Program (row, chunk) reads columns [chunk * chunk_size, (chunk + 1) * chunk_size) of one row
    and writes the chunk's max logit m and, for a sampling row, the sum of exp2((l - m) * scale)
    or, for a greedy row, the smallest column holding m: each row pays only for what
    _select_kernel reads of it (a sampling row's column is the chunk's first, a greedy row's sum
    0). Splitting the row is what spreads a B=1 step over many SMs. chunk_size is a runtime
    argument, so another size of at least _BLOCK_V columns compiles no new kernel here (the second
    kernel's block of chunks is the number of chunks rounded up to a power of 2).

    Each tile's max is taken first, then the tile's exp2 sum against the running max, so a column
    costs a sampling row five arithmetic instructions and one exp2 (the load's conversion, its
    share of the max, a subtraction, the scale and the sum's multiply-add), where an online update
    in every lane took about thirteen and the same exp2. The difference l - m is taken before the
    scale, so the max's own term is exactly 1 whatever the temperature (scaling first, then
    subtracting, let the GPU fuse the two and missed float64 by 1.6e-4 at T = 1e-3)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature = tl.load(temperatures_ptr + row)
    row_ptr = logits_ptr + row * stride_logits
    start = chunk * chunk_size
    stop = tl.minimum(start + chunk_size, vocab_size)
    top = tl.full([], float("-inf"), tl.float32)
    col = start
    total = tl.full([], 0.0, tl.float32)
    if temperature > 0.0:
        scale = _scale(temperature)
        run_sum = tl.zeros([BLOCK_V], tl.float32)
        for tile in range(start, stop, BLOCK_V):
            x = _logits(row_ptr, tile + tl.arange(0, BLOCK_V), stop)
            new_top = tl.maximum(top, tl.max(x, axis=0))
            # While every logit so far is -inf, shift by 0 instead: exp2 then gives 0, not NaN.
            shift = tl.where(new_top == float("-inf"), 0.0, new_top)
            run_sum = run_sum * tl.exp2((top - shift) * scale) + tl.exp2((x - shift) * scale)
            top = new_top
        total = tl.sum(run_sum, axis=0)
    else:
        for tile in range(start, stop, BLOCK_V):
            cols = tile + tl.arange(0, BLOCK_V)
            top, col = _fold_first_argmax(_logits(row_ptr, cols, stop), cols, top, col)
    out = row * num_chunks + chunk
    tl.store(chunk_max_ptr + out, top)
    tl.store(chunk_sum_ptr + out, total)
    tl.store(chunk_col_ptr + out, col)


@triton.jit
def _select_kernel(logits_ptr, temperatures_ptr, seeds_ptr, chunk_max_ptr, chunk_sum_ptr, chunk_col_ptr,
                   tokens_ptr, vocab_size, stride_logits, chunk_size, num_chunks,
                   BLOCK_CHUNKS: tl.constexpr, BLOCK_V: tl.constexpr):
    """One program per row. Greedy rows: the smallest column among the chunks holding the top logit
    (each chunk's column is already its smallest among its ties), so ties go to the lowest column
    wherever the chunk boundaries fall. Sampling rows: chunk c weighs w_c = s_c * exp2((m_c - M) *
    scale) (M the row's max logit); target = u * sum(w), u from Philox(seed); the chunk is the
    first whose inclusive prefix of w exceeds target, and the token the first column of it whose
    inclusive prefix of exp2((l - M) * scale) exceeds what is left of target.

    The two kernels group their float sums differently, so the chunk's columns can add up to a
    hair less than its w: then no column is reached and the token is the chunk's last column with
    a nonzero probability (or, where exp2 gives every column 0 here, the chunk's first column of
    its max logit, found in the same pass). Neither the search nor that fallback takes a column
    whose probability is 0 (a -inf logit, or exp2 underflow). A row of all -inf returns column 0.
    (The first kernel gives a sampling row each chunk's first column, not its max's: hence the
    fallback's own search.)"""
    row = tl.program_id(0).to(tl.int64)
    temperature = tl.load(temperatures_ptr + row)
    chunks = tl.arange(0, BLOCK_CHUNKS)
    in_row = chunks < num_chunks
    stats = row * num_chunks + chunks
    m = tl.load(chunk_max_ptr + stats, mask=in_row, other=float("-inf"))
    cols_of_max = tl.load(chunk_col_ptr + stats, mask=in_row, other=2**31 - 1)
    top = tl.max(m, axis=0)
    token = tl.min(tl.where(m == top, cols_of_max, 2**31 - 1), axis=0)     # all -inf: chunk 0's column, 0
    if (temperature > 0.0) & (top > float("-inf")):
        scale = _scale(temperature)
        s = tl.load(chunk_sum_ptr + stats, mask=in_row, other=0.0)
        weight = s * tl.exp2((m - top) * scale)
        prefix = tl.cumsum(weight, axis=0)
        # The prefix's own total (not a separate sum), so that target < the last prefix.
        target = _uniform(tl.load(seeds_ptr + row)) * tl.max(prefix, axis=0)
        chosen = tl.min(tl.where(prefix > target, chunks, BLOCK_CHUNKS), axis=0)
        # Not reached (u <= 1 - 2**-24 keeps target below the total), but if it were, a chunk with mass.
        chosen = tl.where(chosen < BLOCK_CHUNKS, chosen, tl.max(tl.where(weight > 0.0, chunks, -1), axis=0))
        # prefix is non-decreasing: its max before the chosen chunk is the mass before it.
        rest = target - tl.max(tl.where(chunks < chosen, prefix, 0.0), axis=0)
        row_ptr = logits_ptr + row * stride_logits
        start = chosen * chunk_size
        stop = tl.minimum(start + chunk_size, vocab_size)
        carried = 0.0
        hit = 2**31 - 1
        last = -1
        chunk_top = tl.full([], float("-inf"), tl.float32)
        chunk_top_col = start
        for tile in range(start, stop, BLOCK_V):
            cols = tile + tl.arange(0, BLOCK_V)
            x = _logits(row_ptr, cols, stop)
            p = tl.exp2((x - top) * scale)
            running = carried + tl.cumsum(p, axis=0)
            hit = tl.minimum(hit, tl.min(tl.where((p > 0.0) & (running > rest), cols, 2**31 - 1), axis=0))
            last = tl.maximum(last, tl.max(tl.where(p > 0.0, cols, -1), axis=0))
            carried = tl.max(running, axis=0)
            chunk_top, chunk_top_col = _fold_first_argmax(x, cols, chunk_top, chunk_top_col)
        # last < 0 only if exp2 rounded the chunk's max to 0 here but not in the first kernel: its
        # argmax column, whose logit is finite, is then the answer.
        token = tl.where(hit < 2**31 - 1, hit, tl.where(last >= 0, last, chunk_top_col))
    tl.store(tokens_ptr + row, token.to(tl.int64))


# Columns per tile: 16 per thread at 4 warps. benchmarks/sampler_sweep.py varies both: on the H200,
# 2,048 beat 1,024 at every batch once a column cost five instructions, not thirteen (256 rows
# 30.4 against 33.5 us), and 8 warps lost at every batch (benchmarks/NOTES.md, entry 35).
_BLOCK_V = 2048
_NUM_WARPS = 4

# Columns per chunk. A constant, not a function of the batch, so that a row's token does not depend
# on the batch it is in. Qwen3's 151,936 columns make 38 chunks: 38 programs for one row, 9,728 for
# 256 (4.6 waves, if 16 four-warp programs fit on each of the H200's 132 SMs). The second kernel
# rereads one chunk a row: 2.7% of the vocabulary, two tiles in sequence. On the H200, under
# CUDA-graph replay (sampler_sweep.py): 3.4 us at one row, 30.5 us at 256 (4.1 and 42.3 us before
# entry 35). Entry 34's sweep of the kernel before found chunks of 8,192 no faster.
SAMPLE_CHUNK_SIZE = 4096

# The second kernel holds a row's chunk statistics in one block; a chunk size that makes more
# chunks than this is refused rather than compiled into a huge block.
_MAX_CHUNKS = 4096


def _tile_columns(chunk_size: int) -> int:
    """Both kernels' tile: _BLOCK_V columns, or a smaller chunk's whole width."""
    return min(_BLOCK_V, triton.next_power_of_2(chunk_size))


def _chunk_stats(logits: torch.Tensor, temperatures: torch.Tensor,
                 chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each chunk's max logit, and a sampling row's sum of exp2((l - max) * log2(e) / T) or a greedy
    row's first column of the max: [B, num_chunks] each."""
    num_rows, vocab_size = logits.shape
    num_chunks = triton.cdiv(vocab_size, chunk_size)
    assert 0 < num_chunks <= _MAX_CHUNKS, f"chunk_size {chunk_size} is too small for {vocab_size} columns"
    chunk_max = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=logits.device)
    chunk_sum = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=logits.device)
    chunk_col = torch.empty(num_rows, num_chunks, dtype=torch.int32, device=logits.device)
    _chunk_stats_kernel[(num_rows, num_chunks)](
        logits, temperatures, chunk_max, chunk_sum, chunk_col, vocab_size, logits.stride(0), chunk_size,
        num_chunks, BLOCK_V=_tile_columns(chunk_size), num_warps=_NUM_WARPS)
    return chunk_max, chunk_sum, chunk_col


def _select(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, chunk_max: torch.Tensor,
            chunk_sum: torch.Tensor, chunk_col: torch.Tensor, chunk_size: int,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """The tokens, from _chunk_stats's statistics (tests also pass statistics of their own)."""
    num_rows, vocab_size = logits.shape
    num_chunks = chunk_max.shape[1]
    tokens = torch.empty(num_rows, dtype=torch.int64, device=logits.device) if out is None else out
    _select_kernel[(num_rows,)](
        logits, temperatures, seeds, chunk_max, chunk_sum, chunk_col, tokens, vocab_size, logits.stride(0),
        chunk_size, num_chunks, BLOCK_CHUNKS=max(triton.next_power_of_2(num_chunks), 16),
        BLOCK_V=_tile_columns(chunk_size), num_warps=_NUM_WARPS)
    return tokens


def sample(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
           chunk_size: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Samples from softmax(logits / T) by inverse CDF: logits [B, V] fp32, bf16 or fp16 (converted to
    fp32 as they load), temperatures [B] fp32 (0 = greedy: argmax, ties to the lowest column),
    seeds [B] int64 (< 2**31; each row's random stream for this step) -> tokens [B] int64. The same
    (logits, temperature, seed, chunk size) always gives the same token, whatever else is in the
    batch; another chunk size regroups the float sums, which can move a token whose draw falls
    within rounding of an interval's edge. A row of all -inf returns column 0. chunk_size (any
    positive int; tests use it to move the chunk boundaries) defaults to SAMPLE_CHUNK_SIZE. out: a
    [B] int64 buffer for the tokens (a CUDA graph's static one). No host synchronisation and a grid
    from shapes alone, so it can be captured in a CUDA graph."""
    assert logits.stride(-1) == 1
    if logits.shape[0] == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device) if out is None else out
    chunk_size = chunk_size or SAMPLE_CHUNK_SIZE
    return _select(logits, temperatures, seeds, *_chunk_stats(logits, temperatures, chunk_size), chunk_size, out)
