"""What RL trainers ask of vLLM's offline LLM between training steps (mini_engine/runner/weight_updates.py,
runner/sleep_mode.py): LLM.load_weights, reset_prefix_cache, sleep and wake_up. The oracle is a
fresh engine on a checkpoint holding the weights the update gave: the same greedy tokens, and the
same parameters bit for bit (folded norms and fp8 blocks included)."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mini_engine import LLM, SamplingParams
from mini_engine.layers.linear import NormedPackedLinear
from mini_engine.lora import LoRARequest, write_random_adapter
from mini_engine.model.random_checkpoint import write_random_checkpoint
from tests.conftest import TINY_BASE, tiny_config

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# 40 tokens: two whole 16-token blocks that the prefix cache keeps after a generation.
LONG = [(7 * i) % 250 + 3 for i in range(40)]
PROMPTS = [LONG, LONG[:20] + [9, 8, 7], [5, 6, 7], [200, 100, 50, 25, 12]]
LAYER1 = "model.layers.1."


def checkpoint(tmp_path_factory, config: dict, seed: int, name: str) -> str:
    return write_random_checkpoint(str(tmp_path_factory.mktemp(name)), config, dtype=torch.float32, std=0.3,
                                   seed=seed)


@pytest.fixture(scope="module")
def a_and_b(tmp_path_factory) -> tuple[str, str]:
    """Two tiny random checkpoints of one shape (tied embeddings, both norms folded)."""
    config = tiny_config("tied-gqa2")
    return checkpoint(tmp_path_factory, config, 0, "a"), checkpoint(tmp_path_factory, config, 1, "b")


def tensors(path: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(path, "model.safetensors"))


def changed_copy(source: str, folder: str, changes: dict[str, torch.Tensor]) -> str:
    """source's checkpoint with some tensors replaced, in folder."""
    os.makedirs(folder, exist_ok=True)
    shutil.copy(os.path.join(source, "config.json"), folder)
    save_file(tensors(source) | changes, os.path.join(folder, "model.safetensors"))
    return folder


def engine(path: str, **options) -> LLM:
    return LLM(path, device="cpu", num_kv_blocks=64, **options)


def greedy(llm: LLM, prompts=PROMPTS, **kwargs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, **kwargs)]


def model_state(llm: LLM) -> dict[str, torch.Tensor]:
    """Every parameter, and each folded projection's g, as bytes (fp8 blocks compare too)."""
    model = llm.engine.runner.model
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    state |= {f"{name}.folded_norm_weight": m.folded_norm_weight.clone() for name, m in model.named_modules()
              if isinstance(m, NormedPackedLinear) and m.folded_norm_weight is not None}
    return state


def assert_same_state(llm: LLM, other: LLM | dict) -> None:
    mine, theirs = model_state(llm), other if isinstance(other, dict) else model_state(other)
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert torch.equal(mine[name].view(torch.uint8), theirs[name].view(torch.uint8)), name


def num_cached_tokens(llm: LLM, prompt: list[int]) -> int:
    return llm.generate([prompt], GREEDY, use_tqdm=False)[0].num_cached_tokens


def test_an_update_generates_what_a_fresh_engine_on_the_new_weights_does(a_and_b):
    """The whole of B's checkpoint, from its file, into an engine on A: B's tokens, including for
    the prompt A's weights left in the prefix cache (the cache was reset), and B's parameters."""
    a, b = a_and_b
    llm, fresh_b = engine(a), engine(b)
    expected = greedy(fresh_b)
    before = greedy(llm)
    assert before != expected, "the two checkpoints generate alike: the test would prove nothing"
    assert num_cached_tokens(llm, LONG) == 32, "A's KV of LONG is not in the prefix cache"
    assert llm.load_weights(tensors(b).items()) == len(tensors(b))
    assert greedy(llm, [LONG]) == expected[:1]       # the cached prompt first, before anything refills the cache
    assert greedy(llm) == expected
    assert_same_state(llm, fresh_b)


