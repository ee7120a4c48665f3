"""What can be checked of the CUDA-graph runner without a GPU: the batch-size ladder, the memory
it reserves, and that a step staged for a graph lands where the graph reads (capture and replay
are checked on the H200 by benchmarks/gpu_correctness.py: graph logits bitwise equal to the same
padded batch run eagerly)."""
import dataclasses
import random

import pytest
import torch

from mini_engine.config import EngineConfig
from mini_engine.engine.sequence import PENDING_TOKEN
from mini_engine.runner.batch import BatchRow
from mini_engine.compilation_config import default_capture_sizes
from mini_engine.runner.cuda_graph import CUDAGraphRunner
from mini_engine.runner.model_runner import ModelRunner
from mini_engine.sampling_params import SamplingParams


def test_batch_size_ladder():
    assert default_capture_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_capture_sizes(1) == [1]


@pytest.mark.parametrize("sizes", [(1, 2, 4, 8, 16, 24), (3, 10)])
def test_reserved_bytes_cover_the_static_buffers(tiny_checkpoint, sizes):
    """The graphs' logits buffer is as large as the largest captured size, and buffer_bytes (what a
    draft model's graphs set aside for it) is its exact size."""
    runner = ModelRunner(EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=8, max_model_len=100))
    graphs = CUDAGraphRunner(runner.model, sizes, torch.device("cpu"), runner.sampled_tokens, runner.take_prev_tokens,
                             None)
    assert graphs.logits.shape[0] == sizes[-1]
    assert CUDAGraphRunner.buffer_bytes(sizes, runner.model_config.vocab_size, runner.dtype) == graphs.logits.nbytes
    assert CUDAGraphRunner.buffer_bytes((), runner.model_config.vocab_size, runner.dtype) == 0


def test_one_decode_workspace_for_every_layer(tiny_checkpoint):
    """With the Triton attention kernel the runner allocates the decode splits' scratch once, before
    the KV pool is sized, for every batch it can run, and every layer uses it: a decode step
    allocates none, so none lands in a CUDA graph's pool, whose sizing sees only the largest batch."""
    pytest.importorskip("triton")
    from mini_engine.kernels.paged_attention import decode_workspace_numel
    # On a GPU machine the kernel needs CUDA tensors (there is no interpreter there).
    runner = ModelRunner(EngineConfig(tiny_checkpoint, device="cuda" if torch.cuda.is_available() else "cpu",
                                      num_kv_blocks=64, max_model_len=100, max_num_seqs=8, block_size=4,
                                      kernels="attention", enforce_eager=True))
    mc, workspace = runner.model_config, runner.decode_workspace
    assert workspace.numel() == decode_workspace_numel(8, mc.num_attention_heads, mc.num_key_value_heads,
                                                       mc.head_dim, 100, runner.device) > 0
    assert all(layer.self_attn.attn.decode_workspace is workspace for layer in runner.model.layers)
    workspace.fill_(float("nan"))
    # One row over two 64-token tiles: it splits.
    runner.execute([BatchRow([100], 90, list(range(23)), True, SamplingParams(temperature=0, max_tokens=1))])
    assert not workspace.isnan().all()


