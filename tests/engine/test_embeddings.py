"""Embeddings (runner="pooling", vLLM's LLM.embed): each prompt's final hidden states pooled into one
vector, against transformers' Qwen3Model on the same safetensors, whatever the scheduler does with
the prompt (chunks, preemption, a prefix the cache holds), and a checkpoint laid out as
Qwen3-Embedding's (no lm_head, no "model." prefix, a tokenizer that appends <|endoftext|>)."""
import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing

from mini_engine import LLM, PoolingParams, SamplingParams
from mini_engine.layers.pooler import chunk_chain
from mini_engine.model.random_checkpoint import write_embedding_layout
from tests.engine.test_greedy_vs_transformers import mixed_prompts, shared_prefix_prompts
from tests.hf_reference import hf_model


@torch.inference_mode()
def hf_hidden(path: str, prompt: list[int]) -> torch.Tensor:
    """transformers' final hidden states (after the last RMSNorm) of the prompt, [len, hidden]."""
    return hf_model(path).model(torch.tensor([prompt])).last_hidden_state[0].float()


def hf_embedding(path: str, prompt: list[int], pooling_type: str = "LAST", normalize: bool = True,
                 dimensions: int | None = None) -> torch.Tensor:
    hidden = hf_hidden(path, prompt)
    pooled = hidden[-1] if pooling_type == "LAST" else hidden.mean(0)
    pooled = pooled[:dimensions] if dimensions else pooled
    return F.normalize(pooled, dim=0) if normalize else pooled


def embed(path: str, prompts, params=None, **engine_kwargs):
    llm = LLM(path, device="cpu", runner="pooling", **engine_kwargs)
    outputs = llm.embed(prompts, params, use_tqdm=False)
    engine = llm.engine
    assert engine.num_free_blocks == engine.block_manager.num_blocks, "KV blocks leaked"
    assert not engine.has_unfinished_requests()
    return outputs, engine


def assert_close(got: list[float], expected: torch.Tensor) -> None:
    assert len(got) == expected.numel()
    torch.testing.assert_close(torch.tensor(got), expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_embeddings_equal_transformers_through_chunks_and_preemption(tiny_checkpoint, pooling_type, async_scheduling):
    """Prompts in chunks of up to 16 tokens, in a pool too small for all of them at once: a
    preempted prompt is computed again, and its embedding is the one transformers gives. (Only with
    async scheduling does a prompt hold its blocks past the step that computes its last chunk, as
    its vector is still on its way; without, the oldest prompt takes the whole budget and no other
    grows beside it, so nothing is preempted.)"""
    prompts = mixed_prompts()
    outputs, engine = embed(tiny_checkpoint, prompts, num_kv_blocks=12, block_size=4, max_num_batched_tokens=16,
                            enable_prefix_caching=False, async_scheduling=async_scheduling,
                            pooler_config={"pooling_type": pooling_type})
    assert (engine.num_preemptions > 0) == async_scheduling
    for prompt, out in zip(prompts, outputs):
        assert out.prompt_token_ids == prompt and out.finished
        assert_close(out.outputs.embedding, hf_embedding(tiny_checkpoint, prompt, pooling_type))


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_prefix_cache(tiny_checkpoint, pooling_type):
    """Prompts that share a 37-token prefix, embedded one call after another: LAST takes the
    prefix from the cache (MEAN reads every position's state, so it computes the whole prompt)."""
    llm = LLM(tiny_checkpoint, device="cpu", runner="pooling", block_size=4, pooler_config={"pooling_type": pooling_type})
    prompts = shared_prefix_prompts()
    outputs = [llm.embed(prompt, use_tqdm=False)[0] for prompt in prompts]
    hits = llm.engine.prefix_cache_hit_tokens
    assert (hits > 0) == (pooling_type == "LAST")
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks
    for prompt, out in zip(prompts, outputs):
        assert_close(out.outputs.embedding, hf_embedding(tiny_checkpoint, prompt, pooling_type))


def test_normalize_dimensions_and_truncation(tiny_checkpoint):
    """Unnormalised, the vector is the last token's hidden state itself; a Matryoshka cut is taken
    before normalising; truncate_prompt_tokens embeds the prompt's last tokens."""
    prompt, long_prompt = mixed_prompts()[3], mixed_prompts()[4]       # 17 and 31 tokens
    outputs, _ = embed(tiny_checkpoint, [prompt] * 3 + [long_prompt],
                       [PoolingParams(normalize=False), PoolingParams(dimensions=16),
                        PoolingParams(truncate_prompt_tokens=10), PoolingParams(truncate_prompt_tokens=-1)],
                       hf_overrides={"is_matryoshka": True}, max_model_len=24)
    assert_close(outputs[0].outputs.embedding, hf_embedding(tiny_checkpoint, prompt, normalize=False))
    assert outputs[1].outputs.hidden_size == 16
    assert_close(outputs[1].outputs.embedding, hf_embedding(tiny_checkpoint, prompt, dimensions=16))
    assert outputs[2].prompt_token_ids == prompt[-10:]
    assert_close(outputs[2].outputs.embedding, hf_embedding(tiny_checkpoint, prompt[-10:]))
    assert outputs[3].prompt_token_ids == long_prompt[-24:]       # max_model_len of them
    assert_close(outputs[3].outputs.embedding, hf_embedding(tiny_checkpoint, long_prompt[-24:]))


def write_embedding_checkpoint(source: str, path: str, pooling_mode: str | None = None, normalize: bool = True,
                               append_token: str | None = "<|endoftext|>") -> str:
    """source as Qwen3-Embedding lays itself out: the tensors of transformers' Qwen3Model (no
    "model." prefix, no lm_head), a tokenizer whose post-processor appends append_token, and, given
    pooling_mode, Sentence Transformers' modules.json with a Pooling module (and a Normalize one)."""
    write_embedding_layout(source, path)
    if append_token is not None:
        tokenizer = Tokenizer.from_file(os.path.join(source, "tokenizer.json"))
        token_id = tokenizer.token_to_id(append_token)
        tokenizer.post_processor = TemplateProcessing(single=f"$A {append_token}", pair=f"$A $B {append_token}",
                                                      special_tokens=[(append_token, token_id)])
        tokenizer.save(os.path.join(path, "tokenizer.json"))
    if pooling_mode is not None:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                            "type": "sentence_transformers.models.Normalize"})
        with open(os.path.join(path, "modules.json"), "w") as f:
            json.dump(modules, f)
        os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
        modes = {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False, "pooling_mode_lasttoken": False}
        with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
            json.dump({"word_embedding_dimension": 64} | modes | {pooling_mode: True}, f)
    return path


