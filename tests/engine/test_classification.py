"""Sequence classifiers and reward models (config.json's Qwen3ForSequenceClassification, vLLM's
LLM.classify, LLM.reward and, for one label, LLM.score): tiny random checkpoints written by
transformers' own Qwen3ForSequenceClassification (save_pretrained, fp32), against that model's
logits at each prompt's last token, whatever the scheduler does with the prompt; what is refused."""
import functools
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from mini_engine import LLM, PoolingParams, SamplingParams
from mini_engine.config import EngineConfig
from mini_engine.distributed import TensorParallel
from mini_engine.model.loader import load_model
from mini_engine.model.qwen3 import Qwen3ForCausalLM
from tests.engine.test_greedy_vs_transformers import mixed_prompts, shared_prefix_prompts

transformers = pytest.importorskip("transformers")

LABELS = ["negative", "neutral", "positive"]
SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings")


def write_classifier(source: str, path: str, num_labels: int, moe: bool = False, seed: int = 0, **config) -> str:
    """A random transformers Qwen3ForSequenceClassification (Qwen3MoeForSequenceClassification with
    moe) of source's shape, saved as transformers saves it, with source's tokenizer. pad_token_id is
    <|endoftext|>, which no test prompt holds: transformers' last non-padding token is then the
    prompt's last, the token vLLM reads. A larger initializer_range than transformers' 0.02, so
    that the labels' probabilities differ from one prompt to another."""
    with open(os.path.join(source, "config.json")) as f:
        shape = {name: value for name, value in json.load(f).items() if name in SHAPE_FIELDS}
    pad = Tokenizer.from_file(os.path.join(source, "tokenizer.json")).token_to_id("<|endoftext|>")
    fields = shape | {"pad_token_id": pad, "initializer_range": 0.3} | config
    if "id2label" not in config:
        fields["num_labels"] = num_labels
    if moe:
        fields |= dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                       mlp_only_layers=[1])
        model_class, config_class = transformers.Qwen3MoeForSequenceClassification, transformers.Qwen3MoeConfig
    else:
        model_class, config_class = transformers.Qwen3ForSequenceClassification, transformers.Qwen3Config
    torch.manual_seed(seed)
    model_class(config_class(**fields)).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(source, name), path)
    return path


@functools.lru_cache(maxsize=None)
def hf_classifier(path: str):
    return transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32,
                                                                           attn_implementation="eager").eval()


@torch.inference_mode()
def hf_logits(path: str, prompts: list[list[int]]) -> torch.Tensor:
    """transformers' logits of each prompt, [len(prompts), num_labels]: one batch, right-padded with
    pad_token_id and masked, as transformers' classifier reads its last non-padding token."""
    model = hf_classifier(path)
    longest = max(map(len, prompts))
    pad = model.config.pad_token_id
    ids = torch.tensor([p + [pad] * (longest - len(p)) for p in prompts])
    mask = torch.tensor([[1] * len(p) + [0] * (longest - len(p)) for p in prompts])
    return model(ids, attention_mask=mask).logits.float()


@torch.inference_mode()
def hf_mean_logits(path: str, prompt: list[int]) -> torch.Tensor:
    """The score head on the mean of every token's final hidden state (MEAN pooling)."""
    model = hf_classifier(path)
    return model.score(model.model(torch.tensor([prompt])).last_hidden_state[0].mean(0))


@pytest.fixture(scope="module")
def three_labels(tokenized_model, tmp_path_factory) -> str:
    return write_classifier(tokenized_model, str(tmp_path_factory.mktemp("classifier-3")), 3,
                            id2label=dict(enumerate(LABELS)))


@pytest.fixture(scope="module")
def one_label(tokenized_model, tmp_path_factory) -> str:
    """A reward model's (Skywork-Reward-V2-Qwen3's) shape: one label."""
    return write_classifier(tokenized_model, str(tmp_path_factory.mktemp("classifier-1")), 1, seed=1)


def assert_blocks_free(llm: LLM) -> None:
    engine = llm.engine
    assert engine.num_free_blocks == engine.block_manager.num_blocks, "KV blocks leaked"
    assert not engine.has_unfinished_requests()