def _decode_rows(n, block_size, params):
    rows = []
    for i in range(n):
        ctx = 5 + 7 * i
        rows.append(BatchRow([100 + i], ctx, list(range(10 * i, 10 * i + ctx // block_size + 1)), True, params))
    return rows


def test_a_step_staged_for_a_graph_lands_where_the_graph_reads(tiny_checkpoint):
    """A graph reads its inputs from the views it was captured on (a padding-only step laid out for
    its batch size). A real step staged for that size must fill exactly those views, its rows
    first and padding rows (slot -1, context 1, block 0, greedy) after; the data must be the eager
    step's, and the graph's tables max_model_len wide."""
    runner = ModelRunner(EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=64, max_model_len=100,
                                      max_num_seqs=24, block_size=4))
    params = SamplingParams(temperature=0.75, max_tokens=4)
    rows = _decode_rows(13, 4, params)
    rows[5].seed = 1234
    captured, captured_meta = runner.prepare_inputs([], graph_size=16, turn=0)   # as graph (16, 0) was captured
    assert captured_meta.slot_mapping.tolist() == [-1] * 16 and captured_meta.seq_lens.tolist() == [1] * 16
    assert captured.temperatures.tolist() == [0.0] * 16 and captured.prev_index.tolist() == [-1] * 16
    eager, eager_meta = runner.prepare_inputs(rows)
    eager = dataclasses.replace(eager, **{f.name: getattr(eager, f.name).clone() for f in dataclasses.fields(eager)})
    eager_meta = dataclasses.replace(eager_meta, **{f: getattr(eager_meta, f).clone() for f in
                                                    ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")})
    staged, meta = runner.prepare_inputs(rows, graph_size=16, turn=0)
    for field in ("input_ids", "positions", "slot_mapping", "prev_index", "seeds", "seq_lens", "query_start_loc",
                  "block_tables", "temperatures", "top_k", "top_p"):
        s, c = getattr(staged, field), getattr(captured, field)
        assert s.data_ptr() == c.data_ptr() and s.shape == c.shape, field
    for s, c in ((meta.slot_mapping, staged.slot_mapping), (meta.seq_lens, staged.seq_lens),
                 (meta.block_tables, staged.block_tables), (meta.query_start_loc, staged.query_start_loc)):
        assert s.data_ptr() == c.data_ptr()
    assert torch.equal(staged.input_ids[:13], eager.input_ids) and torch.equal(staged.positions[:13], eager.positions)
    assert torch.equal(meta.slot_mapping[:13], eager_meta.slot_mapping) and meta.slot_mapping[13:].tolist() == [-1] * 3
    assert torch.equal(meta.seq_lens[:13], eager_meta.seq_lens) and meta.seq_lens[13:].tolist() == [1] * 3
    assert meta.query_start_loc.tolist() == list(range(17))
    width = eager_meta.block_tables.shape[1]
    assert meta.block_tables.shape == (16, 25)                     # ceil(100 / 4)
    assert torch.equal(meta.block_tables[:13, :width], eager_meta.block_tables)
    assert (meta.block_tables[:13, width:] == -1).all() and (meta.block_tables[13:] == 0).all()
    assert meta.num_decodes == 16 and meta.max_query_len == 1 and meta.max_seq_len == 100
    # Sampling: the rows' temperatures, padding rows greedy; the seeded row's own seed, fresh ones
    # (each step's draw) for the others, padding 0.
    assert staged.temperatures.tolist() == [0.75] * 13 + [0.0] * 3   # exact in float32
    assert torch.equal(eager.temperatures, staged.temperatures[:13])
    assert staged.seeds[5] == 1234 and staged.seeds[13:].tolist() == [0] * 3
    assert staged.seeds[:13].unique().numel() == 13 and not torch.equal(staged.seeds[:13], eager.seeds)
    assert staged.logits_indices.tolist() == eager.logits_indices.tolist() == list(range(13))


def test_an_eager_decode_step_is_launched_as_its_graph_is(tiny_checkpoint):
    """An eager decode step (Triton attention) takes the launch shape of the graph it would pad to:
    tables max_model_len wide, max_model_len as the bound on its contexts, and that graph's split
    count, so that each row's attention matches the graph's and Triton compiles one decode variant
    for each captured size's split count, not one for each batch, longest context and table width.
    Above the largest captured size, the step's own rows' count. A mixed step's tables are as wide
    as its longest row (the prefill kernel does not specialise on it)."""
    pytest.importorskip("triton")
    from mini_engine.kernels.paged_attention import decode_num_splits
    params = SamplingParams(temperature=0, max_tokens=4)
    rows = _decode_rows(5, 4, params)                 # contexts 6 to 34: tables of 2 to 9 blocks

    def runner(**options):
        return ModelRunner(EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=128, max_model_len=400,
                                        max_num_seqs=24, block_size=4, **options))

    graphs = runner(kernels="attention")
    _, graph_meta = graphs.prepare_inputs(rows, graph_size=8)
    _, eager_meta = graphs.prepare_inputs(rows)
    assert eager_meta.block_tables.shape == (5, 100) and graph_meta.block_tables.shape == (8, 100)
    assert eager_meta.max_seq_len == graph_meta.max_seq_len == 400
    assert torch.equal(eager_meta.block_tables, graph_meta.block_tables[:5])
    splits = [decode_num_splits(n, 2, 400, 64, 4, 3) for n in (8, 5)]     # the interpreter counts 4 SMs
    assert graph_meta.decode_splits is None and splits == [1, 2]          # the graph's rule, at 8 rows: 1
    assert eager_meta.decode_splits == 1
    assert runner(kernels="attention", max_cudagraph_capture_size=4).prepare_inputs(rows)[1].decode_splits == 2
    chunk = BatchRow(list(range(3, 9)), 0, [40, 41], True, params)
    mixed = graphs.prepare_inputs(rows + [chunk])[1]
    assert mixed.block_tables.shape == (6, 9) and mixed.max_seq_len == 34 and mixed.decode_splits is None
    assert runner(kernels="none").prepare_inputs(rows)[1].block_tables.shape == (5, 9)   # the PyTorch path's


def test_top_k_rows_stage_their_top_k_and_top_p(tiny_checkpoint):
    """The top-k sampler's inputs, staged with the step's: a sampling row's top_k where
    kernels/top_k_sampling.py draws it (1 to 64, temperature above 0), else 0, and its top_p;
    padding rows 0 and 1.0, so that the graph's top-k kernels skip them."""
    runner = ModelRunner(EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=64, max_model_len=100,
                                      max_num_seqs=24, block_size=4))
    params = [SamplingParams(temperature=0.7, top_k=20, top_p=0.8), SamplingParams(temperature=0, top_k=20),
              SamplingParams(temperature=1.0, top_k=65), SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=1.0, top_k=64)]
    rows = [BatchRow([1], 3, [0], True, p) for p in params]
    for graph_size, pad in ((None, 0), (8, 3)):
        t, _ = runner.prepare_inputs(rows, graph_size=graph_size, turn=0)
        assert t.top_k.tolist() == [20, 0, 0, 0, 64] + [0] * pad
        assert t.top_p.tolist() == pytest.approx([0.8, 1.0, 1.0, 0.5, 1.0] + [1.0] * pad)


def test_tokens_from_the_previous_launch_fill_the_staged_ids(tiny_checkpoint):
    """Rows whose input token was sampled by the launch still in flight say which sample it is
    (prev_index; -1 elsewhere, padding included), and take_prev_tokens fills it in the staged
    buffer itself, where a graph replay reads it. A prefill chunk's pending token is its last."""
    runner = ModelRunner(EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=64, max_model_len=100,
                                      max_num_seqs=24, block_size=4))
    rows = _decode_rows(5, 4, SamplingParams(temperature=0, max_tokens=4))
    for i, index in ((1, 2), (3, 0)):
        rows[i].token_ids, rows[i].prev_token_index = [PENDING_TOKEN], index
    runner.sampled_tokens[1 - runner.turn, :3] = torch.tensor([7, 8, 9])     # the previous launch's turn
    t, _ = runner.prepare_inputs(rows, graph_size=8)
    assert t.prev_index.tolist() == [-1, 2, -1, 0, -1, -1, -1, -1]
    assert t.input_ids.tolist() == [100, PENDING_TOKEN, 102, PENDING_TOKEN, 104, 0, 0, 0]
    runner.take_prev_tokens(t.input_ids, t.prev_index, runner.sampled_tokens[1 - runner.turn])
    assert t.input_ids.tolist() == [100, 9, 102, 7, 104, 0, 0, 0]
    chunk = BatchRow([11, 12, PENDING_TOKEN], 0, [40], True, rows[0].params, prev_token_index=1)
    t, _ = runner.prepare_inputs(rows[:1] + [chunk])
    assert t.prev_index.tolist() == [-1, -1, -1, 1]


def test_staged_arrays_start_aligned(tiny_checkpoint):
    """Every staged array starts 128 bytes from another into its buffer (whose base the CUDA
    allocator aligns to 512): Triton specialises its kernels on pointer alignment, so views whose
    alignment moved with the step's sizes compiled new kernel variants mid-run. Odd sizes too.
    (An empty array has no address to check: a decode step stages no prefill work, and on CUDA
    an empty view's data_ptr is 0.)"""
    runner = ModelRunner(EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=64, max_model_len=100,
                                      max_num_seqs=24, block_size=4, kernels="attention"))
    params = SamplingParams(temperature=0, max_tokens=4)
    for n, graph_size, chunk in ((13, None, 0), (13, 16, 0), (1, 1, 0), (7, None, 0), (3, None, 9), (0, None, 5)):
        rows = _decode_rows(n, 4, params)
        if rows:
            rows[0].prev_token_index = 0
        if chunk:
            rows.append(BatchRow(list(range(3, 3 + chunk)), 2, list(range(60, 64)), True, params))
        t, _ = runner.prepare_inputs(rows, graph_size)
        assert t.prefill_work.numel() == (4 * len(rows) if chunk else 0)
        for f in dataclasses.fields(t):
            if getattr(t, f.name).numel():
                assert (getattr(t, f.name).data_ptr() - runner.inputs[runner.turn].data.data_ptr()) % 128 == 0, f.name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the tokens' own copy stream is CUDA's")
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_launches_in_flight_return_what_one_at_a_time_returns(tiny_checkpoint, enforce_eager):
    """The sampled tokens travel to the host on a stream of their own while the next launch runs.
    Eight greedy decode launches queued back to back, each taking its input tokens from the one
    before on the device (prev_token_index), return the tokens that waiting for each launch in
    turn returns: a copy that read the tokens before the step wrote them, or after the next step
    overwrote them, would differ."""
    runner = ModelRunner(EngineConfig(tiny_checkpoint, device="cuda", num_kv_blocks=64, max_model_len=100,
                                      max_num_seqs=8, block_size=4, enforce_eager=enforce_eager))
    runner.kv_cache.zero_()
    queued = _greedy_launches(runner, 8, wait_each=False)
    assert all(event is not None for event in runner.tokens_copied) and runner.tokens_stream is not None
    assert queued == _greedy_launches(runner, 8)
    runner.kv_cache.zero_()
    assert queued == _greedy_launches(runner, 8, on_device=False)     # each input token from the host
    assert len({tuple(t) for t in queued}) > 1          # the steps' tokens are not all alike


