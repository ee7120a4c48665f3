"""Bad input gets a clear error, and costs the other requests nothing."""
import json
import os
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from mini_engine import LLM, SamplingParams
from mini_engine.engine.engine import LLMEngine
from mini_engine.config import EngineConfig


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(top_k=2**63), "top_k"), (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=2.5), "max_tokens"),
    (dict(seed=-1), "seed"), (dict(stop_token_ids=[-3]), "stop_token_ids"), (dict(stop=[""]), "stop"),
    (dict(stop=["ok", 3]), "stop"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(presence_penalty=2.1), "presence_penalty"), (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(presence_penalty=float("nan")), "presence_penalty"), (dict(frequency_penalty="1"), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(repetition_penalty=True), "repetition_penalty"), (dict(min_p=-0.1), "min_p"), (dict(min_p=1.01), "min_p"),
    # 0 or inf once on the device, in float32: refused, not sampled with (as NaN, or every step failing)
    (dict(repetition_penalty=1e-46), "repetition_penalty"), (dict(repetition_penalty=1e39), "repetition_penalty"),
    (dict(repetition_penalty=10**400), "repetition_penalty"), (dict(temperature=1e39), "temperature"),
    (dict(temperature=10**400), "temperature"),
    (dict(n=0), "n must be"), (dict(n=1.5), "n must be"), (dict(n=True), "n must be"), (dict(n=10**6), "n must be"),
    (dict(n=2, temperature=0), "n must be 1 when sampling greedily"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=17), "min_tokens"), (dict(min_tokens=1.5), "min_tokens"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"), (dict(logit_bias={5: 100.5}), "logit_bias"),
    (dict(logit_bias={5: float("nan")}), "logit_bias"), (dict(logit_bias={"5": 1.0}), "logit_bias"),
    (dict(logit_bias=[5]), "logit_bias"), (dict(logit_bias={True: 1.0}), "logit_bias"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_a_temperature_too_small_to_divide_by_samples_greedily(tiny_checkpoint):
    """Logits divided by 1e-39 overflow to inf, whose softmax is NaN: below GREEDY_TEMPERATURE a
    request samples greedily (vLLM's rule) and gets the greedy tokens; just above it, it is not
    marked greedy."""
    assert SamplingParams(temperature=1e-39).greedy and not SamplingParams(temperature=1e-4).greedy
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=64)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    outputs = {t: [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=t, max_tokens=8, ignore_eos=True, seed=1), use_tqdm=False)]
        for t in (0.0, 1e-39, 1e-45)}
    assert outputs[1e-39] == outputs[1e-45] == outputs[0.0]


def test_more_logprobs_than_the_vocabulary_is_rejected_and_others_carry_on(tiny_checkpoint):
    """max_logprobs above the vocabulary: the vocabulary is the limit."""
    engine = LLMEngine(EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=64, max_logprobs=10**6))
    vocab = engine.config.model_config.vocab_size
    good = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                        logprobs=vocab))
    with pytest.raises(ValueError, match="logprobs"):
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, logprobs=vocab + 1))
    while engine.has_unfinished_requests():
        engine.step()
    assert good.num_output_tokens == 4 and engine.num_free_blocks == 64


def test_stop_strings_without_a_tokenizer_are_rejected(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=16)
    assert llm.tokenizer is None
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate([[5, 6, 7]], SamplingParams(stop=["x"]), use_tqdm=False)
    assert llm.engine.num_free_blocks == 16


def test_prompt_too_long_is_rejected_and_others_carry_on(tiny_checkpoint):
    engine = LLMEngine(EngineConfig(tiny_checkpoint, device="cpu", max_model_len=64, num_kv_blocks=64))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    good = engine.add_request(list(range(3, 20)), params)
    engine.step()
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(list(range(3, 63)), params)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], params)
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([5, 100000], params)
    while engine.has_unfinished_requests():
        engine.step()
    assert good.num_output_tokens == 8 and engine.num_free_blocks == 64


@pytest.mark.parametrize("prompt", [[5, -1], [5, 100000], [5, 6.0], [5, "6"], [5, None], [[5, 6]], [True, False]])
def test_bad_prompt_token_ids_are_rejected(tiny_checkpoint, prompt):
    engine = LLMEngine(EngineConfig(tiny_checkpoint, device="cpu", max_model_len=64, num_kv_blocks=64))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request(prompt, SamplingParams(max_tokens=4))
    assert not engine.has_unfinished_requests()


