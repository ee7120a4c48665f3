"""Our jinja2 rendering of the checkpoint's chat template agrees with transformers'; a template
the user gives in its place (--chat-template, a trusted request's chat_template) renders instead."""
import json
import shutil
from pathlib import Path

import httpx
import pytest

from mini_engine import SamplingParams
from mini_engine.chat_template import ChatTemplate, continue_final_message
from tests.server.conftest import CHATML_TEMPLATE, MODEL_NAME, launched_server

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Größe? 你好 😀"},
    {"role": "assistant", "content": "Yes."},
    {"role": "user", "content": "And now?"},
]
# A template using what transformers adds to jinja2: loop controls, raise_exception, tojson, tokens.
RICH_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
    "{% if loop.index > 3 %}{% break %}{% endif %}"
    "  {{ m['role'] | upper }}: {{ m['content'] | tojson }}\n"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}{{ eos_token }}")


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, RICH_TEMPLATE])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_matches_transformers(tiny_model, template, add_generation_prompt):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=f"{tiny_model}/tokenizer.json",
                                              bos_token="<|endoftext|>", eos_token="<|im_end|>")
    ours = ChatTemplate(template, {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"})
    expected = hf.apply_chat_template(MESSAGES, chat_template=template, tokenize=False,
                                      add_generation_prompt=add_generation_prompt)
    assert ours.render(MESSAGES, add_generation_prompt) == expected


def test_from_pretrained_and_template_errors(tiny_model):
    template = ChatTemplate.from_pretrained(tiny_model)
    assert template.render(MESSAGES[:2]).endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="no tools"):
        ChatTemplate(RICH_TEMPLATE, {}).render([{"role": "tool", "content": "x"}])


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, CHATML_TEMPLATE.replace("message['content']",
                                                                                 "message['content'] | trim")])