@pytest.fixture(scope="module")
def embedding_model(tokenized_model, tmp_path_factory) -> str:
    return write_embedding_checkpoint(tokenized_model, str(tmp_path_factory.mktemp("tiny-qwen3-embedding")))


def test_qwen3_embedding_layout_and_its_tokenizer(tokenized_model, embedding_model):
    """A checkpoint with no lm_head and unprefixed names loads; text gets the tokenizer's
    <|endoftext|>, whose state is the embedding; a generating engine on the same tokenizer adds
    nothing to its prompts."""
    text = "the cat sat on the mat"
    outputs, engine = embed(embedding_model, [text, {"prompt": text}])
    ids = outputs[0].prompt_token_ids
    eot = engine.tokenizer.token_to_id("<|endoftext|>")
    assert ids[-1] == eot and eot not in ids[:-1] and outputs[1].prompt_token_ids == ids
    assert_close(outputs[0].outputs.embedding, hf_embedding(tokenized_model, ids))
    assert_close(outputs[1].outputs.embedding, torch.tensor(outputs[0].outputs.embedding))
    generating = LLM(embedding_model, device="cpu").engine       # the tokenizer's, an lm_head tied to the embedding
    assert generating.tokenize(text) == ids[:-1]


def test_encode_is_embed_for_an_embedding_model(tokenized_model, embedding_model):
    """vLLM's LLM.encode: an embedding model's own task is "embed", so its outputs.data are
    LLM.embed's embeddings (PoolingParams and truncation passed through); a task it cannot do, a
    per-token one, a parameter of another task, or a generating LLM is refused, naming what it does."""
    llm = LLM(embedding_model, device="cpu", runner="pooling")
    prompts = ["the cat sat on the mat", mixed_prompts()[4], {"prompt_token_ids": mixed_prompts()[6]}]
    encoded = llm.encode(prompts, use_tqdm=False)
    embedded = llm.embed(prompts, use_tqdm=False)
    assert [type(o).__name__ for o in encoded] == ["PoolingRequestOutput"] * 3
    for e, o in zip(encoded, embedded):
        assert e.prompt_token_ids == o.prompt_token_ids and e.finished
        assert_close(e.outputs.data, torch.tensor(o.outputs.embedding))
    assert_close(encoded[1].outputs.data, hf_embedding(tokenized_model, mixed_prompts()[4]))
    raw = llm.encode(mixed_prompts()[4], PoolingParams(normalize=False), truncate_prompt_tokens=5, pooling_task="embed",
                     use_tqdm=False)[0]
    assert raw.prompt_token_ids == mixed_prompts()[4][-5:]
    assert_close(raw.outputs.data, hf_embedding(tokenized_model, mixed_prompts()[4][-5:], normalize=False))
    for kwargs, match in [(dict(pooling_task="classify"), "not one this model does: it is an embedding model.*'embed'"),
                          (dict(pooling_task="token_embed"), "every token's output.*use 'embed'"),
                          (dict(pooling_task="reward"), "unknown pooling_task 'reward'"),
                          (dict(pooling_params=PoolingParams(use_activation=False)), "use_activation does not apply")]:
        with pytest.raises(ValueError, match=match):
            llm.encode(prompts, use_tqdm=False, **kwargs)
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks
    with pytest.raises(ValueError, match="LLM.encode needs a pooling model"):
        LLM(tokenized_model, device="cpu").encode("a", use_tqdm=False)


