"""AWQ weights (mini_engine/quantization.py, kernels/awq_linear.py): a checkpoint as Qwen3-*-AWQ
lays itself out (AutoAWQ's "gemm" tensors, 4 bits in groups), against transformers.

The oracle (benchmarks/awq_check.py awq_oracle) is transformers' Qwen3ForCausalLM in fp32 over
the checkpoint dequantized by AutoAWQ's definition, written apart from the engine's code. AWQ
quantizes no activation, so on its PyTorch path the engine computes what the oracle does: logits
to fp32's rounding and greedy tokens equal through the scheduler."""
import functools
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks.awq_check import awq_oracle, per_call_check
from mini_engine import LLM, SamplingParams
from mini_engine.config import EngineConfig
from mini_engine.model.random_checkpoint import write_awq_layout, write_random_checkpoint
from mini_engine.runner.model_runner import ModelRunner
from tests.conftest import TINY_BASE, tiny_config
from tests.engine.test_greedy_vs_transformers import MAX_TOKENS, mixed_prompts
from tests.hf_reference import transformers  # noqa: F401 (skips the file without transformers)
from tests.model.test_qwen3_fp8 import assert_quantized_weights_never_in_full_precision
from tests.model.test_qwen3_vs_transformers import four_prompt_logits

# Groups of 32 input rows; q, k and v of 64, 32 and 32 columns, whole 8-column words, and two
# ranks' shares too.
AWQ_TINY = TINY_BASE | dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, attention_bias=True)
GROUP = 32


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    return write_random_checkpoint(str(tmp_path_factory.mktemp("fp32")), AWQ_TINY, dtype=torch.float32, std=0.3)


@pytest.fixture(scope="module")
def awq_checkpoint(source, tmp_path_factory) -> str:
    return write_awq_layout(source, str(tmp_path_factory.mktemp("awq")), GROUP)


@functools.lru_cache(maxsize=None)
def oracle(path: str):
    return awq_oracle(path, torch.float32, "cpu")


@torch.inference_mode()
def oracle_greedy(path: str, prompts: list[list[int]], oracle=oracle) -> list[list[int]]:
    """oracle(path)'s greedy tokens (the GPTQ tests pass theirs)."""
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = oracle(path).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                    do_sample=False, eos_token_id=None, pad_token_id=0)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


def greedy(path: str, prompts, **engine_kwargs) -> list[list[int]]:
    llm = LLM(path, device="cpu", **engine_kwargs)
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                               use_tqdm=False)
        engine = llm.engine
        assert engine.num_free_blocks == engine.block_manager.num_blocks, "KV blocks leaked"
        return [o.outputs[0].token_ids for o in outputs]
    finally:
        llm.shutdown()


# ---- config.json ----

AWQ_FIELDS = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": None}


