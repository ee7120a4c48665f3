"""Piecewise CUDA graphs (runner/piecewise_graph.py): the forward cut at each attention. On the CPU
the pieces run eager, as they are captured (PiecewiseGraphRunner.forward with replay=False): the
cut must compute what the whole forward computes, and a step must pad to the next captured token
count. On CUDA the captured graphs must give the eager engine's tokens."""
import random
import warnings

import pytest
import torch

from mini_engine.config import EngineConfig
from mini_engine.distributed import TensorParallel
from mini_engine.runner.batch import BatchRow
from mini_engine.runner.model_runner import ModelRunner, piecewise_sizes_for
from mini_engine.runner.piecewise_graph import PiecewiseGraphRunner
from mini_engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4)


class EagerPieces(PiecewiseGraphRunner):
    """The pieces as captured, run eager (no GPU here), each step's token count recorded."""

    def __init__(self, *args):
        super().__init__(*args)
        self.steps = []

    def forward(self, t, meta, replay=False):
        self.steps.append(t.input_ids.shape[0])
        return super().forward(t, meta, replay=False)


def _runner(checkpoint, **options) -> ModelRunner:
    return ModelRunner(EngineConfig(checkpoint, device="cpu", **(dict(num_kv_blocks=128, max_model_len=100,
                                                                  max_num_seqs=8, block_size=4) | options)))