@pytest.mark.parametrize("mode,normalize,pooling_type", [("pooling_mode_mean_tokens", False, "MEAN"),
                                                         ("pooling_mode_lasttoken", True, "LAST")])
def test_sentence_transformers_modules_set_the_pooler(tokenized_model, tmp_path, mode, normalize, pooling_type):
    path = write_embedding_checkpoint(tokenized_model, str(tmp_path), mode, normalize)
    prompt = mixed_prompts()[6]
    outputs, engine = embed(path, [prompt])
    assert (engine.config.pooler.pooling_type, engine.config.pooler.normalize) == (pooling_type, normalize)
    assert_close(outputs[0].outputs.embedding, hf_embedding(tokenized_model, prompt, pooling_type, normalize))
    # pooler_config wins over the checkpoint's modules (vLLM's --pooler-config)
    outputs, engine = embed(path, [prompt], pooler_config={"pooling_type": "last", "normalize": True})
    assert_close(outputs[0].outputs.embedding, hf_embedding(tokenized_model, prompt, "LAST", True))


def test_bad_requests_are_refused_and_lose_nothing(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, device="cpu", runner="pooling", num_kv_blocks=8, block_size=4, max_model_len=64)
    prompts = mixed_prompts()[:3]
    llm.embed(prompts, use_tqdm=False)
    fits = list(range(3, 35))                                        # 32 tokens: all 8 blocks
    assert_close(llm.embed(fits, use_tqdm=False)[0].outputs.embedding, hf_embedding(tiny_checkpoint, fits))
    for bad, match in [(list(range(3, 40)), "pool holds 8"),         # 37 tokens need 10 blocks
                       ([3] * 65, "exceeds max_model_len=64"),
                       ([3, 300], r"\[0, 256\)"),
                       ([], "empty")]:
        with pytest.raises(ValueError, match=match):
            llm.embed(prompts[:1] + [bad] + prompts[1:], use_tqdm=False)
        assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks
    for params, match in [(PoolingParams(dimensions=8), "Matryoshka"),
                          (PoolingParams(truncate_prompt_tokens=65), "exceeds max_model_len")]:
        with pytest.raises(ValueError, match=match):
            llm.embed(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, llm.embed(prompts, use_tqdm=False)):     # served by the cache in part
        assert_close(out.outputs.embedding, hf_embedding(tiny_checkpoint, prompt))
    with pytest.raises(ValueError, match="LLM.embed"):
        llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(TypeError, match="PoolingParams"):
        llm.engine.add_request(prompts[0], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="runner='pooling'"):
        LLM(tiny_checkpoint, device="cpu").embed(prompts)
    with pytest.raises(TypeError, match="runner='pooling'"):
        LLM(tiny_checkpoint, device="cpu").engine.add_request(prompts[0], PoolingParams())


def test_matryoshka_dimensions_from_config(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, device="cpu", runner="pooling", hf_overrides={"matryoshka_dimensions": [16, 32]})
    assert llm.embed([5, 6, 7], PoolingParams(dimensions=32), use_tqdm=False)[0].outputs.hidden_size == 32
    with pytest.raises(ValueError, match=r"\(16, 32\)"):
        llm.embed([5, 6, 7], PoolingParams(dimensions=24), use_tqdm=False)
    llm = LLM(tiny_checkpoint, device="cpu", runner="pooling", hf_overrides={"is_matryoshka": True})
    with pytest.raises(ValueError, match="1 to 64"):                  # hidden_size 64
        llm.embed([5, 6, 7], PoolingParams(dimensions=65), use_tqdm=False)


