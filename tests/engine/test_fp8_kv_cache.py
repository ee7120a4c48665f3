"""kv_cache_dtype "fp8" (e4m3) and "fp8_e5m2" end to end: greedy outputs equal transformers' when
its attention reads K and V rounded to fp8 as the cache stores them (tests/hf_reference.py),
whatever the scheduler does with the batch; the pool holds twice the tokens in the same bytes;
names it does not know fail."""
import pytest
import torch

from mini_engine import LLM, SamplingParams
from mini_engine.config import KV_CACHE_DTYPES, EngineConfig
from mini_engine.runner.model_runner import ModelRunner, resolve_kv_cache_dtype
from tests.engine.test_greedy_vs_transformers import MAX_TOKENS, generate, mixed_prompts, shared_prefix_prompts
from tests.hf_reference import hf_greedy, hf_logits


def fp8_expected(path, prompts, kv_cache_dtype):
    return [hf_greedy(path, p, MAX_TOKENS, kv_cache_dtype=kv_cache_dtype) for p in prompts]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("case", ["chunked", "preemption", "prefix_cache"])
def test_greedy_matches_transformers_reading_fp8(tiny_checkpoint, case, kv_cache_dtype):
    prompts = shared_prefix_prompts() if case == "prefix_cache" else mixed_prompts()
    kwargs = {"chunked": dict(num_kv_blocks=256, max_num_batched_tokens=7),
              # 16 blocks of 4 slots: the longest request alone needs 13
              "preemption": dict(num_kv_blocks=16, block_size=4, enable_prefix_caching=False),
              "prefix_cache": dict(num_kv_blocks=256, block_size=4, max_num_batched_tokens=40)}[case]
    got, engine = generate(tiny_checkpoint, prompts, kv_cache_dtype=kv_cache_dtype, **kwargs)
    assert engine.runner.kv_cache.dtype == KV_CACHE_DTYPES[kv_cache_dtype]
    assert got == fp8_expected(tiny_checkpoint, prompts, kv_cache_dtype)
    if case == "preemption":
        assert engine.num_preemptions > 0
    if case == "prefix_cache":
        assert engine.prefix_cache_hit_tokens > 0


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_logprobs_are_those_of_the_fp8_reference(tiny_checkpoint, kv_cache_dtype):
    """The tokens' log-probabilities through prefill and decode: the fp8 reference's, and further
    from a full-precision cache's than the tolerance (greedy tokens alone often agree with both)."""
    prompt = mixed_prompts()[6]
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    got = torch.tensor([lp.logprob for lp in out.logprobs])
    ids = torch.tensor(out.token_ids)[:, None]

    def reference(kv_cache_dtype):
        logits = hf_logits(tiny_checkpoint, prompt + out.token_ids, kv_cache_dtype)[len(prompt) - 1:-1]
        return logits.log_softmax(-1).gather(1, ids)[:, 0]
    torch.testing.assert_close(got, reference(kv_cache_dtype), atol=1e-4, rtol=1e-4)
    assert (got - reference("auto")).abs().max() > 1e-2


def test_fp8_pool_holds_twice_the_tokens(tiny_checkpoint):
    """Against a bf16 cache: half the bytes a token and half the pool's bytes for as many blocks.
    (On a GPU, where the pool is sized from memory, that makes twice the blocks: 17,611 against
    35,214 for the benchmark on the H200, results.jsonl's "session 50" lines.)"""
    runners = {name: ModelRunner(EngineConfig(tiny_checkpoint, device="cpu", dtype="bfloat16", num_kv_blocks=8,
                                              kv_cache_dtype=name)) for name in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")}
    assert runners["auto"].kv_cache.dtype == torch.bfloat16
    assert runners["fp8"].kv_bytes_per_token * 2 == runners["auto"].kv_bytes_per_token
    assert runners["fp8_e4m3"].kv_cache.dtype == torch.float8_e4m3fn
    assert runners["fp8_e5m2"].kv_cache.dtype == torch.float8_e5m2
    assert runners["fp8_e5m2"].kv_bytes_per_token == runners["fp8"].kv_bytes_per_token
    assert runners["fp8"].kv_cache.nbytes * 2 == runners["auto"].kv_cache.nbytes


def test_bfloat16_cache_under_an_fp32_model(tiny_checkpoint):
    """vLLM's "bfloat16": the cache in bf16 whatever the model's dtype. An fp32 model then reads
    K and V rounded to bf16: its logprobs close to transformers' fp32, not equal to them."""
    prompt = mixed_prompts()[6]
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=64, kv_cache_dtype="bfloat16")
    assert llm.engine.runner.kv_cache.dtype == torch.bfloat16 and llm.engine.runner.dtype == torch.float32
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    got = torch.tensor([lp.logprob for lp in out.logprobs])
    logits = hf_logits(tiny_checkpoint, prompt + out.token_ids)[len(prompt) - 1:-1]
    expected = logits.log_softmax(-1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(got, expected, atol=5e-2, rtol=0)
    assert (got - expected).abs().max() > 1e-5


@pytest.mark.parametrize("name", ["fp8_inc", "int8", "float16", ""])
def test_unknown_kv_cache_dtype_is_refused(tiny_checkpoint, name):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(tiny_checkpoint, device="cpu", kv_cache_dtype=name)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_kernels_need_compute_capability_8_9(tiny_checkpoint, monkeypatch, kv_cache_dtype):
    """Triton has no fp8 conversions before Ada/Hopper: an older GPU is told at start-up, and may
    still run an fp8 cache on the PyTorch path."""
    config = EngineConfig(tiny_checkpoint, device="cpu", kv_cache_dtype=kv_cache_dtype)
    fp8 = KV_CACHE_DTYPES[kv_cache_dtype]
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="compute capability 8.9"):
        resolve_kv_cache_dtype(config, cuda, torch.bfloat16, frozenset({"attention", "sampler"}))
    assert resolve_kv_cache_dtype(config, cuda, torch.bfloat16, frozenset({"sampler"})) == fp8
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_kv_cache_dtype(config, cuda, torch.bfloat16, frozenset({"attention"})) == fp8
