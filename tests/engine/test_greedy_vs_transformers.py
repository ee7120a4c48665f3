"""End to end: greedy outputs identical, token for token, to transformers' greedy generate,
whatever the scheduler does with the batch."""
import os
import random

import pytest

from mini_engine import LLM, SamplingParams
from tests.conftest import TINY_CONFIGS
from tests.hf_reference import hf_greedy

MAX_TOKENS = 12


def mixed_prompts(seed: int = 0, lengths=(3, 9, 16, 17, 31, 1, 40, 24)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]


def shared_prefix_prompts() -> list[list[int]]:
    rng = random.Random(7)
    prefix = [rng.randrange(3, 256) for _ in range(37)]
    return [prefix + [rng.randrange(3, 256) for _ in range(k)] for k in (0, 1, 5, 12, 3, 20)]


def generate(path: str, prompts, max_tokens=MAX_TOKENS, **engine_kwargs):
    llm = LLM(path, device="cpu", **engine_kwargs)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.engine
    assert engine.num_free_blocks == engine.block_manager.num_blocks, "KV blocks leaked"
    return [o.outputs[0].token_ids for o in outputs], engine


def expected(path, prompts, max_tokens=MAX_TOKENS):
    return [hf_greedy(path, p, max_tokens) for p in prompts]


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_default_config(checkpoint_factory, name):
    path = checkpoint_factory(name)
    prompts = mixed_prompts()
    got, _ = generate(path, prompts, num_kv_blocks=256)
    assert got == expected(path, prompts)
    assert len({tuple(g) for g in got}) > 1, "degenerate model: every prompt gives the same output"


def test_chunked_prefill_mixed_with_decode(tiny_checkpoint, monkeypatch):
    prompts = mixed_prompts()
    mixed_steps = []
    llm_step = __import__("mini_engine.engine.engine", fromlist=["LLMEngine"]).LLMEngine.step

    def recording_step(self):
        out = llm_step(self)
        mixed_steps.append(self.last_step_prefill_tokens > 0 and self.last_step_decode_tokens > 0)
        return out
    monkeypatch.setattr("mini_engine.engine.engine.LLMEngine.step", recording_step)
    got, _ = generate(tiny_checkpoint, prompts, num_kv_blocks=256, max_num_batched_tokens=7)
    assert got == expected(tiny_checkpoint, prompts)
    assert any(mixed_steps), "no step mixed a prefill chunk with decodes"


def test_preemption(tiny_checkpoint):
    prompts = mixed_prompts()
    # 16 blocks of 4 slots: the longest request alone needs 13, so they cannot all run at once.
    got, engine = generate(tiny_checkpoint, prompts, num_kv_blocks=16, block_size=4, enable_prefix_caching=False)
    assert engine.num_preemptions > 0
    assert got == expected(tiny_checkpoint, prompts)


def test_prefix_cache_hits(tiny_checkpoint):
    prompts = shared_prefix_prompts()
    got, engine = generate(tiny_checkpoint, prompts, num_kv_blocks=256, block_size=4, max_num_batched_tokens=40)
    assert engine.prefix_cache_hit_tokens > 0
    assert got == expected(tiny_checkpoint, prompts)


def test_preempted_sequence_hits_prefix_cache(tiny_checkpoint):
    prompts = shared_prefix_prompts()
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=20, block_size=4, max_num_seqs=6)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.engine
    assert engine.num_preemptions > 0
    # num_cached_tokens is counted at a request's last admission: for a preempted one, its return.
    assert any(o.num_cached_tokens > 0 for o in outputs if o.num_preemptions > 0), \
        "no preempted sequence found its blocks in the prefix cache"
    assert [o.outputs[0].token_ids for o in outputs] == expected(tiny_checkpoint, prompts, 20)
    assert engine.num_free_blocks == engine.block_manager.num_blocks


def test_one_sequence_at_a_time(tiny_checkpoint):
    prompts = mixed_prompts()[:4]
    got, _ = generate(tiny_checkpoint, prompts, num_kv_blocks=256, max_num_seqs=1)
    assert got == expected(tiny_checkpoint, prompts)


