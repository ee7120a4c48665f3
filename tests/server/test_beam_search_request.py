"""vLLM's server-side beam search: /v1/completions and /v1/chat/completions with use_beam_search,
n the beam width and the n best beams the choices, best first. The server's beams for a prompt
are LLM.beam_search's for the same token ids and parameters (an offline LLM on the same checkpoint
in this process, at temperature 0): the same search (mini_engine/beam_search.py's BeamSearch),
its steps run through the engine process instead of generate().

The server and the LLM take as EOS a token the random model writes among its likeliest few
(hf_overrides), so that EOS ends some beams; the checkpoint's own never comes near the top. The
server runs Qwen3's output parsers, and its chat template opens a thought when asked
(think_in_prompt), so that the reasoning parser has each beam's text to split."""
import collections
import json
import socket
import threading
import time

import httpx
import pytest

from mini_engine import LLM, BeamSearchParams, SamplingParams
from mini_engine.chat_template import ChatTemplate
from mini_engine.reasoning import THINK_END, THINK_START
from mini_engine.server.protocol import ChatCompletionRequest, CompletionRequest
from tests.server.conftest import CHATML_TEMPLATE, MODEL_NAME, NUM_KV_BLOCKS, launched_server, write_tiny_model

PROMPTS = ["Hello world", "Größe 你好 😀"]
TOKEN_PROMPT = [5, 17, 300, 42, 7]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Straße? 你好 🚀"}]
MAX_TOKENS = 6
THINKING_CHATML = CHATML_TEMPLATE + \
    "{% if think_in_prompt is defined and think_in_prompt %}{{ '<think>\n' }}{% endif %}"
PARSERS = ("--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def beam_model(tmp_path_factory) -> str:
    """The served tiny model, its template able to open a thought."""
    return write_tiny_model(str(tmp_path_factory.mktemp("tiny-qwen3-beams")), THINKING_CHATML,
                            added_tokens=(THINK_START, THINK_END))     # the engine's qwen3 parser needs them


@pytest.fixture(scope="module")
def eos(beam_model) -> int:
    """The token most often second to fourth likeliest along the prompts' greedy paths."""
    plain = LLM(beam_model, num_kv_blocks=64)
    counts = collections.Counter()
    for prompt in PROMPTS + [TOKEN_PROMPT]:
        out = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                    logprobs=4), use_tqdm=False)[0].outputs[0]
        counts.update(token for step in out.logprobs for token, _ in step.top[1:])
    return counts.most_common(1)[0][0]


@pytest.fixture(scope="module")
def llm(beam_model, eos):
    return LLM(beam_model, num_kv_blocks=NUM_KV_BLOCKS, hf_overrides={"eos_token_id": eos})


@pytest.fixture(scope="module")
def beam_server(beam_model, eos, tmp_path_factory):
    with launched_server(beam_model, tmp_path_factory.mktemp("beam-server-log"),
                         options=("--hf-overrides", json.dumps({"eos_token_id": eos}), *PARSERS)) as handle:
        yield handle


@pytest.fixture
def served(beam_server):
    """The server, checked after the test: every KV block free, and still alive."""
    yield beam_server
    beam_server.check_idle_and_alive()


@pytest.fixture(scope="module")
def client(beam_server):
    with beam_server.openai_client() as c:
        yield c


def expected_choices(llm, prompt, params: BeamSearchParams) -> list[dict]:
    """LLM.beam_search's beams as the server's choices give them: the generated tokens (less the
    EOS that ended one, unless include_stop_str_in_output), their text, finish reason and logprobs."""
    ids = llm.engine.tokenize(prompt)
    (output,) = llm.beam_search([ids], params)
    choices = []
    for seq in output.sequences:
        shown = seq.tokens[len(ids):]
        if seq.finish_reason == "stop" and not params.include_stop_str_in_output:
            shown = shown[:-1]
        choices.append({"token_ids": shown, "text": llm.engine.tokenizer.decode(shown, skip_special_tokens=False),
                        "finish_reason": seq.finish_reason, "cum_logprob": seq.cum_logprob,
                        "logprobs": [lp.logprob for lp in seq.logprobs[:len(shown)]]})
    return choices