@pytest.mark.parametrize("final", ["Yes, and", "  Yes, and  "])
def test_continue_final_message_matches_transformers(tiny_model, template, final):
    """The rendered chat cut after the last message's content (stripped where the template wrote
    it stripped), as transformers' continue_final_message cuts it."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=f"{tiny_model}/tokenizer.json")
    messages = MESSAGES[:2] + [{"role": "assistant", "content": final}]
    expected = hf.apply_chat_template(messages, chat_template=template, tokenize=False, continue_final_message=True)
    ours = ChatTemplate(template, {})
    assert continue_final_message(ours.render(messages, False), messages) == expected
    assert expected.rstrip().endswith("Yes, and") and "<|im_end|>" not in expected.split("assistant")[-1]
    for bad in ([{"role": "user", "content": ""}], []):
        with pytest.raises(ValueError, match="final message with text"):
            continue_final_message("x", bad)


# A template of the user's (not ChatML), and what it writes for MESSAGES[:2].
CUSTOM_TEMPLATE = ("{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
                   "{% if add_generation_prompt %}[ASSISTANT] {% endif %}")
CUSTOM_TEXT = "[SYSTEM] You are terse.\n[USER] Größe? 你好 😀\n[ASSISTANT] "
# A request's own: the checkpoint's special tokens are its variables too.
REQUEST_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
REQUEST_TEXT = "You are terse.<|im_end|>Größe? 你好 😀<|im_end|>"


def test_load_chat_template_reads_a_path_or_takes_a_template(tmp_path):
    """vLLM's --chat-template: a file's path, or (with {, } or a newline) the template itself;
    anything else is refused rather than rendered as plain text."""
    from mini_engine.chat_template import load_chat_template
    file = tmp_path / "custom.jinja"
    file.write_text(CUSTOM_TEMPLATE, encoding="utf-8")
    assert load_chat_template(str(file)) == CUSTOM_TEMPLATE == load_chat_template(CUSTOM_TEMPLATE)
    for bad in (str(tmp_path / "missing.jinja"), "chatml"):
        with pytest.raises(ValueError, match="looks like a file path"):
            load_chat_template(bad)
    with pytest.raises(ValueError, match="is text"):
        load_chat_template(3)


@pytest.mark.parametrize("template, match", [
    ("{% for m in messages %}", "does not compile"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{{ messages[0]['content'] + 1 }}", "TypeError"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
    ("{{ messages.__class__.__init__.__globals__ }}", "unsafe"),
])
def test_whatever_fails_in_a_template_is_a_value_error(template, match):
    """A template is code the user gives: its failures, compiling or rendering, are ValueErrors
    (the server's 400s), and the sandbox refuses Python's internals."""
    with pytest.raises(ValueError, match=match):
        ChatTemplate(template, {}).render(MESSAGES)


def test_from_pretrained_takes_a_template_in_place_of_the_checkpoints(tiny_model, tmp_path):
    """A template given in place of the checkpoint's renders with the checkpoint's special tokens; a
    checkpoint's chat_template.jinja wins over tokenizer_config.json's, as transformers reads it."""
    assert ChatTemplate.from_pretrained(tiny_model, REQUEST_TEMPLATE).render(MESSAGES[:2]) == REQUEST_TEXT
    transformers = pytest.importorskip("transformers")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((Path(tiny_model) / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text(CUSTOM_TEMPLATE, encoding="utf-8")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    expected = hf.apply_chat_template(MESSAGES[:2], tokenize=False, add_generation_prompt=True)
    assert ChatTemplate.from_pretrained(str(tmp_path)).render(MESSAGES[:2]) == expected == CUSTOM_TEXT


def test_serve_reads_and_compiles_chat_template_at_startup(tmp_path):
    """--chat-template is read and compiled as the options are parsed: a bad one stops the server
    before it loads the model."""
    from mini_engine.serve import parse_args
    file = tmp_path / "custom.jinja"
    file.write_text(CUSTOM_TEMPLATE, encoding="utf-8")
    args = parse_args(["--chat-template", str(file)])
    assert args.chat_template == CUSTOM_TEMPLATE and not args.trust_request_chat_template
    trusting = parse_args(["--chat-template", REQUEST_TEMPLATE, "--trust-request-chat-template"])
    assert trusting.chat_template == REQUEST_TEMPLATE and trusting.trust_request_chat_template
    for bad in (str(tmp_path / "missing.jinja"), "{% if %}"):
        with pytest.raises(SystemExit):
            parse_args(["--chat-template", bad])


# ---- a server started with --chat-template and --trust-request-chat-template ----

@pytest.fixture(scope="module")
def untemplated_model(tiny_model, tmp_path_factory) -> str:
    """The served checkpoint (the same weights and tokenizer) with no chat template of its own."""
    path = tmp_path_factory.mktemp("tiny-qwen3-untemplated")
    for file in Path(tiny_model).iterdir():
        shutil.copy(file, path / file.name)
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def templated_server(untemplated_model, tmp_path_factory):
    template_file = tmp_path_factory.mktemp("templates") / "custom.jinja"
    template_file.write_text(CUSTOM_TEMPLATE, encoding="utf-8")
    options = ("--chat-template", str(template_file), "--trust-request-chat-template", "--enable-prompt-tokens-details")
    with launched_server(untemplated_model, tmp_path_factory.mktemp("templated-server-log"), options=options) as s:
        yield s


def post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + route, json=body, timeout=60)


def test_the_servers_chat_template_serves_a_checkpoint_without_one(templated_server, llm):
    """--chat-template on a checkpoint with none: chat renders with it, so the answer is what
    LLM.generate gives for the text it writes, and /tokenize counts that text's tokens."""
    ids = llm.tokenizer.encode(CUSTOM_TEXT).ids
    expected = llm.generate(CUSTOM_TEXT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
    with templated_server.checked_client() as client:
        r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES[:2], max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == expected and r.usage.prompt_tokens == len(ids)
    assert post(templated_server, "/tokenize", {"messages": MESSAGES[:2]}).json()["tokens"] == ids


def test_a_trusted_requests_template_renders_its_chat(templated_server, llm, tiny_model):
    """With --trust-request-chat-template a request's chat_template (or chat_template_kwargs' one,
    as vLLM's) renders its messages, streamed or not, with /tokenize and continue_final_message
    too (against transformers' rendering of the same template)."""
    ids = llm.tokenizer.encode(REQUEST_TEXT).ids
    expected = llm.generate(REQUEST_TEXT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
    params = dict(model=MODEL_NAME, messages=MESSAGES[:2], max_tokens=8, temperature=0)
    with templated_server.checked_client() as client:
        for extra in ({"chat_template": REQUEST_TEMPLATE},
                      {"chat_template_kwargs": {"chat_template": REQUEST_TEMPLATE}}):
            r = client.chat.completions.create(**params, extra_body={"ignore_eos": True, **extra})
            assert r.choices[0].message.content == expected and r.usage.prompt_tokens == len(ids), extra
        chunks = client.chat.completions.create(**params, stream=True, extra_body={
            "ignore_eos": True, "chat_template": REQUEST_TEMPLATE})
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert post(templated_server, "/tokenize", {"messages": MESSAGES[:2], "chat_template": REQUEST_TEMPLATE}
                ).json()["tokens"] == ids
    prefilled = MESSAGES[:2] + [{"role": "assistant", "content": "Yes, and"}]
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=f"{tiny_model}/tokenizer.json", eos_token="<|im_end|>")
    continued = hf.apply_chat_template(prefilled, chat_template=REQUEST_TEMPLATE, tokenize=False,
                                       continue_final_message=True)
    assert continued.endswith("Yes, and")
    r = post(templated_server, "/tokenize", {"messages": prefilled, "chat_template": REQUEST_TEMPLATE,
                                             "add_generation_prompt": False, "continue_final_message": True})
    assert r.json()["tokens"] == llm.tokenizer.encode(continued).ids


@pytest.mark.parametrize("stream", [False, True])
def test_a_bad_request_template_is_a_400_and_the_server_lives_on(templated_server, stream):
    """A request's template that does not compile, or fails on its messages, is a 400 naming the
    field (before any stream starts); the server serves on."""
    for template, words in [("{% for m in messages %}", "does not compile"),
                            ("{{ raise_exception('no system messages') }}", "no system messages"),
                            ("{{ 1 / 0 }}", "ZeroDivisionError")]:
        body = {"model": MODEL_NAME, "messages": MESSAGES[:2], "max_tokens": 1, "chat_template": template,
                "stream": stream}
        r = post(templated_server, "/v1/chat/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
        assert words in r.json()["error"]["message"]
    r = post(templated_server, "/tokenize", {"messages": MESSAGES[:2], "chat_template": "{{ 1 / 0 }}"})
    assert r.status_code == 400 and "ZeroDivisionError" in r.json()["error"]["message"]
    templated_server.check_idle_and_alive()


def test_prompt_tokens_details_count_the_prefix_cache(templated_server, served):
    """--enable-prompt-tokens-details (on the templated server): usage says how many prompt tokens
    the prefix cache served, every whole 16-token block of the prompt but the one holding its last
    token the second time a prompt is sent, streamed or not; without the flag (the plain server)
    usage has no such field."""
    body = {"model": MODEL_NAME, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": "Count the cached blocks of this prompt, " * 4}]}
    post(templated_server, "/v1/chat/completions", body)
    usage = post(templated_server, "/v1/chat/completions", body).json()["usage"]
    prompt_tokens = usage["prompt_tokens"]
    assert prompt_tokens > 32 and usage["prompt_tokens_details"] == {"cached_tokens": (prompt_tokens - 1) // 16 * 16}
    chunks = httpx.post(templated_server.base_url + "/v1/chat/completions", timeout=60,
                        json=body | {"stream": True, "stream_options": {"include_usage": True}}).text
    last = json.loads([line for line in chunks.splitlines() if line.startswith("data: {")][-1][6:])
    assert last["usage"] == usage
    plain = post(served, "/v1/chat/completions", body | {"model": MODEL_NAME}).json()["usage"]
    assert "prompt_tokens_details" not in plain
