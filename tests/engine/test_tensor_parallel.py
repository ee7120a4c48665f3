"""Tensor parallelism on CPU: two processes joined by gloo, each holding half of every layer's heads,
MLP columns and vocabulary (mini_engine/distributed.py). The same engine code runs with NCCL on
GPUs; benchmarks/tensor_parallel_check.py runs it there."""
import pytest
import torch
import torch.distributed as dist

from mini_engine import LLM, SamplingParams
from mini_engine.config import EngineConfig
from mini_engine.distributed import TensorParallel
from mini_engine.layers.linear import PackedLinear
from mini_engine.model.loader import load_model
from mini_engine.model.qwen3 import Qwen3ForCausalLM
from mini_engine.model.random_checkpoint import write_random_checkpoint
from tests.conftest import tiny_config
from tests.engine.test_greedy_vs_transformers import MAX_TOKENS, expected, mixed_prompts

CONFIGS = ["tied-gqa2", "untied-bias-gqa4"]    # the second: o_proj's bias (rank 0 adds it), an untied lm_head, GQA 4


@pytest.fixture
def split_llm(checkpoint_factory):
    """A two-rank engine on a tiny checkpoint, shut down after the test."""
    made = []

    def make(name: str, **options) -> LLM:
        made.append(LLM(checkpoint_factory(name), device="cpu", tensor_parallel_size=2, **options))
        return made[-1]
    yield make
    for llm in made:
        llm.shutdown()


def test_split_model_matches_transformers(checkpoint_factory, split_llm):
    """Greedy tokens equal transformers' through chunked prefill and preemption (sampled ones are
    test_every_rank_samples_alike_whatever_the_row_asks's). (The tied checkpoint runs
    end to end in the shutdown test below, and the server's, whose vocabulary two ranks do not
    divide, in tests/server/test_engine_process.py: each engine start costs CI seconds.)
    Run twice with a host tier (kv_offloading_size): the second run's prefixes the pool lost come
    back from each rank's own host copy of its heads."""
    name = "untied-bias-gqa4"
    path = checkpoint_factory(name)
    # 16 blocks of 4 slots, and 16 tokens a step: chunked prompts, and preemptions (the longest
    # request alone needs 13 blocks). A rank's block: 3 layers x K and V x 1 head x 8 x fp32 x 4
    # tokens, 768 bytes; the bytes of 64 on each rank, pinned in chunks of 32 and 16 KiB, 42 + 21.
    llm = split_llm(name, num_kv_blocks=16, block_size=4, max_num_batched_tokens=16,
                    kv_offloading_size=2 * 64 * 768 / 2**30)
    assert llm.engine.runner.num_host_kv_blocks == 63
    prompts = mixed_prompts()
    want = expected(path, prompts)
    for _ in range(2):
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                               use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == want
        assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks, "KV blocks leaked"
    assert llm.engine.num_preemptions > 0
    assert llm.engine.block_manager.host_cache_hit_tokens > 0


def loaded_ranks(path: str, ranks: list[TensorParallel]) -> list[Qwen3ForCausalLM]:
    """The model as each rank loads it (loading needs no process group)."""
    mc = EngineConfig(path, device="cpu").model_config
    models = []
    for tp in ranks:
        models.append(Qwen3ForCausalLM(mc, tp=tp))
        load_model(models[-1], path)
    return models


