"""What a vLLM user deploying the server sets, as vLLM's flags do it (vllm/entrypoints/openai/
cli_args.py, api_server.py): API keys (--api-key, VLLM_API_KEY), CORS (--allowed-origins ...),
TLS (--ssl-*), GET /version, SageMaker's /ping and /invocations, and --return-tokens-as-token-ids
(and the request field of that name)."""
import datetime
import inspect
import re
import ssl
from types import SimpleNamespace

import httpx
import openai
import pytest
import uvicorn

import mini_engine
import mini_engine.server.app as app_module
from mini_engine import serve
from mini_engine.server.serving_options import ServingOptions
from mini_engine.tokenizer import load_tokenizer
from tests.server.conftest import MODEL_NAME, launched_server
from tests.server.test_embeddings_api import embedding_server  # noqa: F401 (a fixture)

KEYS = ("key-one", "key-two")
ORIGIN = "https://app.example"
# The flags of a server deployed as vLLM's would be, with VLLM_API_KEY set too: --api-key wins.
DEPLOYED = ("--api-key", *KEYS, "--allowed-origins", f'["{ORIGIN}"]', "--allowed-methods", '["GET", "POST"]',
            "--allow-credentials", "--return-tokens-as-token-ids")
ENV_KEY = "key-from-env"
GREEDY = {"temperature": 0, "max_tokens": 6}


@pytest.fixture(scope="module")
def deployed(tiny_model, tmp_path_factory):
    with launched_server(tiny_model, tmp_path_factory.mktemp("deployed-server-log"), options=DEPLOYED,
                         env={"VLLM_API_KEY": ENV_KEY}) as handle:
        yield handle


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def post(server, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=60)


def preflight(server, origin: str, method: str = "POST") -> httpx.Response:
    return httpx.options(server.base_url + "/v1/completions", timeout=10,
                         headers={"Origin": origin, "Access-Control-Request-Method": method,
                                  "Access-Control-Request-Headers": "authorization, content-type"})


COMPLETION = {"model": MODEL_NAME, "prompt": "Hello", "ignore_eos": True, **GREEDY}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}], "ignore_eos": True, **GREEDY}


# ---- API keys ----

@pytest.mark.parametrize("headers", [None, bearer("wrong"), {"Authorization": f"Basic {KEYS[0]}"}, bearer(ENV_KEY),
                                     bearer(KEYS[0][:-1])], ids=["none", "wrong", "not-bearer", "env", "prefix"])
def test_a_request_without_a_key_the_server_holds_is_a_401(deployed, headers):
    for r in (post(deployed, "/v1/completions", COMPLETION, headers),
              httpx.get(deployed.base_url + "/v1/models", headers=headers, timeout=10)):
        assert r.status_code == 401, r.text
        assert r.headers["www-authenticate"] == "Bearer"
        error = r.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
        assert "Authorization: Bearer" in error["message"]


def test_each_key_is_let_through(deployed):
    """vLLM's --api-key takes several keys (to rotate them), each accepted."""
    for key in KEYS:
        r = post(deployed, "/v1/completions", COMPLETION, bearer(key))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
    with deployed.openai_client(api_key=KEYS[1]) as client:
        assert [m.id for m in client.models.list()] == [MODEL_NAME]
    with deployed.openai_client(api_key="wrong") as client, pytest.raises(openai.AuthenticationError):
        client.models.list()
    deployed.check_idle_and_alive()


def test_probes_version_metrics_and_docs_stay_open_the_rest_is_guarded(deployed):
    """Newer vLLM's PUBLIC_ENDPOINTS (its AuthenticationMiddleware's): every other route needs a
    key, /invocations (the same inference as /v1) and /tokenize too."""
    url = deployed.base_url
    for r in (httpx.get(url + "/health"), httpx.get(url + "/ping"), httpx.post(url + "/ping"),
              httpx.get(url + "/version"), httpx.get(url + "/metrics"), httpx.get(url + "/openapi.json")):
        assert r.status_code == 200, r.url
    for path, body in (("/invocations", COMPLETION), ("/tokenize", {"prompt": "Hello"})):
        assert post(deployed, path, body).status_code == 401, path
        assert post(deployed, path, body, bearer(KEYS[0])).status_code == 200, path