def close(got: list[float], expected: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), expected.double(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_classify_is_the_softmax_of_transformers_logits(three_labels, async_scheduling):
    """Prompts of 1 to 40 tokens in chunks of up to 16, in a pool too small for all at once (with
    async scheduling, preempted and computed again): each one's probabilities are the softmax of
    transformers' logits; runner "auto" picked pooling for the architecture, and the labels are
    config.json's id2label."""
    prompts = mixed_prompts()
    llm = LLM(three_labels, device="cpu", num_kv_blocks=12, block_size=4, max_num_batched_tokens=16,
              enable_prefix_caching=False, async_scheduling=async_scheduling)
    assert llm.engine.config.runner == "pooling" and llm.engine.config.model_config.labels == tuple(LABELS)
    outputs = llm.classify(prompts, use_tqdm=False)
    assert (llm.engine.num_preemptions > 0) == async_scheduling
    expected = hf_logits(three_labels, prompts).softmax(-1)
    for prompt, out, probs in zip(prompts, outputs, expected):
        assert out.prompt_token_ids == prompt and out.finished and out.outputs.num_classes == 3
        close(out.outputs.probs, probs)
    assert_blocks_free(llm)


def test_prefix_cache_text_truncation_and_raw_logits(three_labels):
    """Prompts sharing a 37-token prefix, one call after another, take the prefix from the cache;
    text goes through the tokenizer; truncate_prompt_tokens classifies the last tokens;
    use_activation=False gives the raw logits (as does pooler_config's for every request)."""
    llm = LLM(three_labels, device="cpu", block_size=4)
    prompts = shared_prefix_prompts()
    outputs = [llm.classify(prompt, use_tqdm=False)[0] for prompt in prompts]
    assert llm.engine.prefix_cache_hit_tokens > 0
    for out, probs in zip(outputs, hf_logits(three_labels, prompts).softmax(-1)):
        close(out.outputs.probs, probs)
    text = "the cat sat on the mat"
    ids = Tokenizer.from_file(os.path.join(three_labels, "tokenizer.json")).encode(text).ids
    prompt = mixed_prompts()[6]
    outputs = llm.classify([text, prompt, prompt], [PoolingParams(), PoolingParams(truncate_prompt_tokens=5),
                                                    PoolingParams(use_activation=False)], use_tqdm=False)
    assert outputs[0].prompt_token_ids == ids and outputs[1].prompt_token_ids == prompt[-5:]
    close(outputs[0].outputs.probs, hf_logits(three_labels, [ids])[0].softmax(-1))
    close(outputs[1].outputs.probs, hf_logits(three_labels, [prompt[-5:]])[0].softmax(-1))
    close(outputs[2].outputs.probs, hf_logits(three_labels, [prompt])[0])
    assert_blocks_free(llm)
    raw = LLM(three_labels, device="cpu", pooler_config={"use_activation": False})
    close(raw.classify(prompt, use_tqdm=False)[0].outputs.probs, hf_logits(three_labels, [prompt])[0])
    close(raw.classify(prompt, PoolingParams(use_activation=True), use_tqdm=False)[0].outputs.probs,
          hf_logits(three_labels, [prompt])[0].softmax(-1))


def test_mean_pooling_applies_the_head_to_the_mean_state(three_labels):
    """pooler_config MEAN (vLLM's override): the head on the mean state, whose chunks' logits
    sum as their states would (8 tokens a step)."""
    prompts = mixed_prompts()[3:7]
    llm = LLM(three_labels, device="cpu", max_num_batched_tokens=8, pooler_config={"pooling_type": "mean"})
    for prompt, out in zip(prompts, llm.classify(prompts, use_tqdm=False)):
        close(out.outputs.probs, hf_mean_logits(three_labels, prompt).softmax(-1))
    assert_blocks_free(llm)


def test_one_label_is_a_sigmoid_and_its_reward_the_raw_logit(one_label):
    """vLLM's rule: one label's activation is a sigmoid. LLM.reward gives the raw logit (the reward
    a Bradley-Terry reward model's card reads), or its sigmoid where a request asks."""
    prompts = mixed_prompts()[:5]
    llm = LLM(one_label, device="cpu", max_num_batched_tokens=16)
    logits = hf_logits(one_label, prompts)
    classified = llm.classify(prompts, use_tqdm=False)
    rewards = llm.reward(prompts, use_tqdm=False)
    activated = llm.reward(prompts, PoolingParams(use_activation=True), use_tqdm=False)
    for c, r, a, logit in zip(classified, rewards, activated, logits):
        assert c.outputs.num_classes == 1 and r.prompt_token_ids == c.prompt_token_ids
        close(c.outputs.probs, logit.sigmoid())
        close(r.outputs.data, logit)
        close(a.outputs.data, logit.sigmoid())
    assert_blocks_free(llm)


def test_encode_is_classify_for_a_classifier(three_labels):
    """vLLM's LLM.encode: a classifier's own task is "classify", its outputs.data the labels'
    probabilities (the raw logits with use_activation=False); "embed" and the per-token
    "token_classify" are refused, the latter pointing to the last token's raw score."""
    llm = LLM(three_labels, device="cpu")
    prompts = mixed_prompts()[:4]
    logits = hf_logits(three_labels, prompts)
    for out, probs in zip(llm.encode(prompts, use_tqdm=False), logits.softmax(-1)):
        close(out.outputs.data, probs)
    raw = llm.encode(prompts, PoolingParams(use_activation=False), pooling_task="classify", use_tqdm=False)
    for out, logit in zip(raw, logits):
        close(out.outputs.data, logit)
    for task, match in [("embed", "not one this model does: it is a sequence classifier.*'classify'"),
                        ("token_classify", "every token's output.*LLM.reward")]:
        with pytest.raises(ValueError, match=match):
            llm.encode(prompts, pooling_task=task, use_tqdm=False)
    with pytest.raises(ValueError, match="normalize does not apply to classify"):
        llm.encode(prompts, PoolingParams(normalize=True), use_tqdm=False)
    assert_blocks_free(llm)


def test_score_reads_each_pair_as_the_tokenizer_encodes_it(one_label):
    """A one-label classifier as a cross-encoder (vLLM's Score API for num_labels == 1): each
    query and document read as one prompt, the tokenizer's pair, scored by the sigmoid."""
    llm = LLM(one_label, device="cpu")
    tokenizer = Tokenizer.from_file(os.path.join(one_label, "tokenizer.json"))
    query, docs = "the cat sat", ["a dog", "on the mat", "the cat sat on the mat"]
    for first, second in [(query, docs), (docs, docs[::-1])]:
        outputs = llm.score(first, second, use_tqdm=False)
        pairs = [tokenizer.encode(first if isinstance(first, str) else first[i], d).ids for i, d in enumerate(second)]
        assert [o.prompt_token_ids for o in outputs] == pairs
        expected = hf_logits(one_label, pairs)[:, 0].sigmoid()
        assert [o.outputs.score for o in outputs] == pytest.approx(expected.tolist(), abs=1e-5)
    assert llm.score([5, 6], [[7, 8]], use_tqdm=False)[0].prompt_token_ids == [5, 6, 7, 8]
    assert_blocks_free(llm)


@pytest.mark.parametrize("problem_type,activation", [("regression", lambda x: x),
                                                     ("multi_label_classification", torch.sigmoid),
                                                     ("single_label_classification", lambda x: x.softmax(-1))])
def test_problem_type_sets_the_activation(tokenized_model, tmp_path, problem_type, activation):
    """As vLLM follows transformers' loss: a regression's logits as they are, a multi-label
    problem's each through a sigmoid, a single-label one's through a softmax."""
    path = write_classifier(tokenized_model, str(tmp_path), 3, problem_type=problem_type)
    prompt = mixed_prompts()[4]
    out = LLM(path, device="cpu").classify(prompt, use_tqdm=False)[0]
    close(out.outputs.probs, activation(hf_logits(path, [prompt])[0]))


def test_a_moe_classifier(tokenized_model, tmp_path):
    """Qwen3MoeForSequenceClassification: the same head on Qwen3-MoE's decoder."""
    path = write_classifier(tokenized_model, str(tmp_path), 2, moe=True)
    prompts = mixed_prompts()[:4]
    for out, probs in zip(LLM(path, device="cpu").classify(prompts, use_tqdm=False),
                          hf_logits(path, prompts).softmax(-1)):
        close(out.outputs.probs, probs)


def test_two_ranks_each_hold_the_whole_head(three_labels):
    """Under tensor parallelism the head (num_labels x hidden) is replicated: each rank loads all
    of score.weight; and a two-rank engine classifies as transformers does."""
    mc = EngineConfig(three_labels, device="cpu").model_config
    whole = load_file(os.path.join(three_labels, "model.safetensors"))["score.weight"]
    for rank in range(2):
        model = Qwen3ForCausalLM(mc, tp=TensorParallel(rank, 2), lm_head=False)
        load_model(model, three_labels)
        torch.testing.assert_close(model.score.weight.data, whole, rtol=0, atol=0)
    llm = LLM(three_labels, device="cpu", tensor_parallel_size=2, max_num_batched_tokens=16)
    try:
        prompts = mixed_prompts()[:6]
        for out, probs in zip(llm.classify(prompts, use_tqdm=False), hf_logits(three_labels, prompts).softmax(-1)):
            close(out.outputs.probs, probs)
        assert_blocks_free(llm)
    finally:
        llm.shutdown()


def test_what_a_classifier_refuses(three_labels, one_label, tokenized_model):
    llm = LLM(three_labels, device="cpu", max_model_len=32)
    prompts = mixed_prompts()[:3]
    for call, match in [(lambda: llm.score("a", ["b"], use_tqdm=False), "num_labels == 1.*has 3"),
                        (lambda: llm.embed(prompts, use_tqdm=False), "sequence classifier.*LLM.classify"),
                        (lambda: llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False), "runner="),
                        (lambda: llm.classify(prompts, PoolingParams(normalize=True), use_tqdm=False),
                         "normalize does not apply to classify"),
                        (lambda: llm.classify(prompts, PoolingParams(dimensions=2), use_tqdm=False),
                         "dimensions does not apply to classify"),
                        (lambda: llm.classify([[3] * 33], use_tqdm=False), "exceeds max_model_len=32"),
                        (lambda: llm.classify([[3, 10**6]], use_tqdm=False), r"\[0, "),
                        (lambda: llm.classify([[]], use_tqdm=False), "empty")]:
        with pytest.raises(ValueError, match=match):
            call()
        assert_blocks_free(llm)
    close(llm.classify(prompts[1], use_tqdm=False)[0].outputs.probs,
          hf_logits(three_labels, [prompts[1]])[0].softmax(-1))
    with pytest.raises(ValueError, match="sequence classifier: use LLM.classify"):     # says what it can do
        llm.generate(prompts, use_tqdm=False)
    generating = LLM(tokenized_model, device="cpu")
    embedding = LLM(tokenized_model, device="cpu", runner="pooling")
    for other, what in [(generating, "generative model"), (embedding, "embedding model")]:
        for method in (other.classify, other.reward):
            with pytest.raises(ValueError, match=f"needs a sequence classifier.*{what}"):
                method(prompts, use_tqdm=False)
    with pytest.raises(ValueError, match="use_activation does not apply to embed"):
        embedding.embed(prompts, PoolingParams(use_activation=False), use_tqdm=False)


