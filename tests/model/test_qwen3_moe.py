"""Qwen3-MoE (transformers' Qwen3MoeForCausalLM): its config.json, the experts' tensors as the
loader stacks them, the router, and the model against transformers loaded from the same files.
(The tiny MoE checkpoints also run in test_qwen3_vs_transformers.py's logits test and
tests/engine/test_greedy_vs_transformers.py's default-config test: tests/conftest.py's TINY_CONFIGS.)"""
import json
import os
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from mini_engine import LLM, SamplingParams
from mini_engine.config import EngineConfig, ModelConfig
from mini_engine.kernels.moe_router import route_ref
from mini_engine.layers.moe import Qwen3SparseMoeBlock
from mini_engine.model.random_checkpoint import QWEN3_0_6B, QWEN3_30B_A3B, qwen3_tensor_shapes
from mini_engine.runner.model_runner import ModelRunner
from tests.conftest import tiny_config
from tests.engine.test_greedy_vs_transformers import MAX_TOKENS, expected, generate, mixed_prompts
from tests.hf_reference import hf_logits, hf_model, transformers

MOE = "moe-mixed"


def test_config_reads_the_expert_fields():
    config = ModelConfig.from_dict(QWEN3_30B_A3B)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (128, 8, 768)
    assert config.norm_topk_prob and all(config.is_sparse_layer(i) for i in range(48))
    dense = ModelConfig.from_dict(QWEN3_0_6B)
    assert dense.num_experts == 0 and not any(dense.is_sparse_layer(i) for i in range(28))
    # transformers 5 writes num_experts as num_local_experts
    renamed = {k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"} | {"num_local_experts": 64}
    assert ModelConfig.from_dict(renamed).num_experts == 64
    # fields left out take transformers' Qwen3MoeConfig defaults
    bare = {k: v for k, v in QWEN3_30B_A3B.items() if k not in ("num_experts", "num_experts_per_tok",
                                                                "moe_intermediate_size", "norm_topk_prob")}
    reference = transformers.Qwen3MoeConfig()
    config = ModelConfig.from_dict(bare)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size, config.norm_topk_prob) \
        == (reference.num_experts, reference.num_experts_per_tok, reference.moe_intermediate_size,
            reference.norm_topk_prob)


@pytest.mark.parametrize("step, dense_layers", [(1, []), (2, []), (1, [0, 3]), (3, [2])])
def test_which_layers_are_sparse_is_transformers_rule(tmp_path, step, dense_layers):
    """Checked against the layers transformers itself builds from the same config.json."""
    raw = tiny_config(MOE) | {"num_hidden_layers": 6, "decoder_sparse_step": step, "mlp_only_layers": dense_layers}
    config = ModelConfig.from_dict(raw)
    hf_config = transformers.Qwen3MoeConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    hf = transformers.Qwen3MoeForCausalLM(hf_config)
    theirs = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf.model.layers]
    assert [config.is_sparse_layer(i) for i in range(6)] == theirs
    assert any(theirs) and (not all(theirs) or (step == 1 and not dense_layers))


@pytest.mark.parametrize("fields, message", [
    ({"num_experts_per_tok": 9, "num_experts": 8}, "num_experts_per_tok=9 is more than num_experts=8"),
    ({"num_experts": 0}, "num_experts must be an integer >= 1"),
    ({"moe_intermediate_size": None}, "moe_intermediate_size must be an integer >= 1"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step must be an integer >= 1"),
])
def test_bad_expert_fields_are_clear_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(tiny_config(MOE) | fields)


def test_checkpoint_shapes_are_transformers(tmp_path):
    """random_checkpoint writes the tensors, by name and shape, that transformers' own
    save_pretrained writes for the same config.json."""
    raw = tiny_config(MOE)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{k: v for k, v in raw.items()
                                                                          if k != "architectures"}))
    hf.save_pretrained(tmp_path)
    theirs = {name: tuple(t.shape) for name, t in load_file(tmp_path / "model.safetensors").items()}
    assert qwen3_tensor_shapes(raw) == theirs


