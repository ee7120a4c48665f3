"""YaRN (Qwen's long-context RoPE): the frequencies and attention factor against transformers' own
for Qwen3's real shape, and a tiny model whose YaRN context is 4x its original one against
transformers' Qwen3ForCausalLM, logits and greedy tokens past the original context; the limit it
sets on max_model_len; vLLM's hf_overrides giving it to a checkpoint without it."""
import json
import random

import pytest
import torch

from mini_engine import LLM, SamplingParams
from mini_engine.config import EngineConfig, ModelConfig
from mini_engine.kernels.rotary_kv import rope_cos_sin_cache
from mini_engine.layers.rope_scaling import parse_rope_scaling
from mini_engine.model.random_checkpoint import write_random_checkpoint
from mini_engine.runner.batch import BatchRow
from tests.conftest import tiny_config
from tests.hf_reference import hf_greedy, hf_logits, transformers
from tests.model.test_qwen3_vs_transformers import all_logits

QWEN3_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
TINY_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 24}


@pytest.mark.parametrize("extra", [{}, {"beta_fast": 16, "beta_slow": 2}, {"mscale": 0.707, "mscale_all_dim": 0.707},
                                   {"attention_factor": 1.5, "truncate": False}, {"factor": 2.5}],
                         ids=["qwen3", "betas", "mscales", "attention factor", "factor 2.5"])
