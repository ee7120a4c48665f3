"""LoRA adapters (enable_lora, LoRARequest) against PEFT's own PeftModel over transformers' Qwen3,
reading the same adapter files that PEFT wrote: logits in fp32, and greedy tokens through the
scheduler's paths with adapters and the base model mixed in one batch."""
import json
import os
import random

import pytest
import torch

from mini_engine import LLM, LoRARequest, SamplingParams
from mini_engine.config import EngineConfig
from mini_engine.engine.block_manager import BlockManager
from mini_engine.engine.scheduler import Scheduler
from mini_engine.engine.sequence import Sequence
from mini_engine.runner.batch import BatchRow
from mini_engine.runner.model_runner import ModelRunner
from tests.engine.test_greedy_vs_transformers import mixed_prompts, shared_prefix_prompts
from tests.lora_reference import peft_greedy, peft_logits, write_adapter

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(checkpoint_factory, tmp_path_factory):
    """base name -> (base path, [three adapters' LoRARequests]): every projection at r=4; q/v/down at
    r=2, with PEFT's rank_pattern and alpha_pattern for down and v; q/o/up under rsLoRA at r=8. A
    Qwen3-MoE checkpoint's adapters take the attention's projections alone."""
    made = {}

    def make(name: str):
        if name not in made:
            base = checkpoint_factory(name)
            root = tmp_path_factory.mktemp(f"lora-{name}")
            moe = name.startswith("moe")
            targets = [rf".*(self_attn\.({attn})|mlp\.({'x' if moe else mlp}))_proj"
                       for attn, mlp in (("q|k|v|o", "gate|up|down"), ("q|v", "down"), ("q|o", "up"))]
            folders = [write_adapter(base, str(root / "all"), 1, targets[0]),
                       write_adapter(base, str(root / "qvd"), 2, targets[1], r=2, alpha=16,
                                     rank_pattern={"down_proj": 6}, alpha_pattern={"v_proj": 3}),
                       write_adapter(base, str(root / "rs"), 3, targets[2], r=8, alpha=4, use_rslora=True)]
            made[name] = base, [LoRARequest(os.path.basename(f), i + 1, f) for i, f in enumerate(folders)]
        return made[name]
    return make


def run(base: str, prompts, loras, **options) -> tuple[list[list[int]], LLM]:
    llm = LLM(base, device="cpu", enable_lora=True, **options)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks, "KV blocks leaked"
    return [o.outputs[0].token_ids for o in outputs], llm


def expected(base: str, prompts, loras) -> list[list[int]]:
    return [peft_greedy(base, None if lora is None else lora.lora_path, p, MAX_TOKENS) for p, lora in zip(prompts, loras)]


def cycle(loras: list, n: int) -> list:
    """n requests' adapters: the base model, then each adapter, in turn."""
    choices = [None, *loras]
    return [choices[i % len(choices)] for i in range(n)]


