"""fp8 Qwen3-MoE (Qwen3-30B-A3B-FP8's layout: every expert's projections fp8 in 128 x 128 blocks,
each with its weight_scale_inv; the routers in the model's dtype), and quantization="fp8" over a
bf16 Qwen3-MoE, against transformers.

The oracle is test_qwen3_fp8.py's (benchmarks/fp8_check.py fp8_oracle): transformers over the
checkpoint dequantized by its own code, each fp8 projection's input quantized as the engine's.
transformers 5 holds a layer's experts fused (gate_up_proj [E, 2I, H], down_proj [E, H, I]), so
the oracle runs them through its own loop written from transformers' (quantized_experts_forward),
each expert's two inputs quantized. kernels/fp8_fused_moe.py's kernels are checked against their
reference in tests/kernels/test_fp8_fused_moe.py."""
import json
import os
import types

import pytest
import torch
from safetensors.torch import load_file

from mini_engine import LLM, SamplingParams
from mini_engine.config import EngineConfig
from mini_engine.kernels.fp8_linear import FP8, quantize_fp8_weight_ref
from mini_engine.model.random_checkpoint import write_fp8_layout, write_random_checkpoint
from mini_engine.runner.model_runner import ModelRunner
from tests.conftest import tiny_config
from tests.engine.test_greedy_vs_transformers import MAX_TOKENS, mixed_prompts
from tests.hf_reference import transformers  # noqa: F401 (skips the file without transformers)
from tests.model.test_qwen3_fp8 import (FP8_FIELDS, FP8_TINY, assert_oracle_agrees,
                                        assert_quantized_weights_never_in_full_precision, greedy, hf_fp8_model,
                                        rewritten)
from tests.model.test_qwen3_vs_transformers import four_prompt_logits

# Layers 0 and 2 sparse (8 experts of 256 columns, 2 a token), layer 1 a dense MLP; every
# projection whole 128 x 128 blocks, and two ranks' shares of each expert too.
FP8_MOE_TINY = FP8_TINY | dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_hidden_layers=3,
                               moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                               mlp_only_layers=[1], tie_word_embeddings=False)
# As Qwen3-30B-A3B-FP8's config.json lists them (the routers are never quantized here either way).
KEPT = ["lm_head", "model.layers.0.mlp.gate", "model.layers.2.mlp.gate"]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    return write_random_checkpoint(str(tmp_path_factory.mktemp("moe-fp32")), FP8_MOE_TINY, dtype=torch.float32,
                                   std=0.3)


@pytest.fixture(scope="module")
def fp8_checkpoint(source, tmp_path_factory) -> str:
    return write_fp8_layout(source, str(tmp_path_factory.mktemp("moe-fp8")), modules_to_not_convert=KEPT)


def test_experts_load_as_fp8_blocks(fp8_checkpoint):
    """w13 [e] = [gate_e; up_e] and w2[e] = down_e in fp8, bit for bit, their scales stacked the
    same way; the router and the embedding in the model's dtype; the dense layer's MLP in fp8."""
    tensors = load_file(os.path.join(fp8_checkpoint, "model.safetensors"))
    model = ModelRunner(EngineConfig(fp8_checkpoint, device="cpu", num_kv_blocks=8)).model
    assert model.layers[1].mlp.gate_up_proj.weight.dtype == FP8
    for i in (0, 2):
        mlp, p = model.layers[i].mlp, f"model.layers.{i}.mlp."
        experts = mlp.experts
        assert mlp.gate.weight.dtype == torch.float32 and torch.equal(mlp.gate.weight, tensors[p + "gate.weight"])
        assert experts.w13_weight.dtype == experts.w2_weight.dtype == FP8
        assert experts.w13_weight_scale_inv.shape == (8, 4, 1) and experts.w2_weight_scale_inv.shape == (8, 1, 2)
        for e in range(8):
            for stacked, names in (("w13", ["gate_proj", "up_proj"]), ("w2", ["down_proj"])):
                for suffix in ("weight", "weight_scale_inv"):
                    expected = torch.cat([tensors[f"{p}experts.{e}.{name}.{suffix}"] for name in names])
                    held = getattr(experts, f"{stacked}_{suffix}")[e]
                    assert torch.equal(held.view(torch.uint8) if held.dtype == FP8 else held,
                                       expected.view(torch.uint8) if expected.dtype == FP8 else expected)


def test_fp8_experts_are_never_allocated_in_full_precision(fp8_checkpoint):
    assert_quantized_weights_never_in_full_precision(fp8_checkpoint)