def test_options_without_a_key_is_no_401_and_no_data(deployed):
    """As vLLM's middleware: OPTIONS passes the key check (a browser's preflight is CORS's, answered
    before it); a bare one reaches the routes, which answer it with nothing but a 405."""
    r = httpx.options(deployed.base_url + "/v1/completions", timeout=10)
    assert r.status_code == 405, r.text
    assert "choices" not in r.text


def test_vllm_api_key_in_the_environment_is_the_key_without_the_flag(tiny_model, tmp_path):
    with launched_server(tiny_model, tmp_path, env={"VLLM_API_KEY": ENV_KEY}) as server:
        assert httpx.get(server.base_url + "/v1/models", timeout=10).status_code == 401
        assert httpx.get(server.base_url + "/v1/models", headers=bearer(ENV_KEY), timeout=10).status_code == 200
        assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200


# ---- CORS ----

def test_cors_answers_the_allowed_origin_alone(deployed):
    allowed = preflight(deployed, ORIGIN)       # no key: a browser's preflight never carries one
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    assert allowed.headers["access-control-allow-credentials"] == "true"
    assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
    refused = preflight(deployed, "https://elsewhere.example")
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    assert preflight(deployed, ORIGIN, "DELETE").status_code == 400     # --allowed-methods '["GET", "POST"]'
    # The actual requests: the answer names the origin, a 401's too (so a browser can read it).
    for key in (KEYS[0], "wrong"):
        r = httpx.get(deployed.base_url + "/v1/models", headers={"Origin": ORIGIN} | bearer(key), timeout=10)
        assert r.headers["access-control-allow-origin"] == ORIGIN, r.status_code
    r = httpx.get(deployed.base_url + "/v1/models", headers={"Origin": "https://elsewhere.example"} | bearer(KEYS[0]))
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_allows_every_origin_by_default(served):
    r = preflight(served, "https://anywhere.example")
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


# ---- /version, /ping, /invocations ----

def test_version_and_ping(served):
    assert httpx.get(served.base_url + "/version").json() == {"version": mini_engine.__version__}
    for r in (httpx.get(served.base_url + "/ping"), httpx.post(served.base_url + "/ping")):
        assert r.status_code == 200 and r.content == b""


def without_ids(body: dict) -> dict:
    return {key: value for key, value in body.items() if key not in ("id", "created")}


def test_invocations_sends_a_chat_or_a_completion_body_to_its_endpoint(served):
    for body, path, kind in ((CHAT, "/v1/chat/completions", "chat.completion"),
                             (COMPLETION, "/v1/completions", "text_completion")):
        via = post(served, "/invocations", body)
        assert via.status_code == 200, via.text
        assert via.json()["object"] == kind
        assert without_ids(via.json()) == without_ids(post(served, path, body).json())
    # The endpoint's own refusal comes back as it is.
    r = post(served, "/invocations", COMPLETION | {"logprobs": 99})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