def _greedy_launches(runner, steps: int, on_device: bool = True, wait_each: bool = True,
                     fail_at: int | None = None) -> list[list[int]]:
    """Five greedy decode rows launched `steps` times, each step's input the token the step before
    sampled: taken on the device (prev_token_index), or (on_device=False) handed over by the host.
    wait_each=False: every launch queued before any result is read (on the device only). fail_at:
    that launch raises in the sampler (after its forward ran) and is then launched again."""
    params = SamplingParams(temperature=0, max_tokens=8)
    rows = [BatchRow([100 + i], 5 + 3 * i, list(range(12 * i, 12 * i + 12)), True, params) for i in range(5)]
    handles = []
    for step in range(steps):
        if step == fail_at:
            sampler = runner.sampler
            runner.sampler = lambda *args: 1 / 0
            with pytest.raises(ZeroDivisionError):
                runner.launch(rows)
            runner.sampler = sampler
        handles.append(runner.launch(rows))
        tokens = handles[-1].result()[0] if wait_each else None
        for i, row in enumerate(rows):
            row.start_position += 1
            row.token_ids, row.prev_token_index = ([PENDING_TOKEN], i) if on_device else ([tokens[i]], -1)
    return [h.result()[0] for h in handles]


def test_consecutive_launches_take_turns(tiny_checkpoint):
    """Launch n stages its inputs in inputs[turn] and writes its samples to sampled_tokens[turn];
    launch n+1 takes the other turn, and its input tokens from launch n's samples. Staging one
    turn's inputs leaves the other's alone (on CUDA the next step's cross while a step reads its
    own). A launch that fails leaves the turn as it was: the launch after it still finds the
    last launch's samples, and returns what it would have without the failure."""
    config = EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=64, max_model_len=100, max_num_seqs=8,
                          block_size=4)
    runner = ModelRunner(config)
    params = SamplingParams(temperature=0, max_tokens=8)
    first, _ = runner.prepare_inputs(_decode_rows(3, 4, params), graph_size=4)
    ids = first.input_ids.tolist()
    runner.prepare_inputs(_decode_rows(2, 4, params), graph_size=4, turn=1)
    assert first.input_ids.tolist() == ids and runner.turn == 0, "staging the other turn overwrote this one"

    turns, launch = [], runner.launch

    def launch_and_check(rows):
        turns.append(runner.turn)
        handle = launch(rows)
        assert runner.sampled_tokens[turns[-1], :len(rows)].tolist() == handle.result()[0]
        return handle

    expected = _greedy_launches(ModelRunner(config), 4, on_device=False)
    assert len({tuple(t) for t in expected}) > 1          # the steps' tokens are not all alike
    runner.launch = launch_and_check
    assert _greedy_launches(runner, 4) == expected
    assert turns == [0, 1, 0, 1]
    assert _greedy_launches(ModelRunner(config), 4, fail_at=2) == expected


