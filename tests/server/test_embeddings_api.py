"""/v1/embeddings on a server started with --runner pooling, through OpenAI's own client (which asks
for base64 unless told otherwise), against transformers' hidden states; what it refuses."""
import re

import httpx
import openai
import pytest
import torch

from tests.engine.test_embeddings import hf_embedding, write_embedding_checkpoint
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


def test_an_embedding_server_refuses_generation_and_a_generating_one_embeddings(embedding_server, served):
    response = httpx.post(embedding_server.base_url + "/v1/completions", json={"model": MODEL_NAME, "prompt": [5, 6], "max_tokens": 2},
                          timeout=30)
    assert response.status_code == 400 and "/v1/embeddings" in response.json()["error"]["message"]
    response = httpx.post(served.base_url + "/v1/embeddings", json={"input": [5, 6]}, timeout=30)
    assert response.status_code == 400 and "--runner pooling" in response.json()["error"]["message"]