def _need_triton_interpreter() -> None:
    """These runners are on the CPU: their Triton kernels need the interpreter, which a GPU machine
    does not run (there test_piecewise_graphs_give_the_eager_tokens checks the kernels' graphs)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("Triton kernels on CPU tensors need the interpreter, which a GPU machine does not run; "
                    "there test_piecewise_graphs_give_the_eager_tokens checks the kernels' graphs")


def _mixed_rows() -> list[BatchRow]:
    """Two decode rows, then a prompt's first chunk (sampling) and another's later chunk (not): 22 tokens."""
    rows = [BatchRow([100 + i], 5 + 7 * i, list(range(10 * i, 10 * i + 4)), True, GREEDY) for i in range(2)]
    return rows + [BatchRow(list(range(20, 33)), 0, list(range(40, 44)), True, GREEDY),
                   BatchRow(list(range(50, 57)), 3, list(range(60, 64)), False)]


# Checkpoints and kernels the cut is checked over: dense, attention bias, Qwen3-MoE (its Triton experts:
# the PyTorch path's per-expert products change with the padding rows' routing), and the Triton
# kernels whose out= the pieces use (under Triton's interpreter on the CPU).
CUT_CASES = [("tied-gqa2", "none"), ("untied-bias-gqa4", "none"), ("moe-mixed", "fused_moe"),
             ("tied-gqa2", "attention,rope_kv,rms_norm,silu_and_mul,linear")]


@torch.inference_mode()
@pytest.mark.parametrize("name, kernels", CUT_CASES)
# The whole forward's padding rows read attention's uninitialised output rows: the MoE router's exp
# may overflow there under the interpreter (rows no token reads).
@pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning")
def test_the_pieces_compute_the_forward(checkpoint_factory, name, kernels):
    """A mixed step padded to 32 tokens: the pieces, with attention between them, give the whole
    forward's final hidden states bit for bit on the same staged inputs, and write the same K and
    V; the padding tokens write none, whatever an earlier step left in the attention buffer's
    padding rows; and the unpadded step agrees with both."""
    if kernels != "none":
        _need_triton_interpreter()
    runner = _runner(checkpoint_factory(name), kernels=kernels)
    pieces = PiecewiseGraphRunner(runner.model, (8, 32, 48), torch.device("cpu"))
    assert pieces.num_pieces == len(runner.model.layers) + 1
    pieces.attn_out.copy_(torch.randn_like(pieces.attn_out))
    rows = _mixed_rows()
    t, meta = runner.prepare_inputs(rows, piece_size=pieces.size_for(22))
    assert t.input_ids.shape[0] == 32 and meta.query_start_loc[-1] == 22
    assert meta.slot_mapping[22:].tolist() == [-1] * 10
    empty = runner.kv_cache.clone()
    want = runner.model(t.input_ids, t.positions, meta)
    kv_written = runner.kv_cache.clone()
    runner.kv_cache.copy_(empty)
    got = pieces.forward(t, meta, replay=False)
    assert got.shape == (32, runner.model_config.hidden_size)
    assert torch.equal(got[:22], want[:22]) and torch.equal(runner.kv_cache, kv_written)
    assert not torch.equal(kv_written, empty)
    runner.kv_cache.copy_(empty)
    t, meta = runner.prepare_inputs(rows)
    torch.testing.assert_close(runner.model(t.input_ids, t.positions, meta)[:22], got[:22])


def test_a_step_pads_to_the_next_captured_count_and_a_larger_one_runs_eager(tiny_checkpoint):
    """Steps through the runner: one of 22 tokens replays the pieces of 32, a decode step (no decode
    graph here, as in PIECEWISE mode) the pieces of 8, one of 60 tokens runs the eager forward;
    every step's tokens are an eager runner's."""
    runner, eager = _runner(tiny_checkpoint), _runner(tiny_checkpoint)
    runner.piecewise = EagerPieces(runner.model, (8, 32, 48), torch.device("cpu"))
    rows = _mixed_rows()
    assert runner.execute(rows) == eager.execute(rows) and runner.piecewise.steps == [32]
    decode = rows[:2]
    assert runner.execute(decode) == eager.execute(decode) and runner.piecewise.steps == [32, 8]
    long = [BatchRow(list(range(60)), 0, list(range(70, 85)), True, GREEDY)]
    assert runner.execute(long) == eager.execute(long) and runner.piecewise.steps == [32, 8]
    assert runner.piecewise.size_for(48) == 48 and runner.piecewise.size_for(49) is None


def test_the_reserve_step_fits_the_step_limits(tiny_checkpoint):
    """The step that sizes the piecewise graphs' reserve has the largest captured count of tokens in
    at most max_num_seqs rows of at most max_model_len tokens, and runs: the config caps the ladder
    there (a budget of 2,048 tokens cannot be reached by 2 rows of 100)."""
    runner = _runner(tiny_checkpoint, max_num_seqs=2, max_num_batched_tokens=2048)
    assert runner.config.piecewise_graph_sizes[-1] == 200
    runner.piecewise_sizes = runner.config.piecewise_graph_sizes       # (graphs are CUDA's: set by hand)
    rows = runner.piecewise_sized_step(list(range(runner.max_blocks)))
    assert [len(r.token_ids) for r in rows] == [100, 100] and [r.sample for r in rows] == [False, True]
    assert len(runner.execute(rows)) == 1


def test_pieces_only_where_they_were_built_for(tiny_checkpoint):
    """The runner captures the config's piecewise sizes where graphs run at all, and none under
    tensor parallelism or LoRA, with a warning (on rank 0) that their steps with prompt tokens then
    run eager (in PIECEWISE mode, their decode steps too)."""
    config = EngineConfig(tiny_checkpoint, device="cpu", max_num_seqs=8, max_num_batched_tokens=16)
    assert piecewise_sizes_for(config, True, TensorParallel(), lora=False) == (1, 2, 4, 8, 16)
    assert piecewise_sizes_for(config, False, TensorParallel(), lora=False) == ()      # enforce_eager, pooling, CPU
    with pytest.warns(UserWarning, match="no piecewise CUDA graphs under LoRA: steps with prompt tokens run eager$"):
        assert piecewise_sizes_for(config, True, TensorParallel(), lora=True) == ()
    piecewise_only = EngineConfig(tiny_checkpoint, device="cpu", max_num_seqs=8, max_num_batched_tokens=16,
                                  optimization_level=1)
    with pytest.warns(UserWarning, match="under tensor parallelism.*every decode step too"):
        assert piecewise_sizes_for(piecewise_only, True, TensorParallel(0, 2), lora=False) == ()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert piecewise_sizes_for(piecewise_only, True, TensorParallel(1, 2), lora=False) == ()


def test_piecewise_decode_steps_take_their_graph_sizes_split(tiny_checkpoint):
    """In PIECEWISE mode a decode step's attention runs eager between the pieces, launched as the
    default ladder's graph of its size would launch it (the split count of the size it pads to), and
    its tokens are an eager runner's (Triton's attention, under the interpreter on the CPU)."""
    _need_triton_interpreter()
    options = dict(kernels="attention", max_model_len=400, num_kv_blocks=200,
                   compilation_config={"cudagraph_mode": "PIECEWISE"})
    runner, eager = _runner(tiny_checkpoint, **options), _runner(tiny_checkpoint, **options)
    runner.piecewise = EagerPieces(runner.model, (4, 8), torch.device("cpu"))
    rows = [BatchRow([100 + i], 150 + 40 * i, list(range(60 * i, 60 * i + 60)), True, GREEDY) for i in range(3)]
    t, meta = runner.prepare_inputs(rows, piece_size=4)
    assert meta.decode_splits == eager.prepare_inputs(rows)[1].decode_splits is not None
    assert runner.execute(rows) == eager.execute(rows) and runner.piecewise.steps == [4]


def test_prompt_embeddings_run_eager(tiny_checkpoint):
    """A step with a prompt given as embeddings replaces token rows after the embedding, which the
    first piece does not: it runs the eager forward."""
    runner = _runner(tiny_checkpoint, enable_prompt_embeds=True)
    runner.piecewise = EagerPieces(runner.model, (8, 32), torch.device("cpu"))
    embeds = torch.randn(5, runner.model_config.hidden_size, dtype=runner.dtype)
    row = BatchRow([0] * 5, 0, list(range(4)), True, GREEDY, prompt_embeds=embeds)
    runner.execute([row])
    assert runner.piecewise.steps == []


def test_the_static_buffers_bytes(tiny_checkpoint):
    runner = _runner(tiny_checkpoint)
    pieces = PiecewiseGraphRunner(runner.model, (8, 24), torch.device("cpu"))
    held = sum(b.nbytes for b in (pieces.input_ids, pieces.positions, pieces.slot_mapping, pieces.hidden, pieces.q,
                                  pieces.attn_out))
    mc = runner.model_config
    assert PiecewiseGraphRunner.buffer_bytes((8, 24), mc.hidden_size, mc.num_attention_heads, mc.head_dim,
                                             runner.dtype) == held
    assert pieces.slot_mapping.tolist() == [-1] * 24         # the capture writes no KV


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs are captured on CUDA only")
@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "PIECEWISE"])
def test_piecewise_graphs_give_the_eager_tokens(tiny_checkpoint, mode):
    """Twelve greedy requests with prompts of 5-90 tokens under a 48-token step budget: chunked
    prompts share steps with decodes, and those steps replay the piecewise graphs (in PIECEWISE
    mode the decode steps too). Their tokens are the eager engine's (fp32, so that padded and
    unpadded products cannot tip a near tie); each token count is captured once a piece."""
    from mini_engine import LLM
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(5, 90))] for _ in range(12)]
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(12)]
    options = dict(device="cuda", dtype="float32", num_kv_blocks=128, max_num_seqs=16, max_model_len=256,
                   max_num_batched_tokens=48)
    llm = LLM(tiny_checkpoint, **options, compilation_config={"cudagraph_mode": mode})
    runner = llm.engine.runner
    pieces = runner.piecewise
    assert pieces.token_sizes == [1, 2, 4, 8, 16, 32, 48]
    num_pieces = runner.model_config.num_hidden_layers + 1
    assert set(pieces.graphs) == {(n, k) for n in pieces.token_sizes for k in range(num_pieces)}
    assert (runner.graph_runner is None) == (mode == "PIECEWISE")
    replayed, forward = [], pieces.forward

    def recording_forward(t, meta, replay=True):
        replayed.append((t.input_ids.shape[0], meta.max_query_len))
        return forward(t, meta, replay)

    pieces.forward = recording_forward
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert any(query_len > 1 for _, query_len in replayed)
    assert any(query_len == 1 for _, query_len in replayed) == (mode == "PIECEWISE")
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks
    del llm, runner, pieces
    eager_llm = LLM(tiny_checkpoint, **options, enforce_eager=True)
    assert eager_llm.engine.runner.piecewise is None and eager_llm.engine.runner.graph_runner is None
    eager = eager_llm.generate(prompts, params, use_tqdm=False)
    assert got == [o.outputs[0].token_ids for o in eager]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the KV pool is sized from GPU memory on CUDA only")
def test_the_reserve_covers_both_pools(tiny_checkpoint):
    """With piecewise graphs the memory set aside when the KV pool is sized adds their reserve (a
    step of their largest token count, measured, and their static buffers) to the decode graphs':
    it covers what both then take, and exceeds the decode graphs' alone."""
    import gc
    from mini_engine import LLM
    reserves = {}
    for mode in ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"):
        llm = LLM(tiny_checkpoint, device="cuda", max_num_seqs=64, max_model_len=512, gpu_memory_utilization=0.5,
                  compilation_config={"cudagraph_mode": mode})
        runner = llm.engine.runner
        assert (runner.piecewise is not None) == (mode == "FULL_AND_PIECEWISE") and runner.graph_runner is not None
        assert 0 < runner.cuda_graph_pool_bytes <= runner.graph_reserve_bytes
        reserves[mode] = runner.graph_reserve_bytes
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()
    assert reserves["FULL_AND_PIECEWISE"] > reserves["FULL_DECODE_ONLY"]