def test_lora_slots_stage_where_the_graph_reads(tiny_checkpoint, tmp_path):
    """With enable_lora each token's adapter slot is a staged input like the others: a decode step
    laid out for a graph puts its rows' slots where the capture's padding-only step had its -1s
    (the graph's LoRA products mask by them), and padding rows take no adapter."""
    from mini_engine.lora import LoRARequest, write_random_adapter
    runner = ModelRunner(EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=64, max_model_len=100,
                                      max_num_seqs=24, block_size=4, enable_lora=True, max_loras=2, max_lora_rank=4))
    loras = [LoRARequest(f"a{i}", i + 1, write_random_adapter(str(tmp_path / f"a{i}"), runner.model_config, 4, i))
             for i in range(2)]
    captured, _ = runner.prepare_inputs([], graph_size=8, turn=0)
    assert captured.lora_slots.tolist() == [-1] * 8
    rows = _decode_rows(5, 4, SamplingParams(temperature=0, max_tokens=4))
    for row, lora in zip(rows, [loras[1], None, loras[0], loras[1], None]):
        row.lora_request = lora
    staged, _ = runner.prepare_inputs(rows, graph_size=8, turn=0)
    assert staged.lora_slots.data_ptr() == captured.lora_slots.data_ptr()
    slot = runner.lora.slot_of
    assert staged.lora_slots.tolist() == [slot[2], -1, slot[1], slot[2], -1, -1, -1, -1]
    assert sorted(slot.values()) == [0, 1]
    # A prefill chunk's tokens all take its row's slot.
    chunk = BatchRow(list(range(3, 9)), 0, [40, 41], True, rows[0].params, lora_request=loras[0])
    t, _ = runner.prepare_inputs(rows[:2] + [chunk])
    assert t.lora_slots.tolist()[:8] == [slot[2], -1] + [slot[1]] * 6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs are captured on CUDA only")