def test_numpy_integer_token_ids_are_accepted(tiny_checkpoint):
    import numpy as np
    llm = LLM(tiny_checkpoint, device="cpu", max_model_len=64, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    out = llm.generate([list(np.arange(5, 9, dtype=np.int32)), [5, 6, 7, 8]], params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == out[1].outputs[0].token_ids


def test_request_larger_than_the_pool_is_rejected(tiny_checkpoint):
    engine = LLMEngine(EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=4, block_size=4))
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request(list(range(3, 20)), SamplingParams(max_tokens=4))
    assert not engine.has_unfinished_requests()


def test_a_measured_pool_smaller_than_max_model_len_warns_at_start(tiny_checkpoint):
    """The tiny checkpoint's max_model_len is 512: 4 CPU blocks of 16 tokens hold 64 of them."""
    with pytest.warns(UserWarning, match="fewer than one max_model_len=512 sequence"):
        LLMEngine(EngineConfig(tiny_checkpoint, device="cpu", cpu_kv_blocks=4))
    # A pool as large as one sequence, or one the caller sized: no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LLMEngine(EngineConfig(tiny_checkpoint, device="cpu", cpu_kv_blocks=32))
        LLMEngine(EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=4))


def test_generate_validates_everything_before_running(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, device="cpu", max_model_len=32, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match="prompt 1: .*max_model_len"):
        llm.generate([[5, 6, 7], list(range(3, 40)), [8, 9]], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and llm.engine.num_free_blocks == 64
    out = llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)     # the engine still serves
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]


def test_string_prompt_without_tokenizer_is_a_clear_error(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=16)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("hello", use_tqdm=False)


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_malformed_checkpoints(tiny_checkpoint, tmp_path):
    tensors = load_file(os.path.join(tiny_checkpoint, "model.safetensors"))

    missing = copy_checkpoint(tiny_checkpoint, tmp_path / "missing")
    save_file({k: v for k, v in tensors.items() if "layers.1.mlp.up_proj" not in k}, missing / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        LLM(str(missing), device="cpu", num_kv_blocks=8)

    extra = copy_checkpoint(tiny_checkpoint, tmp_path / "extra")
    save_file(tensors | {"model.layers.0.mystery.weight": torch.zeros(3)}, extra / "model.safetensors")
    with pytest.raises(ValueError, match="mystery"):
        LLM(str(extra), device="cpu", num_kv_blocks=8)

    shape = copy_checkpoint(tiny_checkpoint, tmp_path / "shape")
    save_file(tensors | {"model.layers.0.self_attn.k_proj.weight": torch.zeros(5, 64)}, shape / "model.safetensors")
    with pytest.raises(ValueError, match=r"k_proj.weight.*shape"):
        LLM(str(shape), device="cpu", num_kv_blocks=8)

    garbage = copy_checkpoint(tiny_checkpoint, tmp_path / "garbage")
    (garbage / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(garbage), device="cpu", num_kv_blocks=8)

    llama = copy_checkpoint(tiny_checkpoint, tmp_path / "llama")
    config = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps(config | {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="architecture"):
        LLM(str(llama), device="cpu", num_kv_blocks=8)
    # A Qwen3 with a head this engine does not run: named by config.json, before any tensor is read.
    (llama / "config.json").write_text(json.dumps(config | {"architectures": ["Qwen3ForTokenClassification"]}))
    with pytest.raises(ValueError, match="unsupported architecture.*Qwen3ForTokenClassification"):
        LLM(str(llama), device="cpu", num_kv_blocks=8)

    scaled = copy_checkpoint(tiny_checkpoint, tmp_path / "scaled")
    (scaled / "config.json").write_text(json.dumps(config | {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}))
    with pytest.raises(ValueError, match="rope_scaling .* is not supported"):
        LLM(str(scaled), device="cpu", num_kv_blocks=8)

    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(tmp_path / "nowhere"), device="cpu")

    for name, change, match in [("rope_str", {"rope_scaling": "linear"}, "rope_scaling"),
                                ("kv_heads", {"num_key_value_heads": 3}, "num_key_value_heads")]:
        bad = copy_checkpoint(tiny_checkpoint, tmp_path / name)
        (bad / "config.json").write_text(json.dumps(config | change))
        with pytest.raises(ValueError, match=match):
            LLM(str(bad), device="cpu", num_kv_blocks=8)


def test_a_tied_checkpoints_lm_head_must_be_the_embedding(tiny_checkpoint, tmp_path):
    """tie_word_embeddings: lm_head is the embedding. A checkpoint may carry the tied copy too; a
    different matrix there is a contradiction, which transformers would resolve otherwise."""
    tensors = load_file(os.path.join(tiny_checkpoint, "model.safetensors"))
    embed = tensors["model.embed_tokens.weight"]
    same = copy_checkpoint(tiny_checkpoint, tmp_path / "same")
    save_file(tensors | {"lm_head.weight": embed.clone()}, same / "model.safetensors")
    LLM(str(same), device="cpu", num_kv_blocks=8)
    other = copy_checkpoint(tiny_checkpoint, tmp_path / "other")
    save_file(tensors | {"lm_head.weight": embed + 1}, other / "model.safetensors")
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        LLM(str(other), device="cpu", num_kv_blocks=8)


def test_a_sharded_checkpoint_loads_each_tensor_from_the_shard_its_index_names(tiny_checkpoint, tmp_path):
    """A stale shard's copy of a tensor (here a zeroed final norm) is not the one the index names:
    it must not override it. A tensor the index places in a shard that lacks it is an error."""
    tensors = load_file(os.path.join(tiny_checkpoint, "model.safetensors"))
    names = sorted(tensors)
    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_checkpoint, sharded, ignore=shutil.ignore_patterns("model.safetensors"))
    # The stale copy sits in the shard read last, where a loader that reads whole files keeps it.
    weight_map = {k: "ab"[i % 2] + ".safetensors" for i, k in enumerate(names)} | {"model.norm.weight": "a.safetensors"}
    shards = {f: {k: tensors[k] for k in names if weight_map[k] == f} for f in ("a.safetensors", "b.safetensors")}
    shards["b.safetensors"]["model.norm.weight"] = torch.zeros_like(tensors["model.norm.weight"])
    for f, shard in shards.items():
        save_file(shard, sharded / f)
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    prompts, params = [[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=8).generate(prompts, params, use_tqdm=False)
    got = LLM(str(sharded), device="cpu", num_kv_blocks=8).generate(prompts, params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    moved = {"model.embed_tokens.weight": "ab"[weight_map["model.embed_tokens.weight"] == "a.safetensors"]
             + ".safetensors"}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map | moved}))
    with pytest.raises(ValueError, match="does not hold"):
        LLM(str(sharded), device="cpu", num_kv_blocks=8)