def test_frequencies_and_scale_are_transformers(extra):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    hf_config = transformers.Qwen3Config(head_dim=128, max_position_embeddings=40960,
                                         rope_parameters={"rope_theta": 1e6, **QWEN3_YARN, **extra})
    inv_freq, scale = ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
    yarn = parse_rope_scaling({"max_position_embeddings": 40960, "rope_scaling": QWEN3_YARN | extra})
    assert torch.equal(yarn.inverse_frequencies(128, 1e6), inv_freq) and yarn.attention_scaling() == scale
    assert yarn.max_positions == int(32768 * yarn.factor)
    table = rope_cos_sin_cache(128, 1000, 1e6, yarn=yarn)
    positions = torch.arange(1000, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    torch.testing.assert_close(table, torch.cat([angles.cos(), angles.sin()], -1) * scale, rtol=0, atol=0)


@pytest.fixture(scope="module")
def yarn_checkpoint(tmp_path_factory) -> str:
    """The tied GQA-2 tiny model with 32 positions of its own and YaRN to 96: rope_parameters as
    transformers 5 writes them."""
    config = tiny_config("tied-gqa2") | {"max_position_embeddings": 32,
                                          "rope_parameters": {"rope_theta": 10000.0, **TINY_YARN}}
    return write_random_checkpoint(str(tmp_path_factory.mktemp("tiny-yarn")), config, dtype=torch.float32, std=0.3)


def test_logits_past_the_original_context_match_transformers(yarn_checkpoint, tmp_path):
    llm = LLM(yarn_checkpoint, device="cpu", num_kv_blocks=64)
    assert llm.engine.config.max_model_len == 96
    prompt = random.Random(3).choices(range(256), k=90)
    logits = all_logits(llm.engine.runner, [BatchRow(prompt, 0, list(range(6)), True, SamplingParams(temperature=0))])
    expected = hf_logits(yarn_checkpoint, prompt)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    plain = without_yarn(yarn_checkpoint, tmp_path, max_position_embeddings=96)
    assert (hf_logits(plain, prompt) - expected).abs().max() > 0.1, "YaRN should move the logits"


def without_yarn(path: str, tmp_path, **changes) -> str:
    """A copy of the checkpoint whose config.json asks for plain RoPE."""
    import shutil
    plain = tmp_path / "plain"
    shutil.copytree(path, plain)
    config = json.loads((plain / "config.json").read_text())
    config.update(rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, **changes)
    (plain / "config.json").write_text(json.dumps(config))
    return str(plain)


def test_greedy_tokens_past_the_original_context_match_transformers(yarn_checkpoint):
    """A 20-token prompt decoding to position 89, through the paged cache, chunked prefill and all."""
    prompt = random.Random(4).choices(range(256), k=20)
    llm = LLM(yarn_checkpoint, device="cpu", num_kv_blocks=64, max_num_batched_tokens=8)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=70, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(yarn_checkpoint, prompt, 70)


def test_max_model_len_is_original_times_factor(yarn_checkpoint):
    with pytest.raises(ValueError, match=r"max_model_len must be in \[1, 96\]"):
        EngineConfig(yarn_checkpoint, device="cpu", num_kv_blocks=8, max_model_len=97)
    assert EngineConfig(yarn_checkpoint, device="cpu", num_kv_blocks=8, max_model_len=40).max_model_len == 40


def test_hf_overrides_give_yarn_to_a_checkpoint_without_it(yarn_checkpoint, tmp_path):
    """vLLM's hf_overrides (Qwen's model cards turn YaRN on so): the same model as the one whose
    config.json has it."""
    plain = without_yarn(yarn_checkpoint, tmp_path)
    assert ModelConfig.from_pretrained(plain).max_positions == 32
    overrides = {"rope_parameters": {"rope_theta": 10000.0, **TINY_YARN}}
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    prompt = [random.Random(5).choices(range(256), k=30)]
    got = LLM(plain, device="cpu", num_kv_blocks=64, hf_overrides=overrides).generate(prompt, params, use_tqdm=False)
    want = LLM(yarn_checkpoint, device="cpu", num_kv_blocks=64).generate(prompt, params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="hf_overrides must be a dict"):
        EngineConfig(plain, device="cpu", hf_overrides="yarn")
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(plain, device="cpu", hf_overrides=overrides, model_config=ModelConfig.from_pretrained(plain))


@pytest.mark.parametrize("scaling, match", [
    ({"rope_type": "yarn"}, "YaRN needs a factor"),
    ({"rope_type": "yarn", "factor": None}, "integer original_max_position_embeddings"),
    ({"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 16}, "factor >= 1"),
    ({"rope_type": "yarn", "factor": float("inf"), "original_max_position_embeddings": 16}, "factor >= 1"),
    ({"rope_type": "yarn", "factor": float("nan"), "original_max_position_embeddings": 16}, "factor >= 1"),
    ({"rope_type": "yarn", "factor": 2, "original_max_position_embeddings": 0}, "original_max_position_embeddings"),
    ({"rope_type": "yarn", "factor": 2, "original_max_position_embeddings": True}, "original_max_position_embeddings"),
    ({"rope_type": "yarn", "factor": 2, "original_max_position_embeddings": 16, "beta_fast": "fast"}, "finite numbers"),
    ({"rope_type": "yarn", "factor": 2, "original_max_position_embeddings": 16, "beta_slow": -1}, "finite numbers"),
    ({"rope_type": "yarn", "factor": True, "original_max_position_embeddings": 16}, "factor >= 1"),
    ({"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64}, "without a factor"),
    ({"rope_type": "dynamic", "factor": 2}, "not supported"),
])
def test_bad_scalings_are_refused(scaling, match):
    with pytest.raises(ValueError, match=match):
        parse_rope_scaling({"rope_scaling": scaling} | ({} if "original_max_position_embeddings" not in scaling
                                                         else {"max_position_embeddings": 32}))


def test_config_json_is_read_as_transformers_reads_it():
    """rope_scaling, when it has anything, before rope_parameters (even a plain one); the dict's
    rope_theta before the top level's; a beta of 0 is the default; with a null factor, the ratio of
    the two lengths, and the positions are max_position_embeddings'."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    base = tiny_config("tied-gqa2") | {"max_position_embeddings": 61}
    assert ModelConfig.from_dict(base | {"rope_scaling": {"rope_type": "default"}, "rope_parameters": yarn}
                                 ).rope_scaling is None
    config = ModelConfig.from_dict(base | {"rope_parameters": yarn | {"rope_theta": 500.0}})
    assert config.rope_theta == 500.0 and config.max_positions == 64
    assert parse_rope_scaling(base | {"rope_scaling": yarn | {"beta_fast": 0}}).beta_fast == 32.0
    ratio = parse_rope_scaling(base | {"rope_scaling": {"rope_type": "yarn", "factor": None,
                                                        "original_max_position_embeddings": 7}})
    assert ratio.factor == 61 / 7 and ratio.max_positions == 61
    hf_config = transformers.Qwen3Config(head_dim=16, max_position_embeddings=61, rope_parameters={
        "rope_theta": 1e4, "rope_type": "yarn", "factor": None, "original_max_position_embeddings": 7})
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    inv_freq, scale = ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
    assert torch.equal(ratio.inverse_frequencies(16, 1e4), inv_freq) and ratio.attention_scaling() == scale


def test_the_server_takes_hf_overrides_as_json():
    pytest.importorskip("fastapi")         # the server's (the GPU machine has none of it)
    from mini_engine.serve import parse_args
    args = parse_args(["--hf-overrides", json.dumps({"rope_scaling": QWEN3_YARN})])
    assert args.hf_overrides == {"rope_scaling": QWEN3_YARN}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the Triton kernels reading the YaRN table")
def test_the_gpu_kernels_read_the_yarn_table(yarn_checkpoint):
    """On CUDA the rotary/KV-write and attention kernels run on the same table: logits past the
    original context against transformers' in fp32 (the kernels' dots in TF32, hence the tolerance),
    and greedy tokens through CUDA graphs equal to the eager path's."""
    prompt = random.Random(6).choices(range(256), k=90)
    llm = LLM(yarn_checkpoint, device="cuda", dtype="float32", num_kv_blocks=64, block_size=16)
    assert llm.engine.runner.kernels >= {"attention", "rope_kv"}
    logits = all_logits(llm.engine.runner, [BatchRow(prompt, 0, list(range(6)), True, SamplingParams(temperature=0))])
    torch.testing.assert_close(logits.cpu(), hf_logits(yarn_checkpoint, prompt), rtol=2e-2, atol=2e-2)
    params = SamplingParams(temperature=0, max_tokens=70, ignore_eos=True)
    prompts = [random.Random(seed).choices(range(256), k=20) for seed in range(4)]
    graphs = llm.generate(prompts, params, use_tqdm=False)
    eager = LLM(yarn_checkpoint, device="cuda", dtype="float32", num_kv_blocks=64, block_size=16,
                enforce_eager=True, kernels="none").generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in graphs] == [o.outputs[0].token_ids for o in eager]
