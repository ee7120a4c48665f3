"""The server's LoRA adapters, as vLLM serves them: --lora-modules names adapters that a request's
`model` picks, /v1/models lists them, and what an adapter's request returns is what LLM.generate
gives with its LoRARequest (and not the base model's). One server for the file: it starts with
two adapters and the runtime routes (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)."""
import concurrent.futures
import json
import re
import time

import httpx
import pytest

from mini_engine import LLM, SamplingParams
from mini_engine.chat_template import ChatTemplate
from mini_engine.lora import LoRARequest
from mini_engine.serve import parse_args
from mini_engine.server.engine_process import EngineStats
from mini_engine.server.lora_modules import LoRAModulePath, parse_lora_module
from mini_engine.server.metrics import ServerMetrics
from tests.lora_reference import write_adapter
from tests.server.conftest import MODEL_NAME, NUM_KV_BLOCKS, launched_server

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Straße? 你好 🚀"}]
GREEDY = dict(max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
# A large alpha: the random pairs move greedy tokens, so that "equals the adapter's output" cannot
# pass by equalling the base model's.
ALPHA = 64


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> dict[str, LoRARequest]:
    """Two PEFT adapters, ids in --lora-modules' order: one of rank 4 on attention, one of rank 8
    on every projection."""
    root = tmp_path_factory.mktemp("lora-adapters")
    first = write_adapter(tiny_model, str(root / "first"), seed=1, targets=("q_proj", "v_proj", "o_proj"),
                          alpha=ALPHA)
    second = write_adapter(tiny_model, str(root / "second"), seed=2, r=8, alpha=ALPHA)
    return {"first": LoRARequest("first", 1, first), "second": LoRARequest("second", 2, second)}


@pytest.fixture(scope="module")
def lora_server(tiny_model, adapters, tmp_path_factory):
    second = json.dumps({"name": "second", "path": adapters["second"].lora_path, "base_model_name": "tiny-base"})
    options = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
               "--lora-modules", f"first={adapters['first'].lora_path}", second)
    with launched_server(tiny_model, tmp_path_factory.mktemp("lora-server-log"), options=options,
                         env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) as handle:
        yield handle
        handle.wait_idle()      # every request's KV blocks freed


@pytest.fixture(scope="module")
def client(lora_server):
    with lora_server.openai_client() as c:
        yield c


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, device="cpu", num_kv_blocks=NUM_KV_BLOCKS, enable_lora=True, max_loras=2, max_lora_rank=8)


def offline(llm, prompts: list, loras: list[LoRARequest | None]) -> list[str]:
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=GREEDY["max_tokens"], ignore_eos=True),
                           use_tqdm=False, lora_request=loras)
    return [out.outputs[0].text for out in outputs]


def test_models_lists_the_base_model_and_each_adapter(lora_server, client, adapters, tiny_model):
    cards = httpx.get(lora_server.base_url + "/v1/models").json()["data"]
    assert [(c["id"], c["root"], c["parent"]) for c in cards] == [
        (MODEL_NAME, tiny_model, None), ("first", adapters["first"].lora_path, MODEL_NAME),
        ("second", adapters["second"].lora_path, "tiny-base")]      # vLLM's base_model_name is the parent
    assert [m.id for m in client.models.list().data] == [MODEL_NAME, "first", "second"]


def test_adapter_completions_equal_llm_generate_and_differ_from_the_base(lora_server, client, llm, adapters):
    """Three requests at once, one of each adapter and one of the base model: a step mixes them
    (max_loras 2), and each is what LLM.generate gives with the same LoRARequest."""
    models = ["first", "second", MODEL_NAME]
    with concurrent.futures.ThreadPoolExecutor(len(models)) as pool:
        responses = list(pool.map(lambda m: client.completions.create(model=m, prompt=PROMPT, **GREEDY), models))
    want = offline(llm, [PROMPT] * 3, [adapters["first"], adapters["second"], None])
    assert [r.choices[0].text for r in responses] == want
    assert len(set(want)) == 3, "the adapters must change the greedy tokens, or this test proves nothing"
    assert [r.model for r in responses] == models           # the requested name, echoed