def test_an_awq_checkpoint_is_read_as_awq(awq_checkpoint):
    config = EngineConfig(awq_checkpoint, device="cpu")
    assert config.quantization == "awq" and config.model_config.quantization.group_size == GROUP
    runner = ModelRunner(EngineConfig(awq_checkpoint, device="cpu", num_kv_blocks=8))
    layer = runner.model.layers[0]
    qkv = layer.self_attn.qkv_proj
    assert qkv.weight is None and qkv.qweight.dtype == torch.int32 and qkv.scales.dtype == torch.float16
    assert qkv.qweight.shape == (64, 128 // 8) and qkv.qzeros.shape == (2, 16) and qkv.scales.shape == (2, 128)
    assert layer.mlp.down_proj.qweight.shape == (128, 64 // 8)
    assert not qkv.norm_in_weight                     # g cannot be folded into a group's scale
    assert runner.model.embed_tokens.weight.dtype == torch.float32


def test_awq_weights_are_never_allocated_in_full_precision(awq_checkpoint):
    assert_quantized_weights_never_in_full_precision(awq_checkpoint)


@pytest.mark.parametrize("change, message", [
    ({"bits": 8}, "AWQ with 8 bits is not supported"),
    ({"version": "gemv"}, "AWQ version 'gemv' is not supported"),
    ({"zero_point": False}, "without zero points"),
    ({"group_size": 12}, "group_size must be -1 .* or a multiple of 16, got 12"),
    ({"modules_to_not_convert": "lm_head"}, "modules_to_not_convert must be a list"),
])
def test_other_awq_configs_are_clear_errors(tmp_path, change, message):
    assert_config_refused(tmp_path, AWQ_TINY | {"quantization_config": AWQ_FIELDS | change}, message)


def assert_config_refused(folder, config: dict, message: str) -> None:
    """EngineConfig over a folder of this config.json alone refuses it, saying `message`."""
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        EngineConfig(str(folder), device="cpu")


def test_awq_is_refused_where_it_cannot_be(tmp_path, source, awq_checkpoint):
    assert_config_refused(tmp_path, tiny_config("moe-mixed") | {"quantization_config": AWQ_FIELDS},
                          "awq Qwen3-MoE checkpoints are not supported")
    with pytest.raises(ValueError, match="quantization='awq' needs an AWQ checkpoint"):
        EngineConfig(source, device="cpu", quantization="awq")
    with pytest.raises(ValueError, match="quantization='fp8', but the checkpoint is awq"):
        EngineConfig(awq_checkpoint, device="cpu", quantization="fp8")
    assert EngineConfig(awq_checkpoint, device="cpu", quantization="awq").quantization == "awq"


def test_groups_that_do_not_divide_a_projection_are_refused(source, tmp_path):
    """Groups of 128 rows over a 64-wide input: config.json's group_size against the tensors."""
    path = write_awq_layout(source, str(tmp_path / "g32"), GROUP)
    config = json.load(open(os.path.join(path, "config.json")))
    config["quantization_config"]["group_size"] = 128
    (tmp_path / "g32" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="must be whole groups of 128 input rows"):
        ModelRunner(EngineConfig(path, device="cpu", num_kv_blocks=8))


# ---- the checkpoint's tensors ----

def rewritten(path: str, folder, change) -> str:
    tensors = load_file(os.path.join(path, "model.safetensors"))
    change(tensors)
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    (folder / "config.json").write_text(open(os.path.join(path, "config.json")).read())
    return str(folder)


def test_malformed_awq_tensors_are_clear_errors(awq_checkpoint, source, tmp_path):
    zeros = "model.layers.1.self_attn.k_proj.qzeros"
    qweight = "model.layers.0.mlp.down_proj.qweight"
    cases = [
        (lambda t: t.pop(zeros), r"missing tensors \['model.layers.1.self_attn.k_proj.qzeros'\]"),
        (lambda t: t.update({zeros: t[zeros][:, :1].clone()}), "has shape"),
        (lambda t: t.update({qweight: t[qweight].float()}),
         "'model.layers.0.mlp.down_proj.qweight' is torch.float32, expected int32"),
        # a projection stored unquantized where config.json says AWQ
        (lambda t: t.update({"model.layers.0.mlp.down_proj.weight": torch.zeros(64, 128)}),
         "unexpected tensor 'model.layers.0.mlp.down_proj.weight'"),
    ]
    for i, (change, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message):
            ModelRunner(EngineConfig(rewritten(awq_checkpoint, tmp_path / str(i), change), device="cpu",
                                     num_kv_blocks=8))


# ---- against transformers ----

def test_logits_match_transformers(awq_checkpoint):
    """One flat batch of four prompts, to fp32's rounding: the dequantized weights are exact in
    fp32 (a 4-bit integer times an fp16 scale)."""
    for prompt, logits in four_prompt_logits(awq_checkpoint):
        with torch.inference_mode():
            expected = oracle(awq_checkpoint)(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)


def test_greedy_through_the_scheduler_matches_transformers(awq_checkpoint):
    """Chunked prefill mixed with decode, and preemption."""
    prompts = mixed_prompts()
    want = oracle_greedy(awq_checkpoint, prompts)
    assert len({tuple(w) for w in want}) > 1
    for options in (dict(num_kv_blocks=256), dict(num_kv_blocks=16, block_size=4, max_num_batched_tokens=16)):
        assert greedy(awq_checkpoint, prompts, **options) == want


def test_triton_products_in_the_model(awq_checkpoint):
    """The Triton kernels (the interpreter on CPU) in every projection of prefill and decode steps,
    each call checked against awq_linear_ref on the same arguments (the residual, the bias)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors take Triton kernels only through its interpreter; on a GPU: awq_check.py")
    checked = per_call_check(awq_checkpoint, mixed_prompts()[:4], 4, device="cpu", kernels="awq_linear")
    assert checked["modules"] == checked["of_modules"] > 0, checked
    assert checked["output_lengths"] == [4]
    assert checked["fewest_rows"] <= 4 and checked["most_rows"] > 16, checked     # decode steps and prefill steps
    assert checked["worst_rel_err"] < 1e-5, checked


def test_modules_kept_out_of_awq_stay_in_the_models_dtype(source, tmp_path):
    """modules_to_not_convert: layer 1's MLP stays fp32; a packed layer half in AWQ is refused."""
    path = write_awq_layout(source, str(tmp_path / "kept"), GROUP, modules_to_not_convert=["model.layers.1.mlp"])
    runner = ModelRunner(EngineConfig(path, device="cpu", num_kv_blocks=8))
    layers = runner.model.layers
    assert layers[1].mlp.gate_up_proj.weight.dtype == torch.float32 and layers[1].mlp.down_proj.qweight is None
    assert layers[1].self_attn.o_proj.qweight is not None and layers[0].mlp.down_proj.weight is None
    prompts = mixed_prompts()[:4]
    assert greedy(path, prompts, num_kv_blocks=64) == oracle_greedy(path, prompts)
    half = write_awq_layout(source, str(tmp_path / "half"), GROUP, modules_to_not_convert=["k_proj"])
    with pytest.raises(ValueError, match="keeps some of .*q_proj.* out of awq but not all"):
        ModelRunner(EngineConfig(half, device="cpu", num_kv_blocks=8))


def test_one_group_of_the_whole_input(source, tmp_path):
    """group_size -1: one scale and zero point a column over the whole input (each projection's
    own K), read as such; refused under tensor parallelism, where a row-parallel layer's ranks
    would share the scales."""
    path = write_awq_layout(source, str(tmp_path / "whole"), -1)
    runner = ModelRunner(EngineConfig(path, device="cpu", num_kv_blocks=8))
    assert runner.model.layers[0].mlp.down_proj.scales.shape == (1, 64)
    prompts = mixed_prompts()[:2]
    assert greedy(path, prompts, num_kv_blocks=64) == oracle_greedy(path, prompts)
    with pytest.raises(ValueError, match="group_size -1 .* under tensor parallelism"):
        ModelRunner(EngineConfig(path, device="cpu", num_kv_blocks=8, tensor_parallel_size=2))


def test_tensor_parallel_awq_matches_transformers(awq_checkpoint):
    """Two ranks (gloo): q/k/v and gate/up split along qweight's columns, o_proj and down_proj
    along its rows (whole groups a rank), the scales and zero points with them."""
    prompts = mixed_prompts()[:4]
    assert greedy(awq_checkpoint, prompts, num_kv_blocks=64, tensor_parallel_size=2) == oracle_greedy(awq_checkpoint,
                                                                                                       prompts)


def test_lora_on_awq_weights(awq_checkpoint, tmp_path):
    """An adapter over AWQ weights adds its delta to the 4-bit product: the same tokens as the
    adapter over the dequantized checkpoint (the oracle's weights, unquantized, in the engine)."""
    from mini_engine import LoRARequest
    from mini_engine.config import ModelConfig
    from mini_engine.lora import write_random_adapter
    oracle(awq_checkpoint)                            # writes the dequantized checkpoint beside it
    dequantized = awq_checkpoint.rstrip("/") + "-dequantized"
    adapter = write_random_adapter(str(tmp_path / "adapter"), ModelConfig.from_pretrained(dequantized), 8, 0,
                                   dtype=torch.float32, std=0.3)
    prompts = mixed_prompts()[:4]
    lora = LoRARequest("random", 1, adapter)
    outputs = {}
    for path in (awq_checkpoint, dequantized):
        llm = LLM(path, device="cpu", num_kv_blocks=64, enable_lora=True, max_lora_rank=8)
        try:
            got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                               lora_request=lora, use_tqdm=False)
            outputs[path] = [o.outputs[0].token_ids for o in got]
        finally:
            llm.shutdown()
    assert outputs[awq_checkpoint] == outputs[dequantized]
    assert outputs[awq_checkpoint] != oracle_greedy(awq_checkpoint, prompts)      # the adapter changed them


def test_weight_updates_and_deep_sleep_are_refused(awq_checkpoint):
    llm = LLM(awq_checkpoint, device="cpu", num_kv_blocks=16, enable_sleep_mode=True)
    try:
        with pytest.raises(ValueError, match="load_weights does not update AWQ's 4-bit weights"):
            llm.load_weights([("model.layers.0.mlp.down_proj.qweight", torch.zeros(128, 8, dtype=torch.int32))])
        with pytest.raises(ValueError, match="sleep\\(level=2\\) .* AWQ"):
            llm.sleep(level=2)
        # the norms and the embedding are the model's dtype: those update as in any model
        norm = llm.engine.runner.model.layers[0].self_attn.qkv_proj.norm_weight
        assert llm.load_weights([("model.layers.0.input_layernorm.weight", torch.full((64,), 0.5))]) == 1
        assert torch.equal(norm, torch.full((64,), 0.5))
    finally:
        llm.shutdown()