@pytest.mark.parametrize("body", [{"model": MODEL_NAME, "input": "an embedding's body"}, {"nothing": "known"}, [1, 2]])
def test_invocations_refuses_a_body_of_no_shape_this_server_serves(served, body):
    r = post(served, "/invocations", body)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == ("Cannot find suitable handler for request. Expected one of: "
                                            "['ChatCompletionRequest', 'CompletionRequest']")
    r = httpx.post(served.base_url + "/invocations", content=b"{not json", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("JSON decode error")


def test_invocations_on_a_pooling_server(embedding_server):  # noqa: F811 (the imported fixture)
    embedding = {"input": "the cat sat on the mat", "encoding_format": "float"}
    via = post(embedding_server, "/invocations", embedding)
    assert via.status_code == 200, via.text
    direct = post(embedding_server, "/v1/embeddings", embedding).json()
    assert via.json()["object"] == direct["object"] == "list"
    # The same up to float rounding, as test_embeddings_api compares two requests' embeddings.
    assert via.json()["data"][0]["embedding"] == pytest.approx(direct["data"][0]["embedding"], abs=1e-5)
    score = {"text_1": "the cat", "text_2": ["a dog", "the cat"]}
    scores = [[d["score"] for d in post(embedding_server, path, score).json()["data"]] for path in ("/invocations",
                                                                                              "/score")]
    assert scores[0] == pytest.approx(scores[1], abs=1e-5) and len(scores[0]) == 2
    r = post(embedding_server, "/invocations", COMPLETION)
    assert r.status_code == 400 and "['EmbeddingRequest', 'RerankRequest', 'ScoreRequest', 'PoolingRequest']" in \
        r.json()["error"]["message"]
    embedding_server.wait_idle()


# ---- return_tokens_as_token_ids ----

def named_text(tokenizer, name: str) -> str:
    """The text of the token a "token_id:{id}" name names."""
    match = re.fullmatch(r"token_id:(\d+)", name)
    assert match, name
    return tokenizer.decode([int(match.group(1))], skip_special_tokens=False)


def completion_logprobs(client, stream: bool, **extra) -> dict[str, list]:
    """A greedy completion's logprobs, a stream's chunks joined."""
    kwargs = dict(model=MODEL_NAME, prompt="Hello", logprobs=2, extra_body={"ignore_eos": True, **extra}, **GREEDY)
    keys = ("tokens", "token_logprobs", "top_logprobs")
    if not stream:
        logprobs = client.completions.create(**kwargs).choices[0].logprobs
        return {key: getattr(logprobs, key) for key in keys}
    joined = {key: [] for key in keys}
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for key in keys:
                joined[key] += getattr(choice.logprobs, key) if choice.logprobs else []
    return joined


def chat_logprobs(client, stream: bool, **extra) -> list:
    kwargs = dict(model=MODEL_NAME, messages=CHAT["messages"], logprobs=True, top_logprobs=2,
                  extra_body={"ignore_eos": True, **extra}, **GREEDY)
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0].logprobs.content
    return [entry for chunk in client.chat.completions.create(stream=True, **kwargs) for choice in chunk.choices
            if choice.logprobs for entry in choice.logprobs.content]