@pytest.mark.parametrize("name", CONFIGS)
def test_each_rank_loads_its_slice_of_the_checkpoint(checkpoint_factory, name):
    """Rank r's parameters are the checkpoint's rows (column-parallel: q/k/v, gate/up, the
    vocabulary) or columns (row-parallel: o_proj, down_proj) of its share; norms and a
    row-parallel bias whole."""
    path = checkpoint_factory(name)
    whole, *ranks = loaded_ranks(path, [TensorParallel(), TensorParallel(0, 2), TensorParallel(1, 2)])
    for name_, param in whole.named_parameters():
        module = whole.get_submodule(name_.rpartition(".")[0])
        attr, dim = name_.rpartition(".")[2], getattr(module, "tp_dim", None)
        parts = [dict(rank.named_parameters())[name_] for rank in ranks]
        if isinstance(module, PackedLinear) and attr in ("weight", "bias"):
            # Each projection's share, in its own place: [q_r, k_r, v_r], not a cut of [q, k, v].
            for r, part in enumerate(parts):
                full = param.split(module.output_sizes)
                mine = part.split([size // 2 for size in module.output_sizes])
                for f, m in zip(full, mine):
                    assert torch.equal(m, f.chunk(2)[r]), (name_, r)
        elif dim is None or attr == "norm_weight" or (attr == "bias" and dim == 1):
            assert all(torch.equal(part, param) for part in parts), name_
        else:
            assert parts[0].shape[dim] * 2 == param.shape[dim], name_
            assert torch.equal(torch.cat(parts, dim=dim), param), name_


def test_a_vocabulary_the_ranks_do_not_divide_is_padded(tmp_path):
    """255 rows over two ranks: 128 each, the last rank's final row zeros (never looked up); the
    logits drop it (the server's test runs such a model end to end)."""
    path = write_random_checkpoint(str(tmp_path), tiny_config("untied-bias-gqa4") | {"vocab_size": 255},
                                   dtype=torch.float32, std=0.3)
    whole, *ranks = loaded_ranks(path, [TensorParallel(), TensorParallel(0, 2), TensorParallel(1, 2)])
    for module in ("embed_tokens", "lm_head"):
        full = whole.get_submodule(module).weight
        parts = [rank.get_submodule(module).weight for rank in ranks]
        assert [p.shape[0] for p in parts] == [128, 128]
        assert torch.equal(torch.cat(parts)[:255], full)
        assert not parts[1][127].any()


def test_shutdown_stops_the_ranks_and_frees_the_process_group(checkpoint_factory, split_llm):
    llm = split_llm("tied-gqa2", num_kv_blocks=16)
    processes = list(llm.engine.runner.workers.processes)
    assert [p.is_alive() for p in processes] == [True]
    with pytest.raises(RuntimeError, match="already holds a tensor-parallel engine"):
        split_llm("tied-gqa2", num_kv_blocks=16)
    llm.shutdown()
    assert not any(p.is_alive() for p in processes)
    assert not dist.is_initialized()
    # and the process may start another
    path = checkpoint_factory("tied-gqa2")
    out = split_llm("tied-gqa2", num_kv_blocks=16).generate(
        [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == expected(path, [[5, 6, 7]], 3)[0]


@pytest.mark.parametrize("options, message", [
    (dict(tensor_parallel_size=3), "must divide the model's num_attention_heads"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be an integer >= 1"),
    (dict(tensor_parallel_size=2, device="cuda:1"), "rank r runs on cuda:r"),
])
def test_bad_tensor_parallel_options(tiny_checkpoint, options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(tiny_checkpoint, **options)


def test_rows_cross_to_the_workers_whole_with_each_params_sent_once():
    """StepEncoder/decode_rows: every field of every row arrives (block_table_array, the engine's
    padded copy, stays behind); a SamplingParams object crosses once, and again only after the
    tables were reset."""
    import pickle

    import numpy as np

    from mini_engine.runner.batch import BatchRow
    from mini_engine.runner.tensor_parallel_workers import StepEncoder, decode_rows
    shared, other = SamplingParams(temperature=0.5, top_k=3), SamplingParams(temperature=0, max_tokens=7)
    rows = [BatchRow([1, 2, 3], 0, [4, 5], True, shared, seed=9, penalty_row=2, history=np.array([7, 8]),
                     num_prompt_tokens=1, prompt_logprob_targets=np.array([2, 3]), num_prompt_logprobs=2,
                     grammar_bitmask=torch.tensor([5, 6], dtype=torch.int32), banned_tokens=[11]),
            BatchRow([4], 9, [6], True, shared, block_table_array=np.array([6, -1], dtype=np.int32),
                     prev_token_index=0, num_output_tokens=3),
            BatchRow([5], 2, [1], False)]
    encoder, table = StepEncoder(max_params=1), {}

    def cross(batch):
        message = pickle.loads(pickle.dumps(encoder.encode(batch)))
        return message, decode_rows(message, table)
    message, got = cross(rows)
    assert len(message[1]) == 1                       # shared crossed once
    for sent, arrived in zip(rows, got):
        for name in ("token_ids", "start_position", "block_table", "sample", "seed", "prev_token_index",
                     "penalty_row", "num_prompt_tokens", "num_output_tokens", "num_prompt_logprobs", "banned_tokens"):
            assert getattr(arrived, name) == getattr(sent, name), name
        for name in ("history", "prompt_logprob_targets", "grammar_bitmask"):
            a, b = getattr(arrived, name), getattr(sent, name)
            assert (a is None and b is None) or (a == b).all(), name
        assert arrived.params == sent.params and arrived.block_table_array is None
    message, got = cross([rows[1], BatchRow([6], 3, [2], True, other)])
    assert list(message[1].values()) == [other] and got[0].params == shared and got[1].params == other
    equal_but_new = SamplingParams(temperature=0, max_tokens=7)
    message, got = cross([BatchRow([6], 3, [2], True, equal_but_new)])     # 2 known > 1: reset
    assert message[0] and list(message[1].values()) == [equal_but_new] and table == {2: equal_but_new}


def test_every_rank_samples_alike_whatever_the_row_asks(checkpoint_factory, split_llm):
    """With async scheduling a worker's next input token is its own sample: a rank that sampled
    otherwise than rank 0 (a penalty, a bias or a restriction applied on one rank only, or a
    random draw from a generator that only rank 0's process touched) computes its share of the
    next token's KV from another token, and every later logit is off. So each split run's tokens,
    teacher-forced through one process, must have the log-probabilities the split run reported."""
    name = "untied-bias-gqa4"
    path = checkpoint_factory(name)
    llm = split_llm(name, num_kv_blocks=64, block_size=4)
    prompts = mixed_prompts()[:6]
    common = dict(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    params = [SamplingParams(seed=1, repetition_penalty=1.5, frequency_penalty=1.0, **common),
              SamplingParams(seed=2, logit_bias={7: 4.0, 9: 4.0}, **common),
              SamplingParams(seed=3, top_k=5, top_p=0.8, **common),
              SamplingParams(seed=4, min_p=0.2, **common),
              SamplingParams(seed=5, allowed_token_ids=list(range(50, 90)), **common),
              SamplingParams(**common)]                 # unseeded
    torch.rand(1)           # this process (rank 0's) draws from torch's generator; the worker's does not
    split = llm.generate(prompts, params, use_tqdm=False)
    whole = LLM(path, device="cpu", num_kv_blocks=64, block_size=4)
    for prompt, out in zip(prompts, split):
        tokens = out.outputs[0].token_ids
        forced = whole.generate([prompt + tokens], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                                use_tqdm=False)[0].prompt_logprobs[len(prompt):]
        assert [x.logprob for x in out.outputs[0].logprobs] == pytest.approx([x.logprob for x in forced], abs=1e-4), \
            (prompts.index(prompt), out.outputs[0].token_ids)


def test_a_step_that_fails_on_rank_0_alone_ends_the_split_engine(split_llm, monkeypatch):
    """Rank 0 sent the rows, then failed (a Ctrl-C, an OOM on one GPU) where the other rank went
    on: their collectives no longer pair up, so every later step is refused with a clear error, and
    shutdown leaves the group without waiting for the lost rank."""
    from mini_engine.runner.model_runner import ModelRunner
    llm = split_llm("tied-gqa2", num_kv_blocks=16)
    worker = llm.engine.runner.workers.processes[0]
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    def interrupted(self, rows, turn):
        raise KeyboardInterrupt
    with monkeypatch.context() as m:
        m.setattr(ModelRunner, "enqueue", interrupted)       # rank 0's process only
        with pytest.raises(KeyboardInterrupt):
            llm.generate([[5, 6, 7]], greedy, use_tqdm=False)
    with pytest.raises(RuntimeError, match="restart the engine"):
        llm.generate([[5, 6, 7]], greedy, use_tqdm=False)
    llm.shutdown()
    assert not worker.is_alive() and not dist.is_initialized()


def test_a_failed_start_leaves_the_process_free_for_the_next_engine(checkpoint_factory, split_llm, tmp_path):
    """A checkpoint whose tensors do not fit config.json fails every rank's load: the error is the
    loader's, the other rank's process is ended, and this process leaves the group (else it could
    never start a tensor-parallel engine again)."""
    import json
    import shutil
    good = checkpoint_factory("tied-gqa2")
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(config | {"intermediate_size": config["intermediate_size"] // 2}))
    with pytest.raises(ValueError, match="has shape"):
        LLM(str(bad), device="cpu", tensor_parallel_size=2, num_kv_blocks=16)
    assert not dist.is_initialized()
    assert split_llm("tied-gqa2", num_kv_blocks=16).engine.runner.workers.processes[0].is_alive()


def test_a_split_embedding_model_matches_transformers(checkpoint_factory, split_llm):
    """runner="pooling" over two ranks: the hidden states each rank holds whole after the last
    all-reduce, pooled on rank 0, through chunks (MEAN: every chunk's share)."""
    from tests.engine.test_embeddings import assert_close, hf_embedding
    name = "untied-bias-gqa4"
    llm = split_llm(name, runner="pooling", max_num_batched_tokens=16, pooler_config={"pooling_type": "MEAN"})
    prompts = mixed_prompts()
    for prompt, out in zip(prompts, llm.embed(prompts, use_tqdm=False)):
        assert_close(out.outputs.embedding, hf_embedding(checkpoint_factory(name), prompt, "MEAN"))
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks, "KV blocks leaked"