def test_streamed_chat_with_an_adapter(lora_server, client, llm, adapters, tiny_model):
    params = dict(model="second", messages=MESSAGES, **GREEDY)
    full = client.chat.completions.create(**params)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **params))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    prompt = ChatTemplate.from_pretrained(tiny_model).render(MESSAGES)
    want, base = offline(llm, [prompt, prompt], [adapters["second"], None])
    assert full.choices[0].message.content == text == want != base
    assert {c.model for c in chunks} == {full.model} == {"second"}
    assert chunks[-1].usage.completion_tokens == GREEDY["max_tokens"]


def test_unknown_model_is_a_404_in_openais_shape(lora_server):
    for path, body in [("/v1/completions", {"prompt": "a", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})]:
        r = httpx.post(lora_server.base_url + path, json={"model": "nope"} | body, timeout=30)
        error = r.json()["error"]
        assert r.status_code == 404 and error["type"] == "not_found_error" and error["param"] == "model"
        assert error["message"] == "The model `nope` does not exist."       # vLLM's words
    # /tokenize takes an adapter's name as the completions do (one tokenizer for all).
    r = httpx.post(lora_server.base_url + "/tokenize", json={"model": "first", "prompt": PROMPT})
    assert r.status_code == 200 and r.json()["count"] > 0