def test_hf_named_parameters_one_call_each_compose_to_the_fresh_engine(a_and_b, tmp_path):
    """transformers' Qwen3ForCausalLM loaded from B: its named_parameters() (no lm_head: tied) in
    one call, and then its state_dict() (both names of the tied matrix) one tensor a call, in
    bf16, as TRL sends them: every layer's norms come after their projections, each folded with
    the projections' W held from the calls before. Each time, B's tokens and parameters."""
    transformers = pytest.importorskip("transformers")
    a, b = a_and_b
    hf = transformers.AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32)
    fresh_b = engine(b)
    llm = engine(a)
    llm.load_weights(hf.named_parameters())
    assert greedy(llm) == greedy(fresh_b)
    assert_same_state(llm, fresh_b)

    # bf16 tensors cast to the engine's fp32: the fresh engine reads the same bf16 values.
    state = {name: t.to(torch.bfloat16) for name, t in hf.state_dict().items()}
    assert "lm_head.weight" in state
    bf16_b = changed_copy(b, str(tmp_path), {n: t.float() for n, t in state.items() if n != "lm_head.weight"})
    llm = engine(a)
    greedy(llm)
    for name, tensor in state.items():
        llm.load_weights([(name, tensor)])
    assert_same_state(llm, engine(bf16_b))
    assert greedy(llm) == greedy(engine(bf16_b))


def test_a_partial_update_equals_a_checkpoint_written_with_the_same_change(a_and_b, tmp_path):
    """One layer's q_proj (folded with the norm held), then that layer's input_layernorm alone (its
    q/k/v refolded: q's W from the update before, k's and v's read from A's file), then its
    post_attention_layernorm, each equal to a fresh engine on A written with the same changes."""
    a, _ = a_and_b
    llm = engine(a)
    cached_before = greedy(llm)
    q = LAYER1 + "self_attn.q_proj.weight"
    changes = {q: tensors(a)[q].flip(0) * 0.8}
    llm.load_weights(changes.items())
    expected = engine(changed_copy(a, str(tmp_path / "q"), changes))
    assert_same_state(llm, expected)
    assert greedy(llm) == greedy(expected) != cached_before
    for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        change = {LAYER1 + norm: torch.linspace(0.5, 1.5, 64)}
        changes |= change
        llm.load_weights(change.items())
        expected = engine(changed_copy(a, str(tmp_path / norm), changes))
        assert_same_state(llm, expected)
        assert greedy(llm) == greedy(expected)


@pytest.mark.parametrize("bad, message", [
    (("model.layers.0.self_attn.qq_proj.weight", torch.zeros(64, 64)), "unexpected tensor"),
    (("model.layers.0.self_attn.q_proj.weight", torch.zeros(64, 63)), r"has shape \(64, 63\), expected \(64, 64\)"),
    (("model.layers.5.mlp.up_proj.weight", torch.zeros(128, 64)), "unexpected tensor"),
    (("model.norm.weight", torch.tensor([float("nan")] + [1.0] * 63)), "not finite"),
    (("model.layers.1.input_layernorm.weight", torch.full((64,), float("inf"))), "not finite"),
    (("model.norm.weight", torch.ones(64, dtype=torch.int64)), "floating-point"),
    (("model.layers.0.self_attn.k_proj.weight", torch.zeros(32, 64, dtype=torch.float8_e4m3fn)), "floating-point"),
    (("model.norm.weight", torch.ones(64)), "given twice"),
    (("lm_head.weight", torch.zeros(256, 64)), "lm_head.weight differs"),
    (("model.layers.0.self_attn.q_proj.weight", "not a tensor"), r"\(name, torch.Tensor\) pairs"),
])
def test_a_bad_update_raises_and_writes_nothing(a_and_b, bad, message):
    """Good tensors first, the bad one last: nothing of the update is written."""
    a, b = a_and_b
    llm = engine(a)
    before, state = greedy(llm), model_state(llm)
    good = [(name, t) for name, t in tensors(b).items() if name.startswith(("model.norm", "model.embed", LAYER1))]
    with pytest.raises(ValueError, match=message):
        llm.load_weights(good + [bad])
    assert_same_state(llm, state)
    assert greedy(llm) == before
    assert num_cached_tokens(llm, LONG) == 32, "a failed update reset the prefix cache"


def test_a_norm_alone_is_refused_when_the_checkpoint_changed_on_disk(a_and_b, tmp_path):
    """A norm given alone is folded into its projections' W as loaded from disk: a file changed since
    (its q_proj here) would fold the wrong W, so the update is refused, with nothing written."""
    a, b = a_and_b
    path = changed_copy(a, str(tmp_path / "a"), {})
    llm = engine(path)
    state = model_state(llm)
    q = LAYER1 + "self_attn.q_proj.weight"
    changed_copy(a, path, {q: tensors(b)[q]})
    with pytest.raises(ValueError, match="no longer holds the 'model.layers.1.self_attn.q_proj.weight'"):
        llm.load_weights([(LAYER1 + "input_layernorm.weight", torch.ones(64)),
                          ("model.norm.weight", torch.ones(64))])
    assert_same_state(llm, state)
    # With the projections given too, nothing needs the file.
    llm.load_weights([(LAYER1 + "input_layernorm.weight", torch.ones(64))]
                     + [(LAYER1 + f"self_attn.{p}_proj.weight", tensors(a)[LAYER1 + f"self_attn.{p}_proj.weight"])
                        for p in "qkv"])