def beam_body(**fields) -> dict:
    return {"model": MODEL_NAME, "use_beam_search": True, "temperature": 0, **fields}


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


def token_text(llm, token_id: int) -> str:
    return llm.engine.tokenizer.decode([token_id], skip_special_tokens=False)


FINISHES = collections.Counter()        # over the comparisons: EOS must end some beams


@pytest.mark.parametrize("n, length_penalty", [(1, 1.0), (2, 1.0), (3, 1.0), (3, 0.0), (2, 2.0)])
def test_completions_are_llm_beam_search(served, llm, n, length_penalty):
    body = beam_body(prompt=PROMPTS, n=n, length_penalty=length_penalty, max_tokens=MAX_TOKENS, logprobs=2)
    r = post(served, "/v1/completions", body)
    assert r.status_code == 200, r.text
    got = r.json()
    params = BeamSearchParams(beam_width=n, max_tokens=MAX_TOKENS, length_penalty=length_penalty)
    want = [c for prompt in PROMPTS for c in expected_choices(llm, prompt, params)]
    assert [c["index"] for c in got["choices"]] == list(range(len(PROMPTS) * n))
    assert [c["text"] for c in got["choices"]] == [c["text"] for c in want]
    assert [c["finish_reason"] for c in got["choices"]] == [c["finish_reason"] for c in want]
    for choice, expected in zip(got["choices"], want):
        logprobs = choice["logprobs"]
        assert logprobs["tokens"] == [token_text(llm, t) for t in expected["token_ids"]]
        assert logprobs["token_logprobs"] == pytest.approx(expected["logprobs"], abs=1e-4)
        assert all(len(top) <= 3 for top in logprobs["top_logprobs"])     # the token and the best 2
        if expected["finish_reason"] == "length":
            assert sum(logprobs["token_logprobs"]) == pytest.approx(expected["cum_logprob"], abs=1e-4)
    # vLLM's usage: each prompt once, and the returned beams' tokens.
    assert got["usage"]["prompt_tokens"] == sum(len(llm.engine.tokenize(p)) for p in PROMPTS)
    assert got["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in want)
    FINISHES.update(c["finish_reason"] for c in want)


def test_eos_ended_some_beams():
    """The comparisons above are not vacuous (run after them)."""
    assert FINISHES["stop"] and FINISHES["length"], FINISHES


@pytest.mark.parametrize("include_stop_str_in_output, ignore_eos", [(True, False), (False, True)])
def test_include_stop_str_and_ignore_eos(served, llm, include_stop_str_in_output, ignore_eos):
    """The EOS that ended a beam is in its text and its token count with include_stop_str_in_output;
    under ignore_eos no beam ends before max_tokens."""
    r = post(served, "/v1/completions", beam_body(prompt=TOKEN_PROMPT, n=3, length_penalty=0.0, max_tokens=MAX_TOKENS,
                                                  include_stop_str_in_output=include_stop_str_in_output,
                                                  ignore_eos=ignore_eos))
    assert r.status_code == 200, r.text
    params = BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS, length_penalty=0.0, ignore_eos=ignore_eos,
                              include_stop_str_in_output=include_stop_str_in_output)
    want = expected_choices(llm, TOKEN_PROMPT, params)
    got = r.json()
    assert [(c["text"], c["finish_reason"]) for c in got["choices"]] == [(c["text"], c["finish_reason"]) for c in want]
    assert got["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in want)
    if ignore_eos:
        assert all(c["finish_reason"] == "length" for c in want)
        assert got["usage"]["completion_tokens"] == 3 * MAX_TOKENS
    else:
        assert any(c["finish_reason"] == "stop" for c in want), "no beam ended on EOS: the case is untested"


@pytest.mark.parametrize("n, length_penalty", [(1, 1.0), (2, 0.5), (3, 1.0)])
def test_chat_is_llm_beam_search_of_the_rendered_prompt(served, client, llm, beam_model, n, length_penalty):
    params = dict(model=MODEL_NAME, messages=MESSAGES, n=n, max_tokens=MAX_TOKENS, temperature=0,
                  extra_body={"use_beam_search": True, "length_penalty": length_penalty})
    full = client.chat.completions.create(**params)
    prompt = ChatTemplate.from_pretrained(beam_model).render(MESSAGES)
    want = expected_choices(llm, prompt, BeamSearchParams(beam_width=n, max_tokens=MAX_TOKENS,
                                                          length_penalty=length_penalty))
    assert [(c.index, c.message.role, c.message.content, c.finish_reason) for c in full.choices] == \
        [(k, "assistant", c["text"], c["finish_reason"]) for k, c in enumerate(want)]
    assert full.usage.prompt_tokens == len(llm.engine.tokenize(prompt))
    assert full.usage.completion_tokens == sum(len(c["token_ids"]) for c in want)

    # Streamed, as vLLM's: the finished beams whole, once the search is over, then the usage.
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **params))
    assert [c.delta.role for c in chunks[0].choices] == ["assistant"] * n
    texts, reasons = [""] * n, [None] * n
    for chunk in chunks[1:-1]:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert texts == [c.message.content for c in full.choices]
    assert reasons == [c.finish_reason for c in full.choices]
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_logprobs(served, client, llm, beam_model):
    full = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=2, max_tokens=MAX_TOKENS,
                                          temperature=0, logprobs=True, top_logprobs=3,
                                          extra_body={"use_beam_search": True})
    prompt = ChatTemplate.from_pretrained(beam_model).render(MESSAGES)
    for choice, expected in zip(full.choices, expected_choices(llm, prompt, BeamSearchParams(2, MAX_TOKENS))):
        content = choice.logprobs.content
        assert [c.token for c in content] == [token_text(llm, t) for t in expected["token_ids"]]
        assert [c.logprob for c in content] == pytest.approx(expected["logprobs"], abs=1e-4)
        assert all(len(c.top_logprobs) == 3 for c in content)