def test_experts_are_stacked_from_the_checkpoint(checkpoint_factory):
    """w13[e] = [gate_e; up_e] and w2[e] = down_e, each expert's in its own place; the router and
    the sparse layer's norm as the checkpoint holds them; the dense layer in between as Qwen3's."""
    path = checkpoint_factory(MOE)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    model = ModelRunner(EngineConfig(path, device="cpu", num_kv_blocks=8)).model
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}.mlp."
        if i == 1:
            assert not isinstance(layer.mlp, Qwen3SparseMoeBlock) and p + "gate_proj.weight" in tensors
            continue
        mlp = layer.mlp
        assert isinstance(mlp, Qwen3SparseMoeBlock)
        assert torch.equal(mlp.gate.weight, tensors[p + "gate.weight"])
        assert torch.equal(mlp.norm.weight, tensors[f"model.layers.{i}.post_attention_layernorm.weight"])
        for e in range(8):
            gate_up = torch.cat([tensors[f"{p}experts.{e}.gate_proj.weight"], tensors[f"{p}experts.{e}.up_proj.weight"]])
            assert torch.equal(mlp.experts.w13_weight[e], gate_up)
            assert torch.equal(mlp.experts.w2_weight[e], tensors[f"{p}experts.{e}.down_proj.weight"])


def rewrite(path: str, tmp_path, change) -> str:
    """A copy of the checkpoint at `path` with its tensors changed by change(tensors)."""
    tensors = load_file(os.path.join(path, "model.safetensors"))
    change(tensors)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(open(os.path.join(path, "config.json")).read())
    return str(tmp_path)


def test_malformed_expert_tensors_are_clear_errors(checkpoint_factory, tmp_path):
    path = checkpoint_factory(MOE)
    expert = "model.layers.2.mlp.experts.5.up_proj.weight"
    cases = [
        (lambda t: t.pop(expert), r"missing tensors \['model.layers.2.mlp.experts.5.up_proj.weight'\]"),
        (lambda t: t.update({"model.layers.0.mlp.experts.8.down_proj.weight":
                             t["model.layers.0.mlp.experts.0.down_proj.weight"].clone()}),
         r"unexpected tensor 'model.layers.0.mlp.experts.8.down_proj.weight'"),
        (lambda t: t.update({expert: t[expert][:-1]}), r"'model.layers.2.mlp.experts.5.up_proj.weight' has shape"),
        (lambda t: t.pop("model.layers.0.mlp.gate.weight"), r"missing tensors \['model.layers.0.mlp.gate.weight'\]"),
        (lambda t: t.pop("model.layers.2.post_attention_layernorm.weight"),
         r"missing tensors \['model.layers.2.post_attention_layernorm.weight'\]"),
    ]
    for i, (change, message) in enumerate(cases):
        folder = tmp_path / str(i)
        folder.mkdir()
        with pytest.raises(ValueError, match=message):
            ModelRunner(EngineConfig(rewrite(path, folder, change), device="cpu", num_kv_blocks=8))


def test_router_is_transformers(checkpoint_factory):
    """route_ref() against transformers' Qwen3MoeTopKRouter, on the checkpoint's router, for both
    settings of norm_topk_prob (the Triton kernel against route_ref: tests/kernels/test_moe_router.py)."""
    for name in (MOE, "moe-top3"):
        router = hf_model(checkpoint_factory(name)).model.layers[0].mlp.gate
        x = torch.randn(37, router.hidden_dim, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            logits, their_weights, their_ids = router(x)
        weights, ids = route_ref(x, router.weight, router.top_k, router.norm_topk_prob)
        assert torch.equal(ids, their_ids)
        torch.testing.assert_close(weights, their_weights, rtol=1e-6, atol=1e-7)
        assert torch.allclose(weights.sum(-1), torch.ones(37)) == router.norm_topk_prob


def test_a_checkpoint_transformers_saved_loads(tmp_path):
    """What transformers' own save_pretrained writes (its expert tensors come out of its fused
    gate_up_proj through its weight conversion) loads, and gives transformers' logits."""
    raw = tiny_config(MOE)
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{k: v for k, v in raw.items()
                                                                          if k != "architectures"}))
    with torch.no_grad():
        for param in hf.parameters():
            param.normal_(0, 0.3)
    hf.save_pretrained(tmp_path)
    runner = ModelRunner(EngineConfig(str(tmp_path), device="cpu", num_kv_blocks=64, block_size=4))
    prompt = [random.Random(2).randrange(256) for _ in range(19)]
    from tests.model.test_qwen3_vs_transformers import GREEDY, all_logits
    from mini_engine.runner.batch import BatchRow
    got = all_logits(runner, [BatchRow(prompt, 0, list(range(5)), True, GREEDY)])
    torch.testing.assert_close(got, hf_logits(str(tmp_path), prompt), rtol=1e-4, atol=1e-4)