@pytest.mark.parametrize("kwargs,match", [
    (dict(dimensions=0), "dimensions"), (dict(dimensions=True), "dimensions"), (dict(normalize="yes"), "normalize"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"), (dict(truncate_prompt_tokens=-2), "truncate"),
])
def test_bad_pooling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PoolingParams(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(runner="pooling", pooler_config={"pooling_type": "CLS"}), "seen only itself"),
    (dict(runner="pooling", pooler_config={"pooling_type": "max"}), "pooling_type must be one of"),
    (dict(runner="pooling", pooler_config={"pool": "LAST"}), "unknown fields"),
    (dict(runner="pooling", pooler_config={"normalize": 1}), "^pooler_config: normalize"),
    (dict(pooler_config={"pooling_type": "LAST"}), "needs runner='pooling'"),
    (dict(runner="embed"), "runner must be"),
])
def test_bad_engine_options(tiny_checkpoint, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_checkpoint, device="cpu", **kwargs)


def test_unsupported_sentence_transformers_pooling(tokenized_model, tmp_path):
    path = write_embedding_checkpoint(tokenized_model, str(tmp_path), "pooling_mode_cls_token")
    with pytest.raises(ValueError, match="modules.json's Pooling module.*pooling_mode_cls_token"):
        LLM(path, device="cpu", runner="pooling")


def test_chunk_chain_follows_the_latest_chunks():
    """A prompt computed in chunks [0, 4) and [4, 8), preempted, then again in [0, 6) and [6, 10):
    the walk from 0 takes the second run's shares, never the first run's [4, 8)."""
    first, stale, second, third = (np.full(3, v, dtype=np.float32) for v in (1.0, 100.0, 2.0, 4.0))
    shares = {0: (4, first), 4: (8, stale)}
    shares |= {0: (6, second), 6: (10, third)}
    np.testing.assert_array_equal(chunk_chain(shares, 10), second + third)
    with pytest.raises(RuntimeError, match="end at 8"):
        chunk_chain({0: (4, first), 4: (8, stale)}, 6)


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_a_last_chunk_of_one_token(tiny_checkpoint, pooling_type):
    """17 tokens in a budget of 16: the prompt's last chunk is its last token alone."""
    prompt = mixed_prompts()[3]
    outputs, _ = embed(tiny_checkpoint, [prompt], max_num_batched_tokens=16, pooler_config={"pooling_type": pooling_type})
    assert_close(outputs[0].outputs.embedding, hf_embedding(tiny_checkpoint, prompt, pooling_type))


def test_an_untied_checkpoints_lm_head_is_left_out(checkpoint_factory):
    """A checkpoint with an lm_head of its own (untied) loads without it; LLM.embed's
    truncate_prompt_tokens truncates every prompt."""
    path = checkpoint_factory("untied-bias-gqa4")
    llm = LLM(path, device="cpu", runner="pooling")
    assert llm.engine.runner.model.lm_head is None
    prompts = mixed_prompts()[2:5]
    for prompt, out in zip(prompts, llm.embed(prompts, use_tqdm=False, truncate_prompt_tokens=5)):
        assert out.prompt_token_ids == prompt[-5:]
        assert_close(out.outputs.embedding, hf_embedding(path, prompt[-5:]))


def test_an_abort_while_the_last_chunk_is_in_flight_ends_the_request_once(tiny_checkpoint):
    """Aborted after the step that computes its whole prompt is launched (async scheduling: its
    vector still on the way), a request ends "abort", with no embedding and no output; the other
    request of that step gets its own."""
    engine = LLM(tiny_checkpoint, device="cpu", runner="pooling", block_size=4).engine
    aborted = engine.add_request(mixed_prompts()[3], PoolingParams())
    kept = engine.add_request(mixed_prompts()[2], PoolingParams())
    assert engine.step() == [] and engine.in_flight is not None
    engine.abort_request(aborted.request_id)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.seq for o in outputs] == [kept] and outputs[0].finished
    assert aborted.finish_reason == "abort" and aborted.embedding is None
    assert_close(kept.embedding, hf_embedding(tiny_checkpoint, mixed_prompts()[2]))
    assert engine.num_free_blocks == engine.block_manager.num_blocks


