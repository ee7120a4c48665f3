"""/v1/embeddings on a server started with --runner pooling, through OpenAI's own client (which asks
for base64 unless told otherwise), against transformers' hidden states; what it refuses."""
import base64
import json
import re

import httpx
import numpy as np
import openai
import pytest
import torch

from tokenizers import Tokenizer

from tests.engine.test_embeddings import classifier_tokens, hf_embedding, hf_pair_score, write_embedding_checkpoint
from tests.server.conftest import MODEL_NAME, launched_server


@pytest.fixture(scope="module")
def embedding_server(tiny_model, tmp_path_factory):
    path = write_embedding_checkpoint(tiny_model, str(tmp_path_factory.mktemp("embedding-model")))
    options = ("--runner", "pooling", "--hf-overrides", '{"is_matryoshka": true}', "--max-model-len", "48")
    with launched_server(path, tmp_path_factory.mktemp("embedding-server-log"), options=options) as handle:
        handle.model_path = path
        yield handle
    assert handle.process.returncode is not None


def test_embeddings_equal_transformers(embedding_server, tiny_model):
    client = openai.OpenAI(base_url=embedding_server.base_url + "/v1", api_key="none")
    texts = ["the cat sat on the mat", "a dog", "the cat sat on the mat, and then it slept"]
    tokens, second = (httpx.post(embedding_server.base_url + "/tokenize", timeout=30,
                                 json={"prompt": text, "add_special_tokens": True}).json()["tokens"]
                      for text in texts[:2])
    # /tokenize on an embedding server tokenizes as /v1/embeddings does: with the appended <|endoftext|>
    assert httpx.post(embedding_server.base_url + "/tokenize", json={"prompt": texts[0]}, timeout=30).json()["tokens"] \
        == tokens
    got = client.embeddings.create(model=MODEL_NAME, input=texts)         # base64, decoded by the client
    floats = client.embeddings.create(model=MODEL_NAME, input=[tokens, second], encoding_format="float")
    assert [d.index for d in got.data] == [0, 1, 2]
    torch.testing.assert_close(torch.tensor(got.data[0].embedding), hf_embedding(tiny_model, tokens),
                               atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(torch.tensor(floats.data[0].embedding), torch.tensor(got.data[0].embedding),
                               atol=2e-5, rtol=1e-4)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == len(tokens) + len(second)
    torch.testing.assert_close(torch.tensor(floats.data[1].embedding), hf_embedding(tiny_model, second),
                               atol=2e-5, rtol=1e-4)
    cut = client.embeddings.create(model=MODEL_NAME, input=tokens, dimensions=16, encoding_format="float")
    torch.testing.assert_close(torch.tensor(cut.data[0].embedding), hf_embedding(tiny_model, tokens, dimensions=16),
                               atol=2e-5, rtol=1e-4)
    raw = httpx.post(embedding_server.base_url + "/v1/embeddings", timeout=30,
                     json={"input": tokens, "normalize": False, "truncate_prompt_tokens": 4})
    assert raw.status_code == 200 and raw.json()["usage"] == {"prompt_tokens": 4, "total_tokens": 4}
    torch.testing.assert_close(torch.tensor(raw.json()["data"][0]["embedding"]),
                               hf_embedding(tiny_model, tokens[-4:], normalize=False), atol=2e-5, rtol=1e-4)
    embedding_server.wait_idle()


@pytest.mark.parametrize("body,match", [
    ({"input": list(range(3, 60))}, "exceeds max_model_len=48"),
    ({"input": [[5, 6], [5, 10**6]]}, r"input 1|prompt 1"),
    ({"input": [5, 6], "dimensions": 0}, "dimensions"),
    ({"input": [5, 6], "dimensions": 500}, "not a cut"),
    ({"input": [5, 6], "encoding_format": "int8"}, "encoding_format"),
    ({"input": [5, 6], "truncate_prompt_tokens": 49}, "exceeds max_model_len"),
    ({"input": [5, 6], "model": "other"}, "does not exist"),
    ({"input": [5, 6], "pooling": "mean"}, "not a supported parameter"),
    ({"input": []}, "empty"),
])
def test_bad_embedding_requests(embedding_server, body, match):
    response = httpx.post(embedding_server.base_url + "/v1/embeddings", json=body, timeout=30)
    assert response.status_code in (400, 404), response.text
    assert re.search(match, response.json()["error"]["message"]), response.text
    embedding_server.wait_idle()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=30)