def test_output_parsers_take_each_beam(served, client, llm, beam_model):
    """As the chat path parses a completion: a prompt that opened a thought makes each beam's text
    reasoning (no </think> follows), and tools with tool_choice "auto" go through the tool call
    parser (which finds no call in it)."""
    kwargs = {"think_in_prompt": True}
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=2, max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"use_beam_search": True, "chat_template_kwargs": kwargs})
    prompt = ChatTemplate.from_pretrained(beam_model).render(MESSAGES, **kwargs)
    assert prompt.endswith("<think>\n")
    want = expected_choices(llm, prompt, BeamSearchParams(2, MAX_TOKENS))
    assert [(c.message.reasoning, c.message.content) for c in r.choices] == [(c["text"], None) for c in want]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=2, max_tokens=MAX_TOKENS, temperature=0,
                                       tools=tools, extra_body={"use_beam_search": True})
    want = expected_choices(llm, ChatTemplate.from_pretrained(beam_model).render(MESSAGES),
                            BeamSearchParams(2, MAX_TOKENS))
    assert [(c.message.content, c.message.tool_calls or []) for c in r.choices] == [(c["text"], []) for c in want]


def test_an_unset_temperature_is_the_default_one(served):
    """vLLM's: the checkpoint's generation_config default, else 1.0: the engine samples each beam's
    next token, which joins the candidates where it is not a top one."""
    body = beam_body(prompt=PROMPTS, n=2, max_tokens=MAX_TOKENS, ignore_eos=True)
    del body["temperature"]
    r = post(served, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert [c["finish_reason"] for c in r.json()["choices"]] == ["length"] * 4
    assert r.json()["usage"]["completion_tokens"] == 4 * MAX_TOKENS


def test_completions_do_not_stream_beam_search(served):
    """As vLLM's: a 400, not a stream."""
    r = post(served, "/v1/completions", beam_body(prompt="Hello", n=2, max_tokens=4, stream=True))
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "stream"
    assert "Streaming is not currently supported with beam search" in r.json()["error"]["message"]


@pytest.mark.parametrize("path, fields, param", [
    ("/v1/completions", dict(n=0), "n"),
    ("/v1/completions", dict(n=11), "n"),                   # 22 candidates a step, over max_logprobs=20
    ("/v1/completions", dict(max_tokens=0), "max_tokens"),
    ("/v1/chat/completions", dict(max_completion_tokens=0), "max_completion_tokens"),
    ("/v1/completions", dict(temperature=-1), "temperature"),
    ("/v1/completions", dict(top_p=0.5), "top_p"),
    ("/v1/completions", dict(stop=["x"]), "stop"),
    ("/v1/completions", dict(seed=1), "seed"),
    ("/v1/completions", dict(echo=True), "echo"),
    ("/v1/completions", dict(n=2, logprobs=5), "logprobs"),   # more than the 4 candidates a step
    ("/v1/chat/completions", dict(n=1, logprobs=True, top_logprobs=3), "top_logprobs"),
    ("/v1/chat/completions", dict(response_format={"type": "json_object"}), "response_format"),
    ("/v1/completions", dict(max_tokens=600), "prompt"),     # past max_model_len=512
    ("/v1/completions", dict(use_beam_search=False, length_penalty=0.5), "length_penalty"),
])
def test_bad_beam_search_requests_are_400s_that_name_the_field(served, path, fields, param):
    body = beam_body(max_tokens=4) | fields
    body |= {"prompt": "Hello"} if path == "/v1/completions" else {"messages": MESSAGES}
    r = post(served, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_neutral_values_of_the_fields_beam_search_ignores_are_accepted():
    """A client that sends every field sends them at their neutral values."""
    neutral = dict(top_p=1.0, top_k=-1, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                   min_tokens=0, stop=[], stop_token_ids=[], bad_words=[], logit_bias={},
                   response_format={"type": "text"})
    assert CompletionRequest(model="m", prompt="Hi", use_beam_search=True, echo=False, **neutral) \
        .beam_search_ignores() is None
    assert ChatCompletionRequest(model="m", messages=MESSAGES, use_beam_search=True, tool_choice="none",
                                 tools=[{"function": {"name": "f"}}], **neutral).beam_search_ignores() is None
    assert ChatCompletionRequest(model="m", messages=MESSAGES, tool_choice="required",
                                 tools=[{"function": {"name": "f"}}]).beam_search_ignores() == "tool_choice"


def test_a_client_that_leaves_mid_search_stops_it_and_frees_its_blocks(served, llm):
    """The step's requests are aborted and no more steps run, while another search beside it goes
    on to its own answer."""
    long_search = json.dumps(beam_body(prompt="Nobody waits for this", n=3, max_tokens=400, ignore_eos=True)).encode()
    host, port = served.base_url.removeprefix("http://").split(":")

    def counts(metrics):
        finished = {k.rsplit(":", 1)[1]: v for k, v in metrics.items()
                    if k.startswith("mini_engine:request_success_total:")}
        return finished, metrics["mini_engine:generation_tokens_total"]

    # The client leaves once its search is running (a fixed timeout could fire before a loaded
    # server had started it, leaving nothing to abort). One that leaves just as a step ends has no
    # request to abort (the next step never starts): a few tries see one that leaves mid-step.
    for attempt in range(3):
        finished_before, generated_before = counts(served.metrics())
        with socket.create_connection((host, int(port))) as leaver:
            leaver.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(long_search), long_search))
            deadline = time.monotonic() + 60
            while counts(served.metrics())[1] - generated_before < 3:        # a few of its steps done
                assert time.monotonic() < deadline, "the search never started"
                time.sleep(0.01)
            if attempt == 0:
                other = threading.Thread(target=lambda: results.append(
                    post(served, "/v1/completions", beam_body(prompt=PROMPTS[0], n=2, max_tokens=MAX_TOKENS))))
                results = []
                other.start()
                time.sleep(0.2)     # both searches run side by side
        # (the socket is closed: the client has left)
        if attempt == 0:
            other.join(timeout=60)
            r = results[0]
            assert r.status_code == 200, r.text
            want = expected_choices(llm, PROMPTS[0], BeamSearchParams(beam_width=2, max_tokens=MAX_TOKENS))
            assert [c["text"] for c in r.json()["choices"]] == [c["text"] for c in want]
        finished, generated = counts(served.wait_idle())
        time.sleep(0.3)
        assert counts(served.metrics())[0] == finished, "the search went on after its client left"
        assert generated - generated_before < 3 * 400
        if finished.get("abort", 0) > finished_before.get("abort", 0):
            break
    else:
        raise AssertionError("no step's requests were aborted")