def assert_completion_names(tokenizer, by_id: dict, by_text: dict) -> None:
    assert [named_text(tokenizer, t) for t in by_id["tokens"]] == by_text["tokens"]
    assert by_id["token_logprobs"] == by_text["token_logprobs"]
    assert [{named_text(tokenizer, t): v for t, v in top.items()} for top in by_id["top_logprobs"]] == \
        by_text["top_logprobs"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_return_tokens_as_token_ids_names_completion_and_chat_tokens_by_id(served, tiny_model, stream):
    tokenizer = load_tokenizer(tiny_model)
    with served.openai_client() as client:
        assert_completion_names(tokenizer, completion_logprobs(client, stream, return_tokens_as_token_ids=True),
                                completion_logprobs(client, stream))
        by_id, by_text = chat_logprobs(client, stream, return_tokens_as_token_ids=True), chat_logprobs(client, stream)
    assert len(by_id) == len(by_text) == 6
    for named, plain in zip(by_id, by_text):
        # As vLLM's: bytes are the name's own, the logprobs unchanged.
        assert (named_text(tokenizer, named.token), named.logprob) == (plain.token, plain.logprob)
        assert named.bytes == list(named.token.encode())
        assert [(named_text(tokenizer, top.token), top.logprob) for top in named.top_logprobs] == \
            [(top.token, top.logprob) for top in plain.top_logprobs]
        assert all(top.bytes == list(top.token.encode()) for top in named.top_logprobs)
    served.check_idle_and_alive()


def test_an_echoed_prompts_tokens_are_named_by_id_too(served, tiny_model):
    prompt_ids = load_tokenizer(tiny_model).encode("Hello", add_special_tokens=False).ids
    out = post(served, "/v1/completions", COMPLETION | {"echo": True, "logprobs": 1, "max_tokens": 2,
                                                        "return_tokens_as_token_ids": True}).json()
    tokens = out["choices"][0]["logprobs"]["tokens"]
    assert tokens[:len(prompt_ids)] == [f"token_id:{t}" for t in prompt_ids] and len(tokens) == len(prompt_ids) + 2


def test_the_servers_flag_is_the_default_a_request_overrides(deployed, tiny_model):
    tokenizer = load_tokenizer(tiny_model)
    with deployed.openai_client(api_key=KEYS[0]) as client:
        assert_completion_names(tokenizer, completion_logprobs(client, False),
                                completion_logprobs(client, False, return_tokens_as_token_ids=False))
        assert all(entry.token.startswith("token_id:") for entry in chat_logprobs(client, True))
    deployed.check_idle_and_alive()


# ---- the command line ----

def test_the_flags_parse_as_vllms(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert serve.serving_options(serve.parse_args([])) == ServingOptions()
    args = serve.parse_args(["--api-key", "a", "--allowed-headers", '["Authorization"]', "--api-key", "b"])
    options = serve.serving_options(args)
    assert (options.api_keys, options.allowed_headers, options.allowed_origins) == (("a", "b"), ("Authorization",),
                                                                                   ("*",))
    monkeypatch.setenv("VLLM_API_KEY", ENV_KEY)
    assert serve.serving_options(serve.parse_args([])).api_keys == (ENV_KEY,)
    assert serve.serving_options(args).api_keys == ("a", "b")
    monkeypatch.setenv("VLLM_API_KEY", "")          # an empty key is no key, as vLLM's
    assert serve.serving_options(serve.parse_args([])).api_keys == ()
    for bad in (["--allowed-origins", "*"], ["--allowed-methods", '{"GET": 1}'], ["--ssl-keyfile", "key.pem"]):
        with pytest.raises(SystemExit):
            serve.parse_args(bad)


def test_main_gives_the_options_to_the_app_and_tls_to_uvicorn(tiny_model, monkeypatch):
    built, ran = {}, {}

    def build_app(config, name, parsers, lora_modules, options):
        built["options"] = options
        engine = SimpleNamespace(limits=SimpleNamespace(num_blocks=8, block_size=16, max_model_len=512))
        return SimpleNamespace(state=SimpleNamespace(server=SimpleNamespace(async_engine=engine)))

    monkeypatch.setattr(app_module, "build_app", build_app)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: ran.update(kwargs))
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    serve.main(["--model", tiny_model, "--port", "8123", *DEPLOYED, "--ssl-keyfile", "key.pem", "--ssl-certfile",
                "cert.pem", "--ssl-ca-certs", "ca.pem", "--ssl-cert-reqs", "2"])
    assert built["options"] == ServingOptions(
        return_tokens_as_token_ids=True, api_keys=KEYS, allowed_origins=(ORIGIN,), allowed_methods=("GET", "POST"),
        allow_credentials=True, ssl_keyfile="key.pem", ssl_certfile="cert.pem", ssl_ca_certs="ca.pem",
        ssl_cert_reqs=ssl.CERT_REQUIRED)
    assert {key: ran[key] for key in ("port", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs")} == \
        {"port": 8123, "ssl_keyfile": "key.pem", "ssl_certfile": "cert.pem", "ssl_ca_certs": "ca.pem",
         "ssl_cert_reqs": ssl.CERT_REQUIRED}
    assert set(ran) <= set(inspect.signature(uvicorn.Config).parameters)


def test_the_tls_options_make_uvicorns_ssl_context(tmp_path):
    """With a throwaway self-signed certificate, which serves as its own CA."""
    pytest.importorskip("cryptography")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                         serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    args = serve.parse_args(["--ssl-keyfile", str(tmp_path / "key.pem"), "--ssl-certfile", str(tmp_path / "cert.pem"),
                             "--ssl-ca-certs", str(tmp_path / "cert.pem"), "--ssl-cert-reqs", "2"])
    async def app(scope, receive, send):
        pass

    config = uvicorn.Config(app, **serve.serving_options(args).uvicorn_options())
    config.load()
    assert isinstance(config.ssl, ssl.SSLContext) and config.ssl.verify_mode == ssl.CERT_REQUIRED