@pytest.mark.parametrize("kwargs,match", [
    (dict(runner="generate"), "sequence classifier.*cannot generate"),
    (dict(pooler_config={"normalize": False}), "normalize is for an embedding model"),
    (dict(pooler_config={"use_activation": "no"}), "use_activation must be true or false"),
    (dict(pooler_config={"pooling_type": "CLS"}), "seen only itself"),
    (dict(hf_overrides={"classifier_from_token": ["a", "b"]}), "score head is its own"),
    (dict(hf_overrides={"num_labels": 2}), "num_labels=2 but id2label names 3 labels"),
    (dict(hf_overrides={"problem_type": "ranking"}), "problem_type must be one of"),
    (dict(hf_overrides={"id2label": {"0": "a", "2": "b"}}), "indices must be 0 to 1"),
])
def test_bad_classifier_options(three_labels, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(three_labels, device="cpu", **kwargs)


def test_bad_classifier_checkpoints(three_labels, tokenized_model, tmp_path):
    """A checkpoint without score.weight, and one whose head has more rows than config.json's
    labels; use_activation is refused on an embedding model's pooler."""
    tensors = load_file(os.path.join(three_labels, "model.safetensors"))
    headless = {k: v for k, v in tensors.items() if k != "score.weight"}
    for name, kept, match in [("headless", headless, "no score.weight"),
                              ("wider", tensors | {"score.weight": torch.zeros(4, tensors["score.weight"].shape[1])},
                               r"'score.weight' has shape \(4, 64\), expected \(3, 64\).*3 labels")]:
        path = tmp_path / name
        shutil.copytree(three_labels, path)
        save_file(kept, str(path / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ValueError, match=match):
            LLM(str(path), device="cpu")
    with pytest.raises(ValueError, match="use_activation is for a sequence classifier"):
        LLM(tokenized_model, device="cpu", runner="pooling", pooler_config={"use_activation": False})


def test_labels_without_id2label(tokenized_model, tmp_path):
    """num_labels alone names the labels as transformers does, LABEL_i; neither: its two."""
    path = write_classifier(tokenized_model, str(tmp_path), 2)
    for given, labels in [({"num_labels": 4}, ("LABEL_0", "LABEL_1", "LABEL_2", "LABEL_3")),
                          ({}, ("LABEL_0", "LABEL_1"))]:
        mc = EngineConfig(path, device="cpu", hf_overrides={"id2label": None} | given).model_config
        assert mc.labels == labels and mc.num_labels == len(labels)