def test_malformed_fp8_expert_tensors_are_clear_errors(fp8_checkpoint, source, tmp_path):
    scale = "model.layers.2.mlp.experts.5.up_proj.weight_scale_inv"
    weight = "model.layers.0.mlp.experts.3.down_proj.weight"
    cases = [
        (fp8_checkpoint, lambda t: t.pop(scale), None, r"missing tensors \['model.layers.2.mlp.experts.5.up_proj."
                                                       r"weight_scale_inv'\]"),
        (fp8_checkpoint, lambda t: t.update({scale: t[scale][:1]}), None, f"'{scale}' has shape"),
        (fp8_checkpoint, lambda t: t.update({weight: t[weight].float()}), None,
         f"'{weight}' is torch.float32, expected float8_e4m3fn"),
        (fp8_checkpoint, lambda t: None, lambda c: c.pop("quantization_config"),
         r"is torch.float8_e4m3fn, expected torch.float32 \(config.json says nothing of fp8\)"),
        (source, lambda t: t.update({scale: torch.ones(2, 1)}), None, f"unexpected tensor '{scale}'"),
        # the router stored in fp8: the engine keeps it in the model's dtype
        (fp8_checkpoint, lambda t: t.update({"model.layers.0.mlp.gate.weight": t["model.layers.0.mlp.gate.weight"]
                                             .to(FP8)}), None, "this tensor is kept in the model's dtype"),
        # one expert kept out of fp8 by modules_to_not_convert: the layer's experts are one product
        (write_fp8_layout(source, str(tmp_path / "one-kept"), KEPT + ["model.layers.2.mlp.experts.3"]),
         lambda t: None, None, r"keeps some of .*experts.0.gate_proj.* out of fp8 but not all "
                               r"\(\['model.layers.2.mlp.experts.3.gate_proj', .*one grouped GEMM"),
    ]
    for i, (path, change, config_change, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message):
            ModelRunner(EngineConfig(rewritten(path, tmp_path / str(i), change, config_change), device="cpu",
                                     num_kv_blocks=8))


def test_shares_that_are_not_whole_blocks_are_refused(fp8_checkpoint, checkpoint_factory, tmp_path):
    """An expert's gate and up rows (each rank's share of them) must be whole 128-row blocks: said
    when the config is read, before any weight loads; AWQ experts stay refused."""
    with pytest.raises(ValueError, match=r"moe_intermediate_size 128 / tensor_parallel_size 2 = 64 rows is not; "
                                         r"use fewer ranks"):
        EngineConfig(fp8_checkpoint, device="cpu", tensor_parallel_size=2, hf_overrides={"moe_intermediate_size": 128})
    # moe-mixed's experts are 32 columns: quantization="fp8" over it, or an FP8 checkpoint of it
    with pytest.raises(ValueError, match=r"whole 128-row blocks .*: moe_intermediate_size 32 rows is not$"):
        EngineConfig(checkpoint_factory("moe-mixed"), device="cpu", quantization="fp8")
    (tmp_path / "config.json").write_text(json.dumps(tiny_config("moe-mixed") | {"quantization_config": FP8_FIELDS}))
    with pytest.raises(ValueError, match="moe_intermediate_size 32 rows is not"):
        EngineConfig(str(tmp_path), device="cpu")
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    (tmp_path / "config.json").write_text(json.dumps(FP8_MOE_TINY | {"quantization_config": awq}))
    with pytest.raises(ValueError, match="awq Qwen3-MoE checkpoints are not supported"):
        EngineConfig(str(tmp_path), device="cpu")


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_logits_match_the_oracle(fp8_checkpoint):
    """One flat batch of four prompts, within test_qwen3_fp8.py's 2e-2; the oracle without its
    experts' inputs quantized is whole logits away, so the tolerance tells the two apart."""
    engine_logits = four_prompt_logits(fp8_checkpoint)
    longest = engine_logits[-1][0]
    oracle = hf_fp8_model(fp8_checkpoint)
    experts = [layer.mlp.experts for layer in oracle.model.layers if hasattr(layer.mlp, "experts")]
    assert len(experts) == 2 and all(isinstance(e.forward, types.MethodType) and "forward" in vars(e) for e in experts)
    with torch.inference_mode():
        for prompt, logits in engine_logits:
            torch.testing.assert_close(logits, oracle(torch.tensor([prompt])).logits[0], rtol=0, atol=2e-2)
        patched = [vars(e).pop("forward") for e in experts]       # transformers' own loop, inputs unquantized
        try:
            unquantized = oracle(torch.tensor([longest])).logits[0]
        finally:
            for e, forward in zip(experts, patched):
                e.forward = forward
        assert (unquantized - oracle(torch.tensor([longest])).logits[0]).abs().max() > 0.5


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_greedy_with_chunked_prefill_and_preemption_matches_the_oracle(fp8_checkpoint):
    """A pool and a token budget small enough that prompts are prefilled in chunks beside decode
    rows and requests are preempted: each greedy token within TIE of the oracle's largest logit."""
    prompts = mixed_prompts()[:5]
    llm = LLM(fp8_checkpoint, device="cpu", num_kv_blocks=12, block_size=4, max_num_batched_tokens=16)
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                               use_tqdm=False)
        engine = llm.engine
        assert engine.num_preemptions > 0 and engine.num_free_blocks == engine.block_manager.num_blocks
    finally:
        llm.shutdown()
    assert_oracle_agrees(fp8_checkpoint, prompts, [o.outputs[0].token_ids for o in outputs])