@pytest.mark.parametrize("name", ["tied-gqa2", "untied-bias-gqa4", "moe-mixed"])
def test_logits_match_peft(adapters, name):
    """One flat batch, each prompt with another adapter (or none), against PeftModel's logits. The
    bias config's norms are not folded (its LoRA reads the normed input); moe-mixed's sparse layers
    take the attention's pairs only, its dense layer the MLP's too."""
    base, loras = adapters(name)
    runner = ModelRunner(EngineConfig(base, device="cpu", num_kv_blocks=64, block_size=4, enable_lora=True,
                                      max_loras=3))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (1, 6, 17, 9)]
    choices = [loras[0], None, loras[1], loras[2]]
    rows, next_block = [], 0
    for prompt, lora in zip(prompts, choices):
        blocks = list(range(next_block, next_block + -(-len(prompt) // 4)))
        next_block += len(blocks)
        rows.append(BatchRow(prompt, 0, blocks, True, GREEDY, lora_request=lora))
    with torch.inference_mode():
        t, meta = runner.prepare_inputs(rows)
        logits = runner.model.compute_logits(runner.model(t.input_ids, t.positions, meta, t.lora_slots)).float()
    start = 0
    for prompt, lora in zip(prompts, choices):
        got = logits[start:start + len(prompt)]
        start += len(prompt)
        want = peft_logits(base, None if lora is None else lora.lora_path, prompt)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        if lora is not None:     # the adapter matters: else a model that ignored it would pass
            assert (want - peft_logits(base, None, prompt)).abs().max() > 0.1


def test_greedy_mixed_batch_matches_peft(adapters):
    base, loras = adapters("tied-gqa2")
    prompts = mixed_prompts()
    choices = cycle(loras, len(prompts))
    got, llm = run(base, prompts, choices, num_kv_blocks=256, max_loras=3)
    assert got == expected(base, prompts, choices)
    assert llm.engine.runner.lora.num_loads == 3


@pytest.mark.parametrize("options", [
    dict(num_kv_blocks=256, max_num_batched_tokens=7, max_loras=2),          # chunked prefill beside decodes
    dict(num_kv_blocks=16, block_size=4, enable_prefix_caching=False, max_loras=3),     # preemption
    dict(num_kv_blocks=256, max_loras=1, max_cpu_loras=1, async_scheduling=False),      # one adapter at a time
])
def test_greedy_through_the_scheduler_matches_peft(adapters, options):
    base, loras = adapters("untied-bias-gqa4")
    prompts = mixed_prompts()
    choices = cycle(loras, len(prompts))
    got, llm = run(base, prompts, choices, **options)
    assert got == expected(base, prompts, choices)
    if options.get("enable_prefix_caching") is False:
        assert llm.engine.num_preemptions > 0
    if options["max_loras"] == 1:
        # Three adapters through one slot, and one adapter read at a time: reloaded from disk.
        assert llm.engine.runner.lora.num_loads >= 3
        assert len(llm.engine.runner.lora.cache.adapters) == 1


def test_a_step_never_mixes_more_adapters_than_max_loras(adapters, monkeypatch):
    base, loras = adapters("tied-gqa2")
    seen = []
    slots = __import__("mini_engine.runner.lora_adapters", fromlist=["LoRAAdapters"]).LoRAAdapters.slots

    def recording(self, rows):
        seen.append({r.lora_request.lora_int_id for r in rows if r.lora_request is not None})
        return slots(self, rows)
    monkeypatch.setattr("mini_engine.runner.lora_adapters.LoRAAdapters.slots", recording)
    prompts = mixed_prompts()
    choices = cycle(loras, len(prompts))
    got, _ = run(base, prompts, choices, num_kv_blocks=256, max_loras=2)
    assert got == expected(base, prompts, choices)
    assert max(len(s) for s in seen) == 2


def test_prefix_cache_is_per_adapter(adapters):
    """The same prompts under two adapters and the base: each adapter's own K and V, so its own
    tokens; a prompt sharing a prefix with one before it under the same adapter hits the cache."""
    base, loras = adapters("tied-gqa2")
    prompts = shared_prefix_prompts()[:3] * 3
    choices = [None] * 3 + [loras[0]] * 3 + [loras[1]] * 3
    got, llm = run(base, prompts, choices, num_kv_blocks=256, block_size=4, max_loras=2, max_num_batched_tokens=40)
    assert got == expected(base, prompts, choices)
    assert llm.engine.prefix_cache_hit_tokens > 0
    assert got[0] != got[3] and got[3] != got[6]


def test_prefix_cache_keys_carry_the_adapter():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(3, 12))
    first = Sequence("a", tokens, GREEDY, lora_request=LoRARequest("x", 1, "/x"))
    assert bm.allocate_slots(first, len(tokens))
    assert bm.find_cached_prefix(Sequence("b", tokens, GREEDY, lora_request=LoRARequest("x", 1, "/x")))
    assert not bm.find_cached_prefix(Sequence("c", tokens, GREEDY))
    assert not bm.find_cached_prefix(Sequence("d", tokens, GREEDY, lora_request=LoRARequest("y", 2, "/y")))
    assert bm.prompt_cost(tokens, set(), first.cache_root) == 1
    assert bm.prompt_cost(tokens, set()) == len(tokens)


def test_scheduler_holds_back_an_adapter_past_max_loras():
    bm = BlockManager(num_blocks=64, block_size=4)
    scheduler = Scheduler(8, 64, bm, 64, max_loras=1)
    x, y = LoRARequest("x", 1, "/x"), LoRARequest("y", 2, "/y")
    seqs = [Sequence(str(i), [5, 6, 7], GREEDY, lora_request=lora) for i, lora in enumerate([x, y, None, x])]
    for seq in seqs:
        scheduler.add(seq)
    out = scheduler.schedule()
    assert [s.request_id for s in out.seqs] == ["0", "2", "3"]       # y waits, those behind it go first
    assert [s.request_id for s in scheduler.waiting] == ["1"]
    for seq in list(scheduler.running):
        if seq.lora_request is not None:
            scheduler.finish(seq, "stop")
    assert [s.request_id for s in scheduler.schedule().seqs] == ["2", "1"]


def test_speculative_decoding_with_an_adapter(adapters):
    base, loras = adapters("tied-gqa2")
    prompts = [p * 3 for p in mixed_prompts(lengths=(4, 6, 5))]       # repeats: the proposer finds drafts
    choices = [loras[0], None, loras[1]]
    got, llm = run(base, prompts, choices, num_kv_blocks=256, max_loras=2,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                       "prompt_lookup_min": 1})
    assert got == expected(base, prompts, choices)
    assert llm.engine.spec_decode_stats.num_draft_tokens > 0


def test_a_draft_model_beside_adapters(adapters):
    """A draft model runs without adapters: where a request's adapter changes the target, its
    drafts are rejected more often, and the outputs are still the adapted model's (PEFT's)."""
    base, loras = adapters("tied-gqa2")
    prompts = mixed_prompts(lengths=(4, 6, 5))
    choices = [loras[0], None, loras[1]]
    got, llm = run(base, prompts, choices, num_kv_blocks=256, max_loras=2,
                   speculative_config={"model": base, "num_speculative_tokens": 3})
    assert got == expected(base, prompts, choices)
    assert llm.engine.spec_decode_stats.num_accepted_tokens > 0


def test_tensor_parallel_with_adapters(adapters):
    """Two ranks (gloo): q/k/v and gate/up take their rows of B, o and down their columns of A."""
    base, loras = adapters("untied-bias-gqa4")
    prompts = mixed_prompts()[:5]
    choices = cycle(loras, len(prompts))
    llm = LLM(base, device="cpu", tensor_parallel_size=2, enable_lora=True, max_loras=3, num_kv_blocks=64)
    try:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=choices)
        assert [o.outputs[0].token_ids for o in outputs] == expected(base, prompts, choices)
    finally:
        llm.shutdown()