def test_reset_prefix_cache_and_requests_in_flight(a_and_b):
    """reset_prefix_cache: False while a request holds blocks (vLLM's), True between generations,
    after which nothing is served from the cache. load_weights and sleep refuse while requests are
    unfinished, before anything changes."""
    a, b = a_and_b
    llm = engine(a, enable_sleep_mode=True)
    greedy(llm, [LONG])
    assert llm.engine.block_manager.cached_blocks
    seq = llm.engine.add_request(LONG + [1], GREEDY)
    llm.engine.step()                                 # it holds blocks now
    assert llm.reset_prefix_cache() is False
    with pytest.raises(RuntimeError, match="1 requests are unfinished"):
        llm.load_weights(tensors(b).items())
    with pytest.raises(RuntimeError, match="requests are unfinished"):
        llm.sleep()
    assert not llm.is_sleeping()
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert seq.is_finished and llm.engine.block_manager.cached_blocks
    assert llm.reset_prefix_cache() is True
    assert not llm.engine.block_manager.cached_blocks
    assert num_cached_tokens(llm, LONG) == 0


def test_sleep_level_1_frees_the_memory_and_wakes_to_the_same_outputs(a_and_b):
    a, _ = a_and_b
    llm = engine(a, enable_sleep_mode=True)
    before, state = greedy(llm), model_state(llm)
    runner = llm.engine.runner
    llm.sleep(level=1)
    assert llm.is_sleeping()
    assert runner.kv_cache.untyped_storage().nbytes() == 0
    assert all(p.untyped_storage().nbytes() == 0 for p in runner.model.parameters())
    with pytest.raises(RuntimeError, match="asleep"):
        greedy(llm)
    llm.sleep(level=1)                                # already asleep: a warning, nothing else
    llm.wake_up(tags=["kv_cache"])
    assert llm.is_sleeping()                          # until every tag is awake
    with pytest.raises(RuntimeError, match=r"asleep \(weights released\)"):
        greedy(llm)
    llm.wake_up()
    assert not llm.is_sleeping()
    assert_same_state(llm, state)
    assert not llm.engine.block_manager.cached_blocks
    assert num_cached_tokens(llm, LONG) == 0
    assert greedy(llm) == before


def test_sleep_level_2_then_new_weights(a_and_b):
    """vLLM's RL cycle: sleep(level=2) discards the weights; wake the weights alone, load new ones
    (one tensor a call, norms after their projections), then wake the KV cache: the new model's
    tokens. Until every weight has come, the model refuses to run."""
    a, b = a_and_b
    llm = engine(a, enable_sleep_mode=True)
    greedy(llm)
    llm.sleep(level=2)
    with pytest.raises(RuntimeError, match="wake_up"):
        llm.load_weights(tensors(b).items())
    llm.wake_up(tags=["weights"])
    items = list(tensors(b).items())
    for name, tensor in items[:-1]:
        llm.load_weights([(name, tensor)])
    llm.wake_up(tags=["kv_cache"])
    with pytest.raises(RuntimeError, match=f"1 not given yet, e.g. \\['{items[-1][0]}'\\]"):
        greedy(llm)
    llm.load_weights(items[-1:])
    fresh_b = engine(b)
    assert_same_state(llm, fresh_b)
    assert greedy(llm) == greedy(fresh_b)


def test_sleep_mode_options(a_and_b):
    a, _ = a_and_b
    llm = engine(a)
    with pytest.raises(ValueError, match="enable_sleep_mode=True"):
        llm.sleep()
    llm = engine(a, enable_sleep_mode=True)
    with pytest.raises(ValueError, match="sleep level must be 1"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="wake_up tags must be among"):
        llm.wake_up(tags=["weight"])
    llm.wake_up()                                     # not asleep: a warning, nothing else
    assert not llm.is_sleeping()


FP8_TINY = TINY_BASE | dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=2, head_dim=128, tie_word_embeddings=False, attention_bias=False)


def test_fp8_weights_are_quantized_again(tmp_path_factory):
    """quantization="fp8": an update's projections are folded, then quantized to the blocks and
    scales a fresh load makes; a norm alone refolds and requantizes its projections from disk."""
    a, b = (checkpoint(tmp_path_factory, FP8_TINY, seed, f"fp8-{seed}") for seed in (0, 1))
    llm = LLM(a, device="cpu", num_kv_blocks=32, quantization="fp8")
    greedy(llm, PROMPTS[:2])
    norm = {"model.layers.0.post_attention_layernorm.weight": torch.linspace(0.5, 1.5, 128)}
    llm.load_weights(norm.items())
    expected = LLM(changed_copy(a, str(tmp_path_factory.mktemp("fp8-norm")), norm), device="cpu", num_kv_blocks=32,
                   quantization="fp8")
    assert_same_state(llm, expected)
    llm.load_weights(tensors(b).items())
    fresh_b = LLM(b, device="cpu", num_kv_blocks=32, quantization="fp8")
    assert_same_state(llm, fresh_b)
    assert greedy(llm, PROMPTS[:2]) == greedy(fresh_b, PROMPTS[:2])


def test_moe_experts_update(tmp_path_factory):
    """A Qwen3-MoE checkpoint's experts (stacked by the loader) take the update's tensors too."""
    config = tiny_config("moe-mixed")
    a, b = (checkpoint(tmp_path_factory, config, seed, f"moe-{seed}") for seed in (0, 1))
    llm = engine(a)
    llm.load_weights(tensors(b).items())
    fresh_b = engine(b)
    assert_same_state(llm, fresh_b)
    assert greedy(llm, PROMPTS[:2]) == greedy(fresh_b, PROMPTS[:2])


def test_lora_adapters_take_the_new_norms(a_and_b, tmp_path):
    """A loaded adapter's A holds the folded norm's g (NormedPackedLinear.lora_pair): after an
    update the adapter is loaded into its slot again, and generates as on a fresh engine."""
    a, b = a_and_b
    llm = engine(a, enable_lora=True, max_lora_rank=8)
    folder = write_random_adapter(str(tmp_path / "adapter"), llm.engine.config.model_config, rank=8, seed=3,
                                  dtype=torch.float32, std=0.3)
    lora = LoRARequest("adapter", 1, folder)
    greedy(llm, lora_request=lora)
    llm.load_weights(tensors(b).items())
    assert greedy(llm, lora_request=lora) == greedy(engine(b, enable_lora=True, max_lora_rank=8), lora_request=lora)


def test_tensor_parallel_ranks_take_the_update_and_sleep(a_and_b, tmp_path):
    """Two gloo ranks: the update crosses to the other rank (each cuts its share), a norm alone
    is refolded on each rank from its share of the file, and sleep and wake_up reach both."""
    a, b = a_and_b
    llm = LLM(a, device="cpu", num_kv_blocks=64, tensor_parallel_size=2, enable_sleep_mode=True)
    try:
        greedy(llm)
        llm.load_weights(tensors(b).items())
        assert greedy(llm) == greedy(engine(b))
        norm = {LAYER1 + "input_layernorm.weight": torch.linspace(0.5, 1.5, 64)}
        llm.load_weights(norm.items())
        expected = greedy(engine(changed_copy(b, str(tmp_path / "b"), norm)))
        assert greedy(llm) == expected
        with pytest.raises(ValueError, match="has shape"):
            llm.load_weights([("model.norm.weight", torch.ones(3))])
        llm.sleep(level=1)
        llm.wake_up()
        assert greedy(llm) == expected
        assert llm.engine.runner.broken is None
    finally:
        llm.shutdown()


def test_a_wake_up_that_failed_can_be_called_again(a_and_b, monkeypatch):
    """A storage that could not be allocated again (a full device) leaves its tag asleep, its
    record kept, so that a second wake_up restores it; before, the tag counted as awake with
    nothing behind it."""
    import mini_engine.runner.model_runner as model_runner
    a, _ = a_and_b
    llm = engine(a, enable_sleep_mode=True)
    before = greedy(llm)
    llm.sleep(level=1)
    restore = model_runner.restore

    def out_of_memory_once(released):
        monkeypatch.setattr(model_runner, "restore", restore)
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(model_runner, "restore", out_of_memory_once)
    with pytest.raises(RuntimeError, match="out of memory"):
        llm.wake_up()
    assert llm.is_sleeping()
    llm.wake_up()
    assert not llm.is_sleeping()
    assert greedy(llm) == before