def test_triton_experts_in_the_model(fp8_checkpoint):
    """The router and the fp8 experts on their Triton kernels (the interpreter on CPU), in prefill
    and decode steps, each experts' call checked against fp8_fused_moe_ref on the same arguments.
    In fp32 the two quantize the same hidden rows to the same bits; a SwiGLU value on an e4m3
    rounding boundary may round the other way after gate/up sums in another order
    (tests/kernels/test_fp8_fused_moe.py), hence 1e-3 of a call's largest output."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors take Triton kernels only through its interpreter; on a GPU: fp8_check.py --moe-layers")
    from benchmarks.fp8_check import per_expert_call_check
    checked = per_expert_call_check(fp8_checkpoint, mixed_prompts()[:3], 3, device="cpu", kernels="fused_moe")
    assert checked["modules"] == checked["of_modules"] == 2, checked
    assert checked["output_lengths"] == [3]
    assert checked["fewest_rows"] <= 3 and checked["most_rows"] > 16, checked     # decode steps and prefill steps
    assert checked["worst_rel_err"] < 1e-3, checked


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_tensor_parallel_fp8_experts_match_the_oracle(fp8_checkpoint):
    """Two ranks (gloo), each with its 128 of every expert's 256 columns and their scales."""
    prompts = mixed_prompts()[:3]
    assert_oracle_agrees(fp8_checkpoint, prompts, greedy(fp8_checkpoint, prompts, num_kv_blocks=64,
                                                         tensor_parallel_size=2))


def test_online_quantization_of_the_experts_is_the_checkpoints(source, fp8_checkpoint):
    """quantization="fp8" over the bf16 (here fp32) checkpoint: every expert in the same blocks and
    scales as the FP8 checkpoint's (no norm is folded into an expert), bit for bit; and an update
    of one expert's projection (load_weights) is quantized into its own rows and scales."""
    online = ModelRunner(EngineConfig(source, device="cpu", num_kv_blocks=8, quantization="fp8"))
    stored = ModelRunner(EngineConfig(fp8_checkpoint, device="cpu", num_kv_blocks=8))
    for i in (0, 2):
        ours, theirs = online.model.layers[i].mlp.experts, stored.model.layers[i].mlp.experts
        for attr in ("w13_weight", "w13_weight_scale_inv", "w2_weight", "w2_weight_scale_inv"):
            a, b = getattr(ours, attr), getattr(theirs, attr)
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (i, attr)
    assert online.model.layers[0].mlp.gate.weight.dtype == torch.float32
    up = torch.randn(256, 128, generator=torch.Generator().manual_seed(1)) * torch.logspace(-1, 1, 256)[:, None]
    updater = online.weights
    updater.apply(updater.plan(updater.check([("model.layers.2.mlp.experts.6.up_proj.weight", up)])))
    experts, (blocks, scales) = online.model.layers[2].mlp.experts, quantize_fp8_weight_ref(up)
    assert torch.equal(experts.w13_weight[6, 256:].view(torch.uint8), blocks.view(torch.uint8))
    assert torch.equal(experts.w13_weight_scale_inv[6, 2:], scales)
    others = stored.model.layers[2].mlp.experts
    assert torch.equal(experts.w13_weight[6, :256].view(torch.uint8), others.w13_weight[6, :256].view(torch.uint8))
    assert torch.equal(experts.w13_weight_scale_inv[5], others.w13_weight_scale_inv[5])