def test_pooling_is_the_embedding(embedding_server):
    """vLLM's /pooling on an embedding model: its own task, "embed", so each input's `data` is
    /v1/embeddings' embedding of it (texts, token ids, dimensions, base64), in vLLM's shape."""
    texts, ids = ["the cat sat on the mat", "a dog"], [5, 6, 7, 8, 9]
    embeddings = post(embedding_server, "/v1/embeddings", {"input": texts}).json()
    pooled = post(embedding_server, "/pooling", {"model": MODEL_NAME, "input": texts}).json()
    assert pooled["object"] == "list" and pooled["id"].startswith("pool-") and pooled["model"] == MODEL_NAME
    assert isinstance(pooled["created"], int) and pooled["usage"] == embeddings["usage"]
    assert [(d["index"], d["object"]) for d in pooled["data"]] == [(0, "pooling"), (1, "pooling")]
    for got, expected in zip(pooled["data"], embeddings["data"]):
        torch.testing.assert_close(torch.tensor(got["data"]), torch.tensor(expected["embedding"]), atol=2e-5, rtol=1e-4)
    cut = {"input": ids, "dimensions": 16, "normalize": False, "truncate_prompt_tokens": 4}
    expected = post(embedding_server, "/v1/embeddings", cut).json()["data"][0]["embedding"]
    got = post(embedding_server, "/pooling", cut | {"task": "embed", "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(got["data"][0]["data"]), dtype="<f4")
    assert len(expected) == 16 and got["usage"]["prompt_tokens"] == 4
    torch.testing.assert_close(torch.from_numpy(decoded.copy()), torch.tensor(expected), atol=2e-5, rtol=1e-4)
    embedding_server.wait_idle()


def test_chat_messages_are_the_rendered_prompt(embedding_server):
    """vLLM's chat form of /v1/embeddings and /pooling: messages rendered by the chat template (by
    default without a generation prompt, and without the tokenizer's special tokens) embed as the
    rendered prompt's tokens do, as /tokenize renders them, or the text continue_final_message cuts."""
    messages = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat on"}]

    def tokens(**fields) -> list[int]:
        return post(embedding_server, "/tokenize", {"messages": messages} | fields).json()["tokens"]

    def embedding(path: str, body: dict) -> torch.Tensor:
        response = post(embedding_server, path, body)
        assert response.status_code == 200, response.text
        item = response.json()["data"][0]
        return torch.tensor(item["embedding"] if path == "/v1/embeddings" else item["data"])

    plain = tokens(add_generation_prompt=False)
    assert plain != tokens(add_generation_prompt=False, add_special_tokens=True)     # the test tells them apart
    for fields, prompt in [({}, plain),
                           ({"add_generation_prompt": True}, tokens()),
                           ({"add_special_tokens": True}, tokens(add_generation_prompt=False, add_special_tokens=True)),
                           ({"continue_final_message": True},
                            "<|im_start|>user\nthe cat<|im_end|>\n<|im_start|>assistant\nsat on")]:
        expected = embedding("/v1/embeddings", {"input": prompt, "add_special_tokens": False})
        for path in ("/v1/embeddings", "/pooling"):
            torch.testing.assert_close(embedding(path, {"messages": messages} | fields), expected, atol=2e-5, rtol=1e-4)
    usage = post(embedding_server, "/v1/embeddings", {"messages": messages}).json()["usage"]
    assert usage["prompt_tokens"] == len(plain)
    embedding_server.wait_idle()


@pytest.mark.parametrize("route,body,match", [
    ("/v1/embeddings", {"input": "a", "messages": [{"role": "user", "content": "a"}]}, "not both"),
    ("/pooling", {}, "give either input or messages"),
    ("/v1/embeddings", {"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": True,
                        "continue_final_message": True}, "cannot both be true"),
    ("/v1/embeddings", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text content parts"),
    ("/pooling", {"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": {"messages": []}},
     "may not set"),
    # As vLLM's pooling chat requests: a request's own template needs --trust-request-chat-template.
    ("/v1/embeddings", {"messages": [{"role": "user", "content": "a"}], "chat_template": "{{ 1 }}"},
     "--trust-request-chat-template is not set"),
    ("/pooling", {"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
     "--trust-request-chat-template is not set"),
    ("/pooling", {"input": "a", "task": "classify"}, "not one this model does: it is an embedding model"),
    ("/pooling", {"input": "a", "task": "token_embed"}, "every token's output"),
    ("/pooling", {"input": "a", "use_activation": False}, "use_activation does not apply to embed"),
    ("/pooling", {"input": [[5, 6], [5, 10**6]]}, r"prompt 1"),
    ("/pooling", {"input": "a", "encoding_format": "int8"}, "encoding_format"),
])
def test_bad_pooling_and_chat_requests(embedding_server, route, body, match):
    response = post(embedding_server, route, body)
    assert response.status_code == 400, response.text
    assert re.search(match, response.json()["error"]["message"]), response.text
    embedding_server.check_idle_and_alive()


def test_an_embedding_server_refuses_generation_and_a_generating_one_embeddings(embedding_server, served):
    response = httpx.post(embedding_server.base_url + "/v1/completions", json={"model": MODEL_NAME, "prompt": [5, 6], "max_tokens": 2},
                          timeout=30)
    assert response.status_code == 400 and "/v1/embeddings" in response.json()["error"]["message"]
    for path, body in [("/v1/embeddings", {"input": [5, 6]}), ("/pooling", {"input": [5, 6]}),
                       ("/score", {"text_1": [5], "text_2": [6]}),
                       ("/rerank", {"query": [5], "documents": [[6]]})]:
        response = httpx.post(served.base_url + path, json=body, timeout=30)
        assert response.status_code == 400 and "--runner pooling" in response.json()["error"]["message"]


def test_score_and_rerank(embedding_server, tiny_model):
    """vLLM's /score and /rerank on an embedding model: the cosine similarity of the embeddings."""
    url = embedding_server.base_url
    query, docs = [5, 6, 7, 8], [[9, 10, 11], [5, 6, 7], [40, 41, 42, 43, 44]]
    expected = [torch.nn.functional.cosine_similarity(hf_embedding(tiny_model, query), hf_embedding(tiny_model, d),
                                                      dim=0).item() for d in docs]
    scores = httpx.post(url + "/score", json={"text_1": query, "text_2": docs}, timeout=30).json()
    assert [d["score"] for d in scores["data"]] == pytest.approx(expected, abs=1e-5)
    assert [d["index"] for d in scores["data"]] == [0, 1, 2] and scores["usage"]["prompt_tokens"] == 15
    pairs = httpx.post(url + "/v1/score", json={"text_1": docs, "text_2": docs}, timeout=30).json()
    assert [d["score"] for d in pairs["data"]] == pytest.approx([1.0, 1.0, 1.0], abs=1e-5)
    ranked = httpx.post(url + "/v1/rerank", json={"query": query, "documents": docs, "top_n": 2}, timeout=30).json()
    order = sorted(range(3), key=lambda i: -expected[i])[:2]
    assert [r["index"] for r in ranked["results"]] == order
    assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx([expected[i] for i in order], abs=1e-5)
    texts = httpx.post(url + "/rerank", json={"query": "a cat", "documents": ["a dog", "the cat"]}, timeout=30).json()
    assert sorted(r["document"]["text"] for r in texts["results"]) == ["a dog", "the cat"]
    for path, body, match in [("/score", {"text_1": docs[:2], "text_2": docs}, "text_1 holds 2 texts"),
                              ("/rerank", {"query": query, "documents": []}, "documents is empty"),
                              ("/rerank", {"query": query, "documents": docs, "top_n": -1}, "top_n")]:
        response = httpx.post(url + path, json=body, timeout=30)
        assert response.status_code == 400 and match in response.json()["error"]["message"], response.text
    embedding_server.wait_idle()


def test_a_cross_encoder_server_scores_and_reranks_pairs(tiny_model, tmp_path):
    """Started as vLLM serves Qwen3-Reranker (classifier_from_token), /score and /rerank score each
    query and document read as one prompt; /v1/embeddings is refused."""
    tokens = classifier_tokens(tiny_model)
    options = ("--runner", "pooling", "--hf-overrides", json.dumps({"classifier_from_token": tokens}))
    query, docs = "the cat sat", ["a dog", "on the mat", "the cat sat on the mat"]
    prompts = [Tokenizer.from_file(f"{tiny_model}/tokenizer.json").encode(query, d).ids for d in docs]
    expected = [hf_pair_score(tiny_model, prompt, tokens) for prompt in prompts]
    with launched_server(tiny_model, tmp_path, options=options) as server:
        scores = httpx.post(server.base_url + "/score", json={"text_1": query, "text_2": docs}, timeout=30).json()
        assert [d["score"] for d in scores["data"]] == pytest.approx(expected, abs=1e-5)
        assert scores["usage"]["prompt_tokens"] == sum(map(len, prompts))
        ranked = httpx.post(server.base_url + "/rerank", json={"query": query, "documents": docs}, timeout=30).json()
        assert [r["index"] for r in ranked["results"]] == sorted(range(3), key=lambda i: -expected[i])
        pooled = httpx.post(server.base_url + "/pooling", json={"input": prompts}, timeout=30).json()
        assert [d["data"] for d in pooled["data"]] == [pytest.approx([score], abs=1e-5) for score in expected]
        refused = httpx.post(server.base_url + "/v1/embeddings", json={"input": query}, timeout=30)
        assert refused.status_code == 400 and "cross-encoder" in refused.json()["error"]["message"]
        server.wait_idle()