@pytest.mark.parametrize("block_size", [1, 64])
def test_block_sizes(tiny_checkpoint, block_size):
    prompts = mixed_prompts()
    got, _ = generate(tiny_checkpoint, prompts, num_kv_blocks=4096 // block_size, block_size=block_size)
    assert got == expected(tiny_checkpoint, prompts)


def test_stale_cache_contents_never_leak_in(tiny_checkpoint):
    """Attention reads whole blocks; whatever sits past a sequence's end (here NaN, as in
    uninitialised memory) must not reach the output."""
    prompts = mixed_prompts()
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=256, block_size=8)
    llm.engine.runner.kv_cache.fill_(float("nan"))
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                           use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected(tiny_checkpoint, prompts)


def test_without_async_scheduling(tiny_checkpoint):
    """Each step waits for its own tokens: the simple loop must give the same tokens."""
    prompts = mixed_prompts()
    got, engine = generate(tiny_checkpoint, prompts, num_kv_blocks=16, block_size=4, async_scheduling=False)
    assert engine.num_preemptions > 0
    assert got == expected(tiny_checkpoint, prompts)


# Padding tokens belong to no sequence, so attention leaves their output rows as allocated (as vLLM
# does), and the products and SwiGLU carry whatever those rows held: values no real row reads, which
# the interpreter's numpy reports when they overflow (entry 39 of benchmarks/NOTES.md).
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("max_num_seqs", [256, 2])
def test_every_triton_kernel(tiny_checkpoint, monkeypatch, max_num_seqs):
    """The whole model on the Triton kernels (through the interpreter on CPU): attention on the
    decode and the varlen prefill paths, norms, rotary + KV write, SwiGLU, the sampler and the
    skinny projections, inside the scheduler's mixed batches. This engine runs on CPU tensors, which
    Triton takes only through its interpreter, and the interpreter is on only where there is no
    GPU (conftest.py): on a GPU the same path is benchmarks/gpu_correctness.py's job.

    One request samples (temperature 0.8, seeded), so that every step takes the Triton sampler,
    greedy rows included (an all-greedy batch is a plain argmax): the greedy rows must still equal
    transformers', and the sampled one its own run alone.

    With max_num_seqs=2 every step of more than 2 tokens is padded to 64 (ModelRunner.
    padded_token_count): tokens that belong to no sequence and write no KV."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter (CPU-only machines); on a GPU run benchmarks/gpu_correctness.py")
    import mini_engine.kernels.linear as linear_kernels
    from mini_engine.kernels import KERNEL_NAMES
    skinny_calls = []
    skinny = linear_kernels.skinny_linear
    monkeypatch.setattr(linear_kernels, "skinny_linear", lambda *a: skinny_calls.append(1) or skinny(*a))
    import mini_engine.runner.model_runner as model_runner
    padded = []
    pad = model_runner.padded_token_count
    monkeypatch.setattr(model_runner, "padded_token_count", lambda n, s: padded.append(pad(n, s) - n) or pad(n, s))
    from mini_engine.kernels import sampling
    sample_calls = []
    sample = sampling.sample
    monkeypatch.setattr(sampling, "sample", lambda *a, **k: sample_calls.append(1) or sample(*a, **k))
    # Two greedy prompts at max_num_seqs=2 (their 3 and 9 tokens, prefilled together, are padded to
    # 64): the interpreter's padded steps are slow, and five took 98 s on a CI-sized machine where two take 55.
    prompts = mixed_prompts()[:5 if max_num_seqs > 2 else 2]
    sampled_prompt = mixed_prompts(seed=1, lengths=(6,))[0]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=256, max_num_batched_tokens=16,
              max_num_seqs=max_num_seqs, kernels=",".join(KERNEL_NAMES))
    outputs = llm.generate(prompts + [sampled_prompt], [greedy] * len(prompts) + [seeded], use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outputs]
    assert llm.engine.runner.kernels == frozenset(KERNEL_NAMES)
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks, "KV blocks leaked"
    assert skinny_calls, "no projection took the skinny kernel"
    assert sample_calls, "no step took the Triton sampler"
    assert any(padded) == (max_num_seqs == 2), padded
    assert got[:-1] == expected(tiny_checkpoint, prompts)
    alone = llm.generate([sampled_prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert got[-1] == alone and got[-1] != expected(tiny_checkpoint, [sampled_prompt])[0]