def test_scheduler_paths_match_transformers(checkpoint_factory):
    """Chunked prefill mixed with decode, preemption and prefix-cache hits over the MoE layers:
    greedy tokens as transformers' (a step's batch changes which tokens each expert sees)."""
    path = checkpoint_factory(MOE)
    prompts = mixed_prompts()
    got, engine = generate(path, prompts, num_kv_blocks=16, block_size=4, max_num_batched_tokens=16)
    assert engine.num_preemptions > 0
    assert got == expected(path, prompts)
    rng = random.Random(3)
    prefix = [rng.randrange(3, 256) for _ in range(21)]
    shared = [prefix + [rng.randrange(3, 256) for _ in range(k)] for k in (1, 6, 2)]
    got, engine = generate(path, shared, num_kv_blocks=64, block_size=4)
    assert engine.prefix_cache_hit_tokens > 0
    assert got == expected(path, shared)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_fused_moe_kernel_in_the_model(checkpoint_factory):
    """The router and the experts on their Triton kernels (the interpreter on CPU), in prefill and
    decode steps: greedy tokens as transformers'."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors take Triton kernels only through its interpreter; on a GPU: gpu_correctness.py")
    from mini_engine.kernels.fused_moe import fused_moe
    from mini_engine.layers.moe import FusedExperts
    path = checkpoint_factory(MOE)
    llm = LLM(path, device="cpu", num_kv_blocks=256, kernels="fused_moe")
    rows = []
    from mini_engine.kernels.moe_router import route
    assert all(layer.mlp.route is route for layer in llm.engine.runner.model.layers if layer.mlp is not None
               and hasattr(layer.mlp, "route"))
    for module in llm.engine.runner.model.modules():
        if isinstance(module, FusedExperts):
            assert module.impl is fused_moe
            module.impl = lambda x, *args, **kwargs: rows.append(x.shape[0]) or fused_moe(x, *args, **kwargs)
    prompts = mixed_prompts()[:3]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                           use_tqdm=False)
    assert min(rows) <= 3 < max(rows), rows         # decode steps and prefill steps
    assert [o.outputs[0].token_ids for o in outputs] == expected(path, prompts)


def test_tensor_parallel_moe_matches_transformers(checkpoint_factory):
    """Two ranks (gloo), each with half of every expert's columns: greedy tokens as transformers'."""
    path = checkpoint_factory(MOE)
    llm = LLM(path, device="cpu", tensor_parallel_size=2, num_kv_blocks=64, block_size=4)
    try:
        prompts = mixed_prompts()[:4]
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                               use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected(path, prompts)
    finally:
        llm.shutdown()


def test_each_rank_holds_its_columns_of_every_expert(checkpoint_factory):
    from mini_engine.distributed import TensorParallel
    from tests.engine.test_tensor_parallel import loaded_ranks
    whole, first, second = loaded_ranks(checkpoint_factory(MOE), [TensorParallel(), TensorParallel(0, 2),
                                                                  TensorParallel(1, 2)])
    experts = [model.layers[0].mlp.experts for model in (whole, first, second)]
    i = experts[0].intermediate_size
    assert experts[1].intermediate_size == experts[2].intermediate_size == i // 2
    for r, part in enumerate(experts[1:]):
        mine = slice(r * i // 2, (r + 1) * i // 2)
        gate, up = experts[0].w13_weight[:, :i], experts[0].w13_weight[:, i:]
        assert torch.equal(part.w13_weight, torch.cat([gate[:, mine], up[:, mine]], dim=1))
        assert torch.equal(part.w2_weight, experts[0].w2_weight[:, :, mine])
    assert torch.equal(first.layers[0].mlp.gate.weight, whole.layers[0].mlp.gate.weight)


def test_a_tensor_parallel_size_must_divide_the_experts_columns(checkpoint_factory, tmp_path):
    raw = tiny_config(MOE) | {"moe_intermediate_size": 33}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="must divide the model's moe_intermediate_size"):
        EngineConfig(str(tmp_path), device="cpu", tensor_parallel_size=2)
