"""vLLM's /classify on a server of a sequence classifier (Qwen3ForSequenceClassification, which
`serve` runs as a pooling model without being told), against transformers' logits; /score and
/rerank for a classifier of one label; what is refused."""
import re

import httpx
import pytest
from tokenizers import Tokenizer

from tests.engine.test_classification import LABELS, hf_logits, write_classifier
from tests.server.conftest import MODEL_NAME, launched_server


@pytest.fixture(scope="module")
def classifier_server(tiny_model, tmp_path_factory):
    path = write_classifier(tiny_model, str(tmp_path_factory.mktemp("classifier-model")), 3,
                            id2label=dict(enumerate(LABELS)))
    with launched_server(path, tmp_path_factory.mktemp("classifier-server-log"),
                         options=("--max-model-len", "48", "--trust-request-chat-template")) as handle:
        handle.model_path = path
        yield handle
        handle.check_idle_and_alive()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=30)


def test_classify_equals_transformers(classifier_server):
    """Texts and token ids, each one's probabilities the softmax of transformers' logits, its label
    the likeliest's name (config.json's id2label), vLLM's response shape."""
    path = classifier_server.model_path
    texts = ["the cat sat on the mat", "Emoji take four bytes: 😀", "The quick brown fox"]
    ids = [Tokenizer.from_file(f"{path}/tokenizer.json").encode(t).ids for t in texts]
    got = post(classifier_server, "/classify", {"model": MODEL_NAME, "input": texts}).json()
    assert got["object"] == "list" and got["id"].startswith("classify-") and got["model"] == MODEL_NAME
    assert got["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids))}
    expected = hf_logits(path, ids).softmax(-1)
    for i, (item, probs) in enumerate(zip(got["data"], expected)):
        assert item["index"] == i and item["num_classes"] == 3
        assert item["probs"] == pytest.approx(probs.tolist(), abs=1e-5)
        assert item["label"] == LABELS[int(probs.argmax())]
    assert len({item["label"] for item in got["data"]}) > 1, "every input got the same label: a weak test"
    one = post(classifier_server, "/v1/classify", {"input": ids[0]}).json()["data"]
    assert one[0]["probs"] == pytest.approx(expected[0].tolist(), abs=1e-5)
    raw = post(classifier_server, "/classify", {"input": [ids[1]], "use_activation": False}).json()["data"]
    assert raw[0]["probs"] == pytest.approx(hf_logits(path, [ids[1]])[0].tolist(), abs=1e-5)
    cut = post(classifier_server, "/classify", {"input": ids[0], "truncate_prompt_tokens": 3}).json()
    assert cut["usage"]["prompt_tokens"] == 3
    assert cut["data"][0]["probs"] == pytest.approx(hf_logits(path, [ids[0][-3:]])[0].softmax(-1).tolist(), abs=1e-5)
    classifier_server.wait_idle()


def test_pooling_and_chat_messages_classify(classifier_server):
    """vLLM's /pooling on a classifier: its own task, "classify", each input's `data` /classify's
    probabilities (raw logits with use_activation false); /classify's chat messages classify as
    the tokens /tokenize renders them into."""
    ids = [[5, 6, 7], [40, 41, 42, 43]]
    for fields in ({}, {"use_activation": False}):
        classified = post(classifier_server, "/classify", {"input": ids} | fields).json()
        pooled = post(classifier_server, "/pooling", {"input": ids} | fields).json()
        assert pooled["id"].startswith("pool-") and pooled["usage"] == classified["usage"]
        for got, expected in zip(pooled["data"], classified["data"]):
            assert got["object"] == "pooling" and got["data"] == pytest.approx(expected["probs"], abs=1e-5)
    messages = [{"role": "system", "content": "rate it"}, {"role": "user", "content": "the cat sat"}]
    tokens = post(classifier_server, "/tokenize",
                  {"messages": messages, "add_generation_prompt": False}).json()["tokens"]
    expected = post(classifier_server, "/classify", {"input": tokens}).json()["data"][0]
    for path, key in (("/classify", "probs"), ("/v1/classify", "probs"), ("/pooling", "data")):
        got = post(classifier_server, path, {"messages": messages}).json()["data"][0]
        assert got[key] == pytest.approx(expected["probs"], abs=1e-5)
    assert expected["probs"] != post(classifier_server, "/classify", {"input": tokens[:-1]}).json()["data"][0]["probs"]
    classifier_server.wait_idle()


def test_a_trusted_requests_chat_template_renders_its_messages(classifier_server):
    """As vLLM's pooling chat requests (ChatRequestMixin's chat_template and chat_template_kwargs):
    with --trust-request-chat-template, /classify's and /pooling's messages render by the request's
    own template, as /tokenize renders them by it."""
    messages = [{"role": "system", "content": "rate it"}, {"role": "user", "content": "the cat sat"}]
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tokens = post(classifier_server, "/tokenize", {"messages": messages, "add_generation_prompt": False,
                                                   "chat_template": template}).json()["tokens"]
    expected = post(classifier_server, "/classify", {"input": tokens}).json()["data"][0]["probs"]
    assert expected != post(classifier_server, "/classify", {"messages": messages}).json()["data"][0]["probs"]
    for path, key in (("/classify", "probs"), ("/pooling", "data")):
        for fields in ({"chat_template": template}, {"chat_template_kwargs": {"chat_template": template}}):
            response = post(classifier_server, path, {"messages": messages} | fields)
            assert response.status_code == 200, response.text
            assert response.json()["data"][0][key] == pytest.approx(expected, abs=1e-5), (path, fields)
    response = post(classifier_server, "/classify", {"messages": messages, "chat_template": "{% if %}"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "chat_template", response.text
    classifier_server.wait_idle()


@pytest.mark.parametrize("route,body,match", [
    ("/classify", {"input": list(range(3, 60))}, "exceeds max_model_len=48"),
    ("/classify", {"input": [[5, 6], [5, 10**6]]}, r"prompt 1"),
    ("/classify", {"input": []}, "empty"),
    ("/classify", {"input": [5, 6], "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/classify", {"input": [5, 6], "normalize": True}, "normalize"),
    ("/classify", {"input": [5, 6], "model": "other"}, "does not exist"),
    ("/score", {"text_1": "a", "text_2": ["b"]}, r"num_labels == 1.*has 3"),
    ("/rerank", {"query": "a", "documents": ["b"]}, r"num_labels == 1.*has 3"),
    ("/v1/embeddings", {"input": "a"}, "sequence classifier.*/classify"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "a", "max_tokens": 2}, "pooling model"),
    ("/pooling", {"input": "a", "task": "embed"}, "it is a sequence classifier, whose task is 'classify'"),
    ("/pooling", {"input": "a", "task": "token_classify"}, "every token's output.*LLM.reward"),
    ("/pooling", {"input": "a", "dimensions": 2}, "dimensions does not apply to classify"),
    ("/classify", {"input": "a", "messages": [{"role": "user", "content": "a"}]}, "not both"),
    ("/classify", {"messages": []}, "chat template cannot render|empty"),
])
def test_bad_classify_requests(classifier_server, route, body, match):
    response = post(classifier_server, route, body)
    assert response.status_code in (400, 404), response.text
    assert re.search(match, response.json()["error"]["message"]), response.text
    classifier_server.wait_idle()


def test_a_generating_server_refuses_classify(served):
    response = post(served, "/classify", {"input": "a"})
    assert response.status_code == 400 and "--runner pooling" in response.json()["error"]["message"]


def test_a_one_label_classifier_scores_and_reranks_pairs(tiny_model, tmp_path):
    """A reward model's shape (one label) served as a cross-encoder, as vLLM's Score API allows for
    num_labels == 1: each query and document read as the tokenizer's pair, scored by the sigmoid."""
    path = write_classifier(tiny_model, str(tmp_path / "model"), 1, seed=1)
    (tmp_path / "log").mkdir()
    query, docs = "the cat sat", ["a dog", "on the mat", "the cat sat on the mat"]
    pairs = [Tokenizer.from_file(f"{path}/tokenizer.json").encode(query, d).ids for d in docs]
    expected = hf_logits(path, pairs)[:, 0].sigmoid().tolist()
    with launched_server(path, tmp_path / "log") as server:
        scores = post(server, "/score", {"text_1": query, "text_2": docs}).json()
        assert [d["score"] for d in scores["data"]] == pytest.approx(expected, abs=1e-5)
        assert scores["usage"]["prompt_tokens"] == sum(map(len, pairs))
        ranked = post(server, "/rerank", {"query": query, "documents": docs}).json()
        assert [r["index"] for r in ranked["results"]] == sorted(range(3), key=lambda i: -expected[i])
        assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx(sorted(expected, reverse=True),
                                                                                  abs=1e-5)
        classified = post(server, "/classify", {"input": pairs}).json()["data"]
        assert [d["probs"][0] for d in classified] == pytest.approx(expected, abs=1e-5)
        assert {d["label"] for d in classified} == {"LABEL_0"}
        server.check_idle_and_alive()