def test_adapters_load_and_unload_at_run_time(lora_server, client, llm, adapters, tmp_path):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: a loaded adapter is served under
    its name (its own id: the first adapter's files under another name give the first's tokens),
    refused where the engine cannot run it; an unloaded one is a 404 again."""
    url = lora_server.base_url

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(url + path, json=body, timeout=60)

    r = post("/v1/load_lora_adapter", {"lora_name": "third", "lora_path": adapters["first"].lora_path})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'third' added successfully."
    assert [m.id for m in client.models.list().data] == [MODEL_NAME, "first", "second", "third"]
    got = client.completions.create(model="third", prompt=PROMPT, **GREEDY)
    assert got.choices[0].text == offline(llm, [PROMPT], [adapters["first"]])[0] and got.model == "third"

    again = post("/v1/load_lora_adapter", {"lora_name": "first", "lora_path": adapters["first"].lora_path})
    assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
    missing = post("/v1/load_lora_adapter", {"lora_name": "fourth", "lora_path": str(tmp_path / "missing")})
    assert missing.status_code == 400 and "is not a folder" in missing.json()["error"]["message"]
    assert "fourth" not in [m.id for m in client.models.list().data]

    r = post("/v1/unload_lora_adapter", {"lora_name": "third"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'third' removed successfully."
    assert post("/v1/completions", {"model": "third", "prompt": "a", "max_tokens": 2}).status_code == 404
    gone = post("/v1/unload_lora_adapter", {"lora_name": "third"})
    assert gone.status_code == 404 and gone.json()["error"]["message"] == "The lora adapter 'third' cannot be found."


def test_lora_module_items_as_vllm_takes_them():
    assert parse_lora_module("sql=/a/b=c") == LoRAModulePath("sql", "/a/b=c")
    as_json = '{"name": "sql", "path": "/a", "base_model_name": "q"}'
    assert parse_lora_module(as_json) == LoRAModulePath("sql", "/a", "q")
    for bad in ["sql", "=/a", "sql=", '{"name": "sql"}', '{"name": "sql", "path": "/a", "rank": 4}', "{nope"]:
        with pytest.raises(ValueError):
            parse_lora_module(bad)


@pytest.mark.parametrize("argv, message", [
    (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "given more than once"),
    (["--enable-lora", "--served-model-name", "m", "--lora-modules", "m=/x"], "is the served model's name"),
    (["--enable-lora", "--lora-modules", "{bad"], "not valid JSON"),
])
def test_lora_options_are_checked_before_anything_starts(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_bad_adapter_stops_the_server_at_start_up(tiny_model, adapters, tmp_path):
    """Each --lora-modules adapter is read by the engine before the server is ready: a bad one is a
    start-up error that names it, not a failure of its first request."""
    options = ("--enable-lora", "--max-lora-rank", "4", "--lora-modules", f"first={adapters['first'].lora_path}",
               f"broken={tmp_path / 'nowhere'}")
    with pytest.raises(RuntimeError, match="cannot serve the LoRA adapter 'broken'.*is not a folder"):
        with launched_server(tiny_model, tmp_path, options=options):
            pass


# ---- vLLM's lora_requests_info gauge ----

def lora_info(metrics_text: str) -> list[tuple[dict[str, str], float]]:
    """Each lora_requests_info series of a /metrics text: its labels, and its value."""
    return [(dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))), float(m.group(2)))
            for m in re.finditer(r"^mini_engine:lora_requests_info\{([^}]*)\} (\S+)$", metrics_text, re.M)]


def test_lora_requests_info_names_running_and_waiting_adapters(tiny_model, adapters):
    """The engine's side (EngineStats.of) and the gauge's: with max_loras 2, a third adapter's
    request waits; the labels name the adapters as vLLM's do, the value is the update's time, and
    only the current series is shown. A server without LoRA has no such gauge."""
    assert lora_info(ServerMetrics("m").render().decode()) == []
    llm = LLM(tiny_model, device="cpu", num_kv_blocks=64, enable_lora=True, max_loras=2, max_lora_rank=8)
    engine = llm.engine
    third = LoRARequest("third", 3, adapters["first"].lora_path)
    for i, lora in enumerate([adapters["first"], None, adapters["second"], adapters["first"], third]):
        engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=4), request_id=str(i),
                           lora_request=lora)
    engine.step()
    stats = EngineStats.of(engine)
    assert (stats.running_lora_adapters, stats.waiting_lora_adapters) == (("first", "second"), ("third",))
    metrics = ServerMetrics("m", max_loras=2)
    metrics.engine(0).update_engine_state(stats)
    (labels, value), = lora_info(metrics.render().decode())
    assert labels == {"max_lora": "2", "waiting_lora_adapters": "third", "running_lora_adapters": "first,second"}
    assert abs(value - time.time()) < 60
    while engine.has_unfinished_requests():
        engine.step()
    metrics.engine(0).update_engine_state(EngineStats.of(engine))
    (labels, _), = lora_info(metrics.render().decode())
    assert labels == {"max_lora": "2", "waiting_lora_adapters": "", "running_lora_adapters": ""}


def test_lora_requests_info_on_the_server(lora_server):
    """Fed from the engine process: the streams' adapters while they run, none once idle."""
    with lora_server.openai_client() as client:
        streams = [client.completions.create(model=model, prompt=PROMPT, max_tokens=480, stream=True,
                                             extra_body={"ignore_eos": True}) for model in ("first", "second")]
        for stream in streams:
            for _, chunk in zip(range(3), stream):          # read a little: both are running
                assert chunk.choices[0].finish_reason is None
        (labels, value), = lora_info(httpx.get(lora_server.base_url + "/metrics", timeout=10).text)
        for stream in streams:
            stream.close()
    assert labels["max_lora"] == "2" and labels["waiting_lora_adapters"] == ""
    assert sorted(labels["running_lora_adapters"].split(",")) == ["first", "second"]
    assert abs(value - time.time()) < 60
    lora_server.wait_idle()
    (labels, _), = lora_info(httpx.get(lora_server.base_url + "/metrics", timeout=10).text)
    assert labels == {"max_lora": "2", "waiting_lora_adapters": "", "running_lora_adapters": ""}