# ---- bad input: a clear error, and nothing lost ----

def rewrite(folder: str, out, config_change=None, tensors_change=None) -> str:
    from safetensors.torch import load_file, save_file
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(folder, "adapter_config.json")) as f:
        config = json.load(f)
    tensors = load_file(os.path.join(folder, "adapter_model.safetensors"))
    if config_change:
        config_change(config)
    if tensors_change:
        tensors_change(tensors)
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"))
    return str(out)


def test_bad_adapters_are_clear_errors_and_lose_nothing(adapters, checkpoint_factory, tmp_path):
    base, loras = adapters("tied-gqa2")
    good = loras[0].lora_path
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    cases = [
        (str(tmp_path / "missing"), "is not a folder"),
        (str(tmp_path), "no adapter_config.json"),
        (rewrite(good, tmp_path / "rank", lambda c: c.update(r=32)), "fit the model's projection"),
        (rewrite(good, tmp_path / "dora", lambda c: c.update(use_dora=True)), "DoRA is not supported"),
        (rewrite(good, tmp_path / "save", lambda c: c.update(modules_to_save=["lm_head"])), "modules_to_save"),
        (rewrite(good, tmp_path / "bias", lambda c: c.update(bias="all")), "bias 'all' is not supported"),
        (rewrite(good, tmp_path / "half", None, lambda t: t.pop(q_a)), "without its other half"),
        (rewrite(good, tmp_path / "shape", None, lambda t: t.update({q_a: t[q_a][:, :8].contiguous()})), "do not fit"),
        (rewrite(good, tmp_path / "nan", None, lambda t: t[q_a].fill_(float("nan"))), "not finite"),
        (rewrite(good, tmp_path / "head", None,
                 lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)})),
         "cannot apply LoRA to"),
        (write_adapter(checkpoint_factory("untied-mha"), str(tmp_path / "other"), 5), "do not fit"),
    ]
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    (tmp_path / "torn" / "adapter_model.safetensors").write_bytes(b"\x10\x00garbage")
    cases.append((str(tmp_path / "torn"), "not a readable safetensors file"))
    llm = LLM(base, device="cpu", enable_lora=True, max_lora_rank=8, num_kv_blocks=64)
    for i, (folder, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message):
            llm.generate([[5, 6, 7], [8, 9]], GREEDY, use_tqdm=False,
                         lora_request=[None, LoRARequest(f"bad{i}", 10 + i, folder)])
    with pytest.raises(ValueError, match="max_lora_rank=2"):
        LLM(base, device="cpu", enable_lora=True, max_lora_rank=2, num_kv_blocks=64).generate(
            [5, 6], GREEDY, use_tqdm=False, lora_request=loras[0])
    with pytest.raises(ValueError, match="lora_int_id 1 is adapter 'all'"):
        llm.generate([[5, 6, 7]] * 2, GREEDY, use_tqdm=False,
                     lora_request=[loras[0], LoRARequest("another", 1, loras[1].lora_path)])
    # The engine is as it was: the good requests run, and every block is free.
    prompts = mixed_prompts()[:3]
    choices = [loras[0], None, loras[0]]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=choices)
    assert [o.outputs[0].token_ids for o in outputs] == expected(base, prompts, choices)
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks


def test_requests_and_options_are_checked(adapters):
    base, loras = adapters("tied-gqa2")
    with pytest.raises(ValueError, match="enable_lora=True"):
        LLM(base, device="cpu", num_kv_blocks=16).generate([5, 6], GREEDY, use_tqdm=False, lora_request=loras[0])
    for options, message in [(dict(max_loras=0), "max_loras must be"), (dict(max_lora_rank=0), "max_lora_rank must"),
                             (dict(max_loras=2, max_cpu_loras=1), "max_cpu_loras must be")]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(base, device="cpu", enable_lora=True, **options)
    for args, message in [(("", 1, "/x"), "lora_name"), (("x", 0, "/x"), "lora_int_id"), (("x", True, "/x"), "lora_int_id"),
                          (("x", 1, None), "lora_path")]:
        with pytest.raises(ValueError, match=message):
            LoRARequest(*args)
    llm = LLM(base, device="cpu", enable_lora=True, num_kv_blocks=16)
    with pytest.raises(ValueError, match="2 prompts but 1 LoRA requests"):
        llm.generate([[5, 6], [7, 8]], GREEDY, use_tqdm=False, lora_request=[loras[0]])


def test_random_adapter_is_what_peft_reads(adapters, tmp_path):
    """write_random_adapter (bench.py's, and the GPU checks') writes the files PEFT writes: PEFT's
    own model reads them to the same tokens as the engine."""
    from mini_engine.lora import write_random_adapter
    base, _ = adapters("tied-gqa2")
    folder = write_random_adapter(str(tmp_path / "random"), EngineConfig(base, device="cpu").model_config, rank=3,
                                  seed=0, dtype=torch.float32, std=0.3)
    lora = LoRARequest("random", 1, folder)
    prompts = mixed_prompts()[:3]
    got, _ = run(base, prompts, [lora] * 3, num_kv_blocks=64)
    assert got == expected(base, prompts, [lora] * 3)
    assert got != expected(base, prompts, [None] * 3)


def test_chat_with_an_adapter(tokenized_model, tmp_path):
    """LLM.chat takes lora_request as generate does (vLLM's): the rendered prompt's tokens, with the adapter."""
    from mini_engine.lora import write_random_adapter
    folder = write_random_adapter(str(tmp_path / "a"), EngineConfig(tokenized_model, device="cpu").model_config,
                                  rank=4, seed=0, dtype=torch.float32, std=0.3)
    lora = LoRARequest("a", 1, folder)
    llm = LLM(tokenized_model, device="cpu", enable_lora=True, num_kv_blocks=64)
    chat = llm.chat([{"role": "user", "content": "Hi there"}], GREEDY, use_tqdm=False, lora_request=lora)[0]
    plain = llm.generate(chat.prompt_token_ids, GREEDY, use_tqdm=False, lora_request=lora)[0]
    base = llm.chat([{"role": "user", "content": "Hi there"}], GREEDY, use_tqdm=False)[0]
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids != base.outputs[0].token_ids