@pytest.mark.parametrize("capture, captured", [(dict(max_cudagraph_capture_size=8), [1, 2, 4, 8]),
                                               (dict(cudagraph_capture_sizes=[3, 6, 10]), [3, 6, 10])])
def test_only_the_given_sizes_are_captured_and_larger_steps_run_eager(tiny_checkpoint, capture, captured):
    """vLLM's max_cudagraph_capture_size and cudagraph_capture_sizes: the runner captures those
    sizes only (each once a turn), a decode step of n rows replays the smallest captured size >= n,
    and a step of more rows than the largest runs eager. Twelve greedy requests whose max_tokens
    differ shrink the batch from 12 rows to 1 through both kinds of step, and their tokens are the
    eager engine's (fp32, so that padded and unpadded products cannot tip a near tie)."""
    from mini_engine import LLM
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(5, 40))] for _ in range(12)]
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(12)]
    options = dict(device="cuda", dtype="float32", num_kv_blocks=64, max_num_seqs=16, max_model_len=256)
    # The decode graphs alone: with the piecewise ones (tests/runner/test_piecewise_graph.py) the
    # larger steps would replay those instead.
    llm = LLM(tiny_checkpoint, **options, **capture, compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"})
    graphs = llm.engine.runner.graph_runner
    assert graphs.batch_sizes == captured and graphs.logits.shape[0] == captured[-1]
    assert set(graphs.graphs) == {(size, turn) for size in captured for turn in (0, 1)}
    chosen, graph_size = [], graphs.graph_size

    def recording_graph_size(rows, query_len):
        chosen.append((rows, query_len, graph_size(rows, query_len)))
        return chosen[-1][2]

    graphs.graph_size = recording_graph_size
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    decode_steps = {rows: size for rows, query_len, size in chosen if query_len == 1}
    assert decode_steps[12] is None and decode_steps[1] == captured[0]
    assert all(size is None if rows > captured[-1] else size == min(s for s in captured if s >= rows)
               for rows, size in decode_steps.items())
    assert any(size is not None for size in decode_steps.values())
    del llm, graphs
    eager = LLM(tiny_checkpoint, **options, enforce_eager=True).generate(prompts, params, use_tqdm=False)
    assert got == [o.outputs[0].token_ids for o in eager]


def test_a_step_above_the_largest_captured_size_runs_eager(tiny_checkpoint):
    """With graphs captured up to 10 rows, a decode step of 11 rows never touches them (it runs the
    eager forward, with the eager path's tokens) while one of 2 rows replays the graph of 3. On the
    CPU the runner holds no graphs: the graph runner here is one whose replay is recorded."""
    config = EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=128, max_model_len=100, max_num_seqs=24,
                          block_size=4)
    runner = ModelRunner(config)
    replays = []

    class Replayed(Exception):
        pass

    def replay(bs, turn, top_k=False):
        replays.append(bs)
        raise Replayed
    runner.graph_runner = CUDAGraphRunner(runner.model, (3, 10), torch.device("cpu"), runner.sampled_tokens,
                                          runner.take_prev_tokens, None)
    runner.graph_runner.replay = replay
    rows = _decode_rows(11, 4, SamplingParams(temperature=0, max_tokens=4))
    eager = ModelRunner(config).execute(rows)
    assert runner.execute(rows) == eager and replays == []
    with pytest.raises(Replayed):
        runner.execute(rows[:2])
    assert replays == [3]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the KV pool is sized from GPU memory on CUDA only")
def test_the_graphs_reserve_covers_their_pool_and_follows_the_largest_size(tiny_checkpoint):
    """The memory set aside for the graphs when the KV pool is sized is measured on a decode step of
    the largest captured size (graph_sized_decode): it covers the pool the graphs then take, and
    graphs up to 8 rows set aside less than graphs up to 64."""
    import gc
    from mini_engine import LLM
    reserves = {}
    for largest in (64, 8):
        llm = LLM(tiny_checkpoint, device="cuda", max_num_seqs=64, max_model_len=512, gpu_memory_utilization=0.5,
                  max_cudagraph_capture_size=largest, compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"})
        runner = llm.engine.runner
        assert runner.graph_runner.batch_sizes[-1] == largest
        assert 0 < runner.cuda_graph_pool_bytes <= runner.graph_reserve_bytes
        reserves[largest] = runner.graph_reserve_bytes
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()
    assert reserves[8] < reserves[64]


def test_the_graph_sized_warm_up_step_draws_no_seeds(tiny_checkpoint):
    """The decode step that sizes the graphs' reserve (largest captured size, at max_model_len) is
    seeded: staging it leaves the engine's stream of seeds for unseeded requests where it was, so
    that their outputs are the same with graphs and without."""
    runner = ModelRunner(EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=128, max_model_len=100,
                                      max_num_seqs=24, block_size=4, max_cudagraph_capture_size=16))
    rows = runner.graph_sized_decode(list(range(runner.max_blocks)))
    assert len(rows) == 16 and {row.start_position for row in rows} == {99}
    state = runner.rng.getstate()
    runner.prepare_inputs(rows)
    assert runner.rng.getstate() == state


def test_without_captured_sizes_an_eager_step_reckons_the_default_ladders_split(tiny_checkpoint):
    """With no graphs captured (cudagraph_mode NONE) an eager decode step still takes the split
    count of the default ladder's size it would pad to, so that a run without graphs compiles as
    few decode variants as one with them."""
    runner = ModelRunner(EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=128, max_model_len=400,
                                      max_num_seqs=24, block_size=4, compilation_config={"cudagraph_mode": "NONE"}))
    assert runner.config.cuda_graph_sizes == ()
    assert [runner.graph_size_for(n) for n in (1, 3, 5, 9, 17, 24)] == [1, 4, 8, 16, 24, 24]