def test_config_fields_left_out_take_transformers_defaults():
    """Qwen3Config's defaults: head_dim 128 and 32 KV heads when left out; given as null,
    hidden_size / heads and one KV head a query head."""
    from mini_engine.config import ModelConfig
    from mini_engine.model.random_checkpoint import QWEN3_0_6B
    raw = {k: v for k, v in QWEN3_0_6B.items() if k not in ("head_dim", "num_key_value_heads")}
    with pytest.raises(ValueError, match="num_key_value_heads=32"):        # 16 query heads
        ModelConfig.from_dict(raw)
    config = ModelConfig.from_dict(raw | {"num_attention_heads": 32})
    assert (config.head_dim, config.num_key_value_heads) == (128, 32)
    config = ModelConfig.from_dict(raw | {"head_dim": None, "num_key_value_heads": None})
    assert (config.head_dim, config.num_key_value_heads) == (1024 // 16, 16)
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen3Config(**(raw | {"num_attention_heads": 32}))
    assert (hf.head_dim, hf.num_key_value_heads) == (128, 32)


@pytest.mark.parametrize("dtype", ["float16", torch.float16, "torch.bfloat16", "half"])
def test_dtype_by_name_or_torch_dtype(tiny_checkpoint, dtype):
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=8, dtype=dtype)
    assert llm.engine.runner.dtype in (torch.float16, torch.bfloat16)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "int8", "fp32", torch.int32])
def test_bad_dtype_is_a_clear_error(tiny_checkpoint, dtype):
    with pytest.raises(ValueError, match="dtype"):
        LLM(tiny_checkpoint, device="cpu", num_kv_blocks=8, dtype=dtype)