def test_score_is_the_cosine_of_the_embeddings(tiny_checkpoint):
    """vLLM's LLM.score for an embedding model: one text against many, or pairs of two lists."""
    llm = LLM(tiny_checkpoint, device="cpu", runner="pooling", pooler_config={"normalize": False})
    query, docs = mixed_prompts()[2], mixed_prompts()[3:6]
    cosine = lambda a, b: F.cosine_similarity(hf_embedding(tiny_checkpoint, a), hf_embedding(tiny_checkpoint, b),
                                              dim=0).item()   # noqa: E731
    outputs = llm.score(query, docs, use_tqdm=False)
    assert [o.outputs.score for o in outputs] == pytest.approx([cosine(query, d) for d in docs], abs=1e-5)
    assert outputs[1].prompt_token_ids == query + docs[1]
    outputs = llm.score(docs, docs[::-1], use_tqdm=False)
    assert [o.outputs.score for o in outputs] == pytest.approx([cosine(a, b) for a, b in zip(docs, docs[::-1])],
                                                               abs=1e-5)
    with pytest.raises(ValueError, match="data_1 holds 2 prompts and data_2 3"):
        llm.score(docs[:2], docs, use_tqdm=False)
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks


def classifier_tokens(path: str) -> list[str]:
    """Two one-token strings of the tokenized test model's vocabulary (it has no "no" and "yes")."""
    tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    return [tokenizer.id_to_token(418), "Ġthe"]


@torch.inference_mode()
def hf_pair_score(path: str, prompt: list[int], tokens: list[str]) -> float:
    """transformers' Qwen3ForCausalLM as the cross-encoder: the second token's probability against
    the first's, from their logits at the prompt's last token."""
    tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    ids = [tokenizer.token_to_id(t) for t in tokens]
    return hf_model(path)(torch.tensor([prompt])).logits[0, -1, ids].float().softmax(-1)[1].item()


def test_a_cross_encoder_scores_pairs_as_transformers(tokenized_model):
    """classifier_from_token (vLLM's Qwen3-Reranker conversion): each pair read as one prompt, as
    the tokenizer encodes a pair, in chunks of 8 tokens; its score from the lm_head's two logits."""
    tokens = classifier_tokens(tokenized_model)
    llm = LLM(tokenized_model, device="cpu", runner="pooling", max_num_batched_tokens=8,
              hf_overrides={"classifier_from_token": tokens})
    tokenizer = llm.tokenizer
    query, docs = "the cat sat", ["a dog", "on the mat", "the cat sat on the mat"]
    for first, second in [(query, docs), (docs, docs[::-1])]:
        outputs = llm.score(first, second, use_tqdm=False)
        for i, out in enumerate(outputs):
            a = first if isinstance(first, str) else first[i]
            assert out.prompt_token_ids == tokenizer.encode(a, second[i]).ids
            assert out.outputs.score == pytest.approx(hf_pair_score(tokenized_model, out.prompt_token_ids, tokens),
                                                      abs=1e-5)
    # LLM.encode: "classify", the score alone, as vLLM's one-label conversion of the reranker gives it
    pair = tokenizer.encode(query, docs[0]).ids
    assert llm.encode([pair], use_tqdm=False)[0].outputs.data == \
        pytest.approx([hf_pair_score(tokenized_model, pair, tokens)], abs=1e-5)
    with pytest.raises(ValueError, match="a probability only"):
        llm.encode([pair], PoolingParams(use_activation=False), use_tqdm=False)
    ids = [5, 6, 7]
    assert llm.score(ids, [[8, 9]], use_tqdm=False)[0].prompt_token_ids == ids + [8, 9]
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks
    with pytest.raises(ValueError, match="cross-encoder"):
        llm.embed(query, use_tqdm=False)


@pytest.mark.parametrize("kwargs,match", [
    (dict(hf_overrides={"classifier_from_token": ["Ġthe"]}), "two tokens"),
    (dict(hf_overrides={"classifier_from_token": ["Ġthe", "not-a-token"]}), "not one token"),
    (dict(hf_overrides={"classifier_from_token": ["Ġthe", "Ġthe"]}, pooler_config={"pooling_type": "MEAN"}),
     "scores the last token"),
    (dict(pooler_config={"classifier_token_ids": [5, 10**6]}), r"two token ids in \[0, "),
])
def test_bad_cross_encoder_options(tokenized_model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(tokenized_model, device="cpu", runner="pooling", **kwargs)
    with pytest.raises(ValueError, match="needs runner='pooling'"):
        LLM(tokenized_model, device="cpu", hf_overrides={"classifier_from_token": ["Ġthe", "Ġthe"]})
