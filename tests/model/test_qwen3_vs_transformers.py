"""The model alone: logits over whole prompts, and over a prompt fed in chunks through the
paged cache, against transformers' Qwen3ForCausalLM loaded from the same files."""
import os
import random

import pytest
import torch

from mini_engine.config import KV_CACHE_DTYPES, EngineConfig
from mini_engine.runner.batch import BatchRow
from mini_engine.runner.model_runner import ModelRunner
from mini_engine.sampling_params import SamplingParams
from tests.conftest import TINY_CONFIGS
from tests.hf_reference import hf_logits, hf_model


GREEDY = SamplingParams(temperature=0)


def all_logits(runner: ModelRunner, rows: list[BatchRow]) -> torch.Tensor:
    with torch.inference_mode():
        t, meta = runner.prepare_inputs(rows)
        return runner.model.compute_logits(runner.model(t.input_ids, t.positions, meta)).float()


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_logits_match_transformers(checkpoint_factory, name):
    path = checkpoint_factory(name)
    runner = ModelRunner(EngineConfig(path, device="cpu", num_kv_blocks=64, block_size=4))
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (1, 5, 17, 40)]
    for prompt, logits in flat_batch_logits(runner, prompts):
        torch.testing.assert_close(logits, hf_logits(path, prompt), rtol=1e-4, atol=1e-4)


def flat_batch_logits(runner: ModelRunner, prompts: list[list[int]]) -> list[tuple[list[int], torch.Tensor]]:
    """All the prompts in one flat batch, each in its own blocks of runner's block_size (one-token
    prompts first, where a step puts its decode rows): each prompt with its logits."""
    rows, next_block = [], 0
    for p in prompts:
        blocks = list(range(next_block, next_block + -(-len(p) // runner.block_size)))
        next_block += len(blocks)
        rows.append(BatchRow(p, 0, blocks, True, GREEDY))
    rows.sort(key=lambda r: len(r.token_ids) != 1)
    logits = all_logits(runner, rows)
    ends = torch.tensor([len(r.token_ids) for r in rows]).cumsum(0).tolist()
    return [(row.token_ids, logits[end - len(row.token_ids):end]) for row, end in zip(rows, ends)]


def four_prompt_logits(path: str) -> list[tuple[list[int], torch.Tensor]]:
    """The engine's logits over the checkpoint at `path` for four random prompts of 1, 6, 17 and
    33 tokens in one flat batch (flat_batch_logits): what the quantized checkpoints' tests compare
    with their oracles."""
    runner = ModelRunner(EngineConfig(path, device="cpu", num_kv_blocks=64, block_size=4))
    rng = random.Random(0)
    return flat_batch_logits(runner, [[rng.randrange(256) for _ in range(n)] for n in (1, 6, 17, 33)])


def test_chunked_prefill_logits_match(tiny_checkpoint):
    """A prompt fed as three chunks, each attending to the context the earlier ones cached."""
    runner = ModelRunner(EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=64, block_size=4))
    prompt = [random.Random(1).randrange(256) for _ in range(23)]
    blocks = [7, 3, 11, 0, 5, 9]     # deliberately out of order
    got = [all_logits(runner, [BatchRow(prompt[a:b], a, blocks, True, GREEDY)]) for a, b in ((0, 6), (6, 7), (7, 23))]
    torch.testing.assert_close(torch.cat(got), hf_logits(tiny_checkpoint, prompt), rtol=1e-4, atol=1e-4)


def test_packed_weights_equal_checkpoint_with_norms_folded(tiny_checkpoint):
    """q/k/v and gate/up are packed, each scaled column by column by the norm before it; folding
    again (a second load_model's call) changes nothing."""
    runner = ModelRunner(EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=8))
    hf = hf_model(tiny_checkpoint).model.layers[1]
    ours = runner.model.layers[1]
    attn, mlp = hf.self_attn, hf.mlp
    assert not torch.allclose(hf.input_layernorm.weight, torch.ones_like(hf.input_layernorm.weight))
    qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]) * hf.input_layernorm.weight
    gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]) * hf.post_attention_layernorm.weight
    for _ in range(2):
        torch.testing.assert_close(ours.self_attn.qkv_proj.weight, qkv)
        torch.testing.assert_close(ours.mlp.gate_up_proj.weight, gate_up)
        runner.model.fold_norm_weights()
    assert runner.model.lm_head.weight is runner.model.embed_tokens.weight    # tied


def test_sharded_checkpoint_loads_the_same_weights(tiny_checkpoint, tmp_path):
    """model.safetensors.index.json with the tensors spread over two shards, as large checkpoints come."""
    import json
    import os
    import shutil

    from safetensors.torch import load_file, save_file
    tensors = load_file(os.path.join(tiny_checkpoint, "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, tmp_path / file)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: file for file, keys in shards.items() for k in keys}}))
    shutil.copy(os.path.join(tiny_checkpoint, "config.json"), tmp_path / "config.json")
    whole = ModelRunner(EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=8)).model.state_dict()
    sharded = ModelRunner(EngineConfig(str(tmp_path), device="cpu", num_kv_blocks=8)).model.state_dict()
    assert whole.keys() == sharded.keys()
    assert all(torch.equal(whole[k], sharded[k]) for k in whole)
    os.remove(tmp_path / "model-00002-of-00002.safetensors")
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        ModelRunner(EngineConfig(str(tmp_path), device="cpu", num_kv_blocks=8))


def test_every_layer_shares_one_rotary_table(tiny_checkpoint):
    """One cos/sin table for the model, not one a layer (28 x 21 MB of Qwen3-0.6B's GPU memory)."""
    runner = ModelRunner(EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=8))
    tables = {layer.self_attn.qk_norm_rope.cos_sin_cache.data_ptr() for layer in runner.model.layers}
    assert len(runner.model.layers) > 1 and len(tables) == 1
    assert len([name for name, _ in runner.model.named_buffers() if "cos_sin_cache" in name]) == 1


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("kernels", ["none", "attention,rope_kv"])
def test_fp8_kv_cache_logits_match_transformers_reading_fp8(tiny_checkpoint, kernels, kv_cache_dtype):
    """kv_cache_dtype "fp8" (e4m3) or "fp8_e5m2": a prompt fed in three chunks (the later ones
    attend to what the earlier cached, in fp8) gives transformers' logits when its attention reads
    K and V rounded to fp8 the same way, and logits measurably off those of a full-precision cache.
    With kernels, the fused KV write and the Triton attention (Triton's interpreter on CPU)."""
    if kernels != "none":
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("CPU tensors take Triton kernels only through its interpreter; on a GPU: gpu_correctness.py")
    runner = ModelRunner(EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=64, block_size=4,
                                      kv_cache_dtype=kv_cache_dtype, kernels=kernels))
    assert runner.kv_cache.dtype == KV_CACHE_DTYPES[kv_cache_dtype]
    prompt = [random.Random(1).randrange(256) for _ in range(23)]
    blocks = [7, 3, 11, 0, 5, 9]
    got = torch.cat([all_logits(runner, [BatchRow(prompt[a:b], a, blocks, True, GREEDY)])
                     for a, b in ((0, 6), (6, 7), (7, 23))])
    torch.testing.assert_close(got, hf_logits(tiny_checkpoint, prompt, kv_cache_dtype), rtol=1e-4, atol=1e-4)
    assert (got - hf_logits(tiny_checkpoint, prompt)).abs().max() > 1e-2