def test_one_prompt_as_numpy_ids(tiny_checkpoint):
    import numpy as np
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    want = llm.generate([5, 6, 7, 8], params, use_tqdm=False)[0].outputs[0].token_ids
    for prompt in (np.arange(5, 9), list(np.arange(5, 9))):
        out = llm.generate(prompt, params, use_tqdm=False)
        assert len(out) == 1 and out[0].outputs[0].token_ids == want
    with pytest.raises(ValueError, match="bytes"):
        llm.generate([b"\x05\x06"], params, use_tqdm=False)


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_num_seqs=0), "max_num_seqs must be >= 1"),
    (dict(max_num_seqs=65536), "max_num_seqs must be <= 65535"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(max_model_len=10**6), "max_model_len"), (dict(cpu_kv_blocks=0), "cpu_kv_blocks"),
])
def test_bad_engine_config(tiny_checkpoint, kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(tiny_checkpoint, device="cpu", **kwargs)


@pytest.mark.parametrize("device,expected", [("cpu", 16), ("cuda", 64), ("cuda:0", 64)])
def test_default_block_size_by_device(tiny_checkpoint, device, expected):
    """No GPU needed: the default is resolved from the device's name, before any runner exists."""
    assert EngineConfig(tiny_checkpoint, device=device).block_size == expected
    assert EngineConfig(tiny_checkpoint, device=device, block_size=32).block_size == 32
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        EngineConfig(tiny_checkpoint, device=device, block_size=0)


def recorded_steps(engine) -> list:
    """Wraps engine.scheduler.schedule: the list it returns fills with each step's
    (request id, tokens) pairs."""
    steps, schedule = [], engine.scheduler.schedule

    def recording(**kwargs):
        batch = schedule(**kwargs)
        steps.append([(seq.request_id, n) for seq, n in zip(batch.seqs, batch.num_new_tokens)])
        return batch
    engine.scheduler.schedule = recording
    return steps


def test_a_bad_prompt_found_after_the_first_launch_costs_the_others_nothing(tiny_checkpoint):
    # generate adds only the first step's requests before launching it (here 2 prompts fill the
    # 16-token budget) and validates the rest while it runs: prompt 3 fails after the launch.
    llm = LLM(tiny_checkpoint, device="cpu", max_model_len=32, max_num_batched_tokens=16, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [list(range(5, 15)), list(range(20, 30)), [8, 9], list(range(3, 40)), [7]]
    steps = recorded_steps(llm.engine)
    with pytest.raises(ValueError, match="prompt 3: .*max_model_len"):
        llm.generate(prompts, params, use_tqdm=False)
    assert steps == [[("0", 10), ("1", 6)]]           # the first step ran, on the first two prompts
    assert not llm.engine.has_unfinished_requests() and llm.engine.num_free_blocks == 64
    good = prompts[:3] + prompts[4:]
    out = llm.generate(good, params, use_tqdm=False)
    fresh = LLM(tiny_checkpoint, device="cpu", max_model_len=32, max_num_batched_tokens=16, num_kv_blocks=64)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in fresh.generate(good, params, use_tqdm=False)]
    assert llm.engine.num_free_blocks == 64


def generate_and_add_first(checkpoint, kwargs, prompts, params) -> tuple[list, list, list]:
    """The steps LLM.generate schedules, those of a second engine given every request before its
    first step, and generate's outputs."""
    llm = LLM(checkpoint, **kwargs)
    steps = recorded_steps(llm.engine)
    out = llm.generate(prompts, params, use_tqdm=False)
    engine = LLM(checkpoint, **kwargs).engine
    expected = recorded_steps(engine)
    for prompt, p in zip(prompts, params):
        engine.add_request(prompt, p)
    while engine.has_unfinished_requests():
        engine.step()
    return steps, expected, out


@pytest.mark.parametrize("budget", [16, 25, 1000])
def test_generate_schedules_as_if_every_request_were_added_first(tiny_checkpoint, budget):
    kwargs = dict(device="cpu", max_model_len=64, max_num_batched_tokens=budget, max_num_seqs=4, num_kv_blocks=64)
    prompts = [list(range(3 + i, 10 + 2 * i)) for i in range(9)]
    params = [SamplingParams(temperature=0, max_tokens=1 + i % 3, ignore_eos=True) for i in range(9)]
    steps, expected, _ = generate_and_add_first(tiny_checkpoint, kwargs, prompts, params)
    assert steps == expected and len(steps) > 3


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prompts_sharing_a_prefix_are_scheduled_as_if_every_request_were_added_first(tiny_checkpoint,
                                                                                       prefix_caching):
    """Thirty prompts share three 16-token blocks: once the first is admitted, the others cost the
    budget two tokens each (their prefix is cached as the first is admitted, in the same step), so
    generate must have more of them waiting than their whole prompts' tokens would allow, both
    when it adds them (prompt_cost) and when it counts those still waiting (waiting_load)."""
    kwargs = dict(device="cpu", max_model_len=96, max_num_batched_tokens=64, max_num_seqs=8, num_kv_blocks=64,
                  enable_prefix_caching=prefix_caching)
    prompts = [list(range(5, 53)) + [60 + i, 100 + i] for i in range(30)]
    params = [SamplingParams(temperature=0, max_tokens=1 + i % 3, ignore_eos=True) for i in range(30)]
    steps, expected, out = generate_and_add_first(tiny_checkpoint, kwargs, prompts, params)
    assert steps == expected
    assert [len(o.outputs[0].token_ids) for o in out] == [1 + i % 3 for i in range(30)]
    if prefix_caching:
        assert len(steps[0]) == 8          # the first step admits max_num_seqs


def test_generate_adds_requests_as_the_scheduler_can_take_them(tiny_checkpoint):
    """Each step is scheduled with the requests it can admit waiting, not all of them: the host
    work of the rest waits until a launch is on the device. Here 40 prompts of 6 tokens and a
    16-token budget: 3 wait before the first step, and at every step at most a budget's worth
    (plus the one that crosses it) or max_num_seqs more than are running."""
    llm = LLM(tiny_checkpoint, device="cpu", max_model_len=32, max_num_batched_tokens=16, max_num_seqs=8,
              num_kv_blocks=128)
    engine, schedule, held = llm.engine, llm.engine.scheduler.schedule, []

    def recording(**kwargs):
        held.append((len(engine.requests), len(engine.scheduler.running)))
        return schedule(**kwargs)
    engine.scheduler.schedule = recording
    prompts = [list(range(3 + i, 9 + i)) for i in range(40)]
    out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [2] * 40
    assert held[0] == (3, 0)
    assert all(requests - running <= 3 for requests, running in held)
    assert max(requests for requests, _ in held) < 40 // 2


def test_a_step_that_fails_leaves_no_prefix_cache_behind(tiny_checkpoint):
    """Blocks are hashed into the prefix cache when their step is scheduled. A step that fails
    before its forward pass wrote no K and V into them: a later request with the same prompt must
    not take them as its cached prefix (it did, and generated other tokens)."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = list(range(10, 50))
    want = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=64, block_size=4).generate(
        [prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=64, block_size=4)
    launch, calls = llm.engine.runner.launch, []

    def failing_once(rows):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected: the step fails before its forward pass")
        return launch(rows)
    llm.engine.runner.launch = failing_once
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate([prompt], params, use_tqdm=False)
    assert llm.engine.num_free_blocks == 64 and not llm.engine.block_manager.cached_blocks
    assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == want
    assert llm.engine.prefix_cache_hit_tokens == 0


@pytest.mark.parametrize("max_model_len, num_blocks", [(512, 16), (100, 16), (257, 16)])
def test_the_longest_sequence_validate_allows_is_max_sequence_tokens(max_model_len, num_blocks):
    from mini_engine.engine.request_limits import RequestLimits
    limits = RequestLimits(vocab_size=256, max_model_len=max_model_len, block_size=16, num_blocks=num_blocks,
                           has_tokenizer=False)
    longest = limits.max_sequence_tokens()
    limits.validate([5] * 10, SamplingParams(max_tokens=longest - 10))
    with pytest.raises(ValueError, match="max_model_len|KV blocks"):
        limits.validate([5] * 10, SamplingParams(max_tokens=longest - 9))


def test_token_ids_outside_the_vocabulary_are_rejected(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=16)
    with pytest.raises(ValueError, match="prompt 0: logit_bias names token id 256, outside the vocabulary"):
        llm.generate([[1, 2, 3]], SamplingParams(logit_bias={256: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 0: stop_token_ids names token id 256, outside the vocabulary"):
        llm.generate([[1, 2, 3]], SamplingParams(stop_token_ids=[7, 256], min_tokens=2), use_tqdm=False)
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks
