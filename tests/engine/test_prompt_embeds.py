"""Prompts given as their embeddings (enable_prompt_embeds, {"prompt_embeds": tensor}): greedy
outputs equal transformers' generate from the same inputs_embeds, and a prompt's own embedding
rows give its token prompt's outputs, through chunked prefill, preemption and batches that mix both
kinds; the prefix cache shares blocks only between equal embeddings, never with the placeholder
ids; what would read the placeholders as tokens is refused by name."""
import pytest
import torch

from mini_engine import LLM, SamplingParams
from tests.hf_reference import hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


def engine(path: str, **kwargs) -> LLM:
    return LLM(path, device="cpu", enable_prompt_embeds=True, **({"num_kv_blocks": 256} | kwargs))


def random_embeds(n: int, hidden: int, seed: int) -> torch.Tensor:
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed)) * 0.5


def table_rows(llm: LLM, ids: list[int]) -> torch.Tensor:
    return llm.engine.runner.model.embed_tokens.weight[ids].detach().clone()


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_all_blocks_free(llm: LLM) -> None:
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks


def test_greedy_outputs_equal_transformers_from_the_same_embeddings(tiny_checkpoint):
    llm = engine(tiny_checkpoint)
    hidden = llm.engine.config.model_config.hidden_size
    prompts = [random_embeds(n, hidden, seed) for seed, n in enumerate((1, 7, 23, 40))]
    got = tokens(llm.generate([{"prompt_embeds": e} for e in prompts], GREEDY, use_tqdm=False))
    model = hf_model(tiny_checkpoint)
    for embeds, out in zip(prompts, got):
        want = model.generate(inputs_embeds=embeds[None], attention_mask=torch.ones(1, len(embeds), dtype=torch.long),
                              max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out == want[0].tolist()          # (given inputs_embeds, generate returns the new tokens alone)
    assert len({tuple(o) for o in got}) > 1, "degenerate outputs prove nothing"
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("kwargs", [{}, {"max_num_batched_tokens": 8}, {"num_kv_blocks": 24, "block_size": 4},
                                    {"max_num_batched_tokens": 8, "num_kv_blocks": 24, "block_size": 4}],
                         ids=["plain", "chunked", "preempting", "chunked-preempting"])
def test_a_prompts_own_embedding_rows_give_its_outputs(tiny_checkpoint, kwargs):
    """Each prompt given twice, as ids and as its embedding table's rows, in one batch: the same
    outputs, however the steps cut the prompts and whichever requests are preempted."""
    llm = engine(tiny_checkpoint, **kwargs)
    prompt_ids = [[5 + i % 90 for i in range(n)] for n in (3, 17, 30, 1)]
    mixed = [p for ids in prompt_ids for p in (ids, {"prompt_embeds": table_rows(llm, ids)})]
    outputs = llm.generate(mixed, LONG, use_tqdm=False)
    got = tokens(outputs)
    assert got[0::2] == got[1::2]
    assert all(o.prompt_token_ids is None and o.prompt is None for o in outputs[1::2])
    if "num_kv_blocks" in kwargs:
        assert llm.engine.num_preemptions > 0
    assert_all_blocks_free(llm)


def test_the_prefix_cache_shares_blocks_only_between_equal_embeddings(tiny_checkpoint):
    """Each block's key holds its rows' digest beside its placeholder ids (as vLLM's): an equal
    prompt, or one with the same start, shares those blocks; a change in a block's rows makes it and
    every block after it the prompt's own."""
    llm = engine(tiny_checkpoint)
    hidden, bs = llm.engine.config.model_config.hidden_size, llm.engine.config.block_size
    embeds = random_embeds(40, hidden, 3)
    first = llm.generate({"prompt_embeds": embeds}, GREEDY, use_tqdm=False)[0]
    again = llm.generate({"prompt_embeds": embeds.clone()}, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 2 * bs and again.outputs[0].token_ids == first.outputs[0].token_ids
    for row, shared in ((0, 0), (bs + 3, bs)):      # a change in the first block; in the second
        other = embeds.clone()
        other[row, 0] += 1.0
        out = llm.generate({"prompt_embeds": other}, GREEDY, use_tqdm=False)[0]
        assert out.num_cached_tokens == shared
        assert out.outputs[0].token_ids == tokens(engine(tiny_checkpoint).generate({"prompt_embeds": other}, GREEDY,
                                                                                  use_tqdm=False))[0]
    # The placeholder ids, as a token prompt, are not the embeddings' prompt.
    placeholders = llm.generate([[0] * 40], GREEDY, use_tqdm=False)[0]
    assert placeholders.num_cached_tokens == 0
    assert placeholders.outputs[0].token_ids == tokens(engine(tiny_checkpoint).generate([[0] * 40], GREEDY,
                                                                                       use_tqdm=False))[0]
    assert_all_blocks_free(llm)


def test_truncate_prompt_tokens_keeps_the_last_embeddings(tiny_checkpoint):
    llm = engine(tiny_checkpoint)
    embeds = random_embeds(20, llm.engine.config.model_config.hidden_size, 5)
    cut = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, truncate_prompt_tokens=6)
    assert (tokens(llm.generate({"prompt_embeds": embeds}, cut, use_tqdm=False))
            == tokens(llm.generate({"prompt_embeds": embeds[-6:]}, GREEDY, use_tqdm=False)))


def test_no_drafts_for_a_prompt_given_as_embeddings(tiny_checkpoint):
    """Speculative decoding's proposers read a prompt's tokens, which here are placeholders: such a
    request runs without drafts (a repeating token prompt beside it still drafts)."""
    llm = engine(tiny_checkpoint, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                      "prompt_lookup_min": 2, "prompt_lookup_max": 3})
    ids = [7, 8, 9, 10] * 6
    embeds_out = tokens(llm.generate({"prompt_embeds": table_rows(llm, ids)}, GREEDY, use_tqdm=False))
    assert llm.engine.spec_decode_stats.num_draft_tokens == 0
    assert embeds_out == tokens(llm.generate([ids], GREEDY, use_tqdm=False))


@pytest.mark.parametrize("prompt, params, match", [
    (torch.zeros(4, 7), GREEDY, "hidden_size"),
    (torch.zeros(0, 64), GREEDY, "num_tokens >= 1"),
    (torch.zeros(4, 64, dtype=torch.long), GREEDY, "dense tensor of"),
    (torch.zeros(4, 64).to(torch.float8_e4m3fn), GREEDY, "dense tensor of"),
    (torch.zeros(4, 64).to_sparse(), GREEDY, "dense tensor of"),
    (torch.full((4, 64), float("nan")), GREEDY, "not finite"),
    (torch.zeros(4, 64), SamplingParams(max_tokens=3, prompt_logprobs=1), "prompt_logprobs"),
    (torch.zeros(4, 64), SamplingParams(max_tokens=3, repetition_penalty=1.2), "repetition_penalty"),
    (torch.zeros(100, 64), GREEDY, "max_model_len"),
], ids=["hidden-size", "empty", "integers", "fp8", "sparse", "nan", "prompt-logprobs", "repetition-penalty", "too-long"])
def test_bad_prompt_embeds_are_refused_by_name(tiny_checkpoint, prompt, params, match):
    llm = engine(tiny_checkpoint, max_model_len=64)
    assert llm.engine.config.model_config.hidden_size == 64
    with pytest.raises(ValueError, match=match):
        llm.generate([[5, 6], {"prompt_embeds": prompt}], params, use_tqdm=False)
    assert_all_blocks_free(llm)
    assert not llm.engine.has_unfinished_requests()


def test_prompt_embeds_need_the_option_and_generate(tiny_checkpoint):
    plain = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=64)
    with pytest.raises(ValueError, match="enable_prompt_embeds"):
        plain.generate({"prompt_embeds": torch.zeros(3, 64)}, GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match="torch.Tensor"):
        engine(tiny_checkpoint).generate({"prompt_embeds": [[0.0] * 64]}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="LLM.generate alone"):
        engine(tiny_checkpoint).beam_search([{"prompt_embeds": torch.zeros(3, 64)}], __import__(
            "mini_engine").BeamSearchParams(beam_width=2, max_tokens=3))


def test_a_tensor_parallel_engine_takes_prompt_embeds(tiny_checkpoint):
    """The rows carry their embeddings to the other ranks, which write them over the same
    placeholders (after the embedding's all-reduce): the outputs of one rank's engine."""
    one = engine(tiny_checkpoint)
    ids = [[5 + i % 90 for i in range(n)] for n in (3, 17)]
    prompts = [{"prompt_embeds": table_rows(one, p)} for p in ids]
    two = engine(tiny_checkpoint, tensor_parallel_size=2)
    try:
        assert tokens(two.generate(prompts, GREEDY, use_tqdm=False)) == tokens(one.generate(ids, GREEDY, use_tqdm=False))
        assert_all_blocks_free(two)
    finally:
        two.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and the Triton kernels need a GPU")
def test_on_the_gpu_a_prompt_of_one_embedding_runs_eager(tiny_checkpoint):
    """A one-token prompt chunk is a decode-shaped row, which a CUDA graph would take with its
    placeholder id: a step with prompt embeddings runs eager instead."""
    llm = LLM(tiny_checkpoint, enable_prompt_embeds=True, num_kv_blocks=64, max_num_batched_tokens=8)
    ids = [[9], [5 + i % 90 for i in range(21)]]
    prompts = [{"prompt_embeds": table_rows(llm, p)} for p in ids]
    assert llm.engine.runner.graph_runner is not None
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == tokens(llm.generate(ids, GREEDY, use_tqdm=False))


def test_the_engine_keeps_a_copy_of_the_callers_embeddings(tiny_checkpoint):
    """The digest is taken when the request is added: a caller that then reuses its tensor must not
    change what the engine computes (nor cache the new values' K and V under the old digest). (A
    review found the tensor kept by reference.)"""
    llm = engine(tiny_checkpoint)
    hidden = llm.engine.config.model_config.hidden_size
    first, second = random_embeds(40, hidden, 11), random_embeds(40, hidden, 12)
    want = tokens(engine(tiny_checkpoint).generate([{"prompt_embeds": first}], GREEDY, use_tqdm=False))
    buffer = first.clone()
    seq = llm.engine.add_request([], GREEDY, prompt_embeds=buffer)
    buffer.copy_(second)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert [seq.output_token_ids] == want
    again = llm.generate({"prompt_embeds": first}, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 32 and [again.outputs[0].token_ids] == want


def test_embeddings_are_checked_in_the_models_dtype_and_rows_carry_their_own(tiny_checkpoint, monkeypatch):
    """Finite in fp32 but not in fp16: refused for an fp16 model. And a row's embeddings are a
    tensor of their own, not a view of the prompt's (pickled to tensor parallelism's other ranks, a
    view takes its whole storage: a review measured 8x the bytes for a prompt in 8 chunks)."""
    from mini_engine.engine.prompt_embeds import check_prompt_embeds
    with pytest.raises(ValueError, match="not finite in the model's dtype"):
        check_prompt_embeds(torch.full((2, 64), 1e6), GREEDY, 64, 64, torch.float16)
    assert check_prompt_embeds(torch.ones(2, 64, dtype=torch.float64), GREEDY, 64, 64,
                               torch.bfloat16).dtype == torch.bfloat16
    llm = engine(tiny_checkpoint, max_num_batched_tokens=8)
    launch, seen = llm.engine.runner.launch, []

    def recorded(rows, **kwargs):
        seen.extend(r.prompt_embeds for r in rows if r.prompt_embeds is not None)
        return launch(rows, **kwargs)
    monkeypatch.setattr(llm.engine.runner, "launch", recorded)
    llm.generate({"prompt_embeds": random_embeds(30, 64, 1)}, GREEDY, use_tqdm=False)
    assert len(seen) == 4 and all(e.untyped_storage().nbytes() == e.nbytes for e in seen)


def test_embeddings_cross_between_processes_as_bytes():
    """The server's queue to the engine's process carries them as bytes: a tensor would be shared
    through a file descriptor for as long as the request lives (a review ran the server out of
    descriptors with 700 requests at once)."""
    from mini_engine.engine.prompt_embeds import as_message, from_message
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        embeds = random_embeds(5, 64, 2).to(dtype)
        message = as_message(embeds)
        assert not any(isinstance(part, torch.Tensor) for part in message)
        assert torch.equal(from_message(message), embeds) and from_message(message).dtype == dtype
