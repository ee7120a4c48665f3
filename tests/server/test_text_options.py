"""vLLM's text options as extra body fields of /v1/completions and /v1/chat/completions:
skip_special_tokens, spaces_between_special_tokens and truncate_prompt_tokens, against LLM.generate
with the same SamplingParams (streamed or not), usage counting the truncated prompt, and bad values
refused with a 400 that names the field."""
import httpx
import pytest

from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME
from tests.server.test_detokenizer import byte_tokens
from tests.server.test_openai_api import reference, stream_completion

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MESSAGES = [{"role": "user", "content": "Straße? 你好 🚀"}]


@pytest.fixture(scope="module")
def special_ids(llm):
    return [llm.tokenizer.token_to_id(t) for t in SPECIAL]


@pytest.fixture(scope="module")
def mixed(llm, special_ids):
    """Sampling parameters that force special tokens into the output, between bytes of multi-byte
    characters and ASCII: the engine's, and the request fields that say the same."""
    allowed = sorted(set(special_ids + byte_tokens(llm.tokenizer, "é你😀") + llm.tokenizer.encode("Hi there").ids))
    engine = dict(temperature=1.0, seed=0, max_tokens=32, ignore_eos=True, allowed_token_ids=allowed)
    request = dict(temperature=1.0, seed=0, max_tokens=32,
                   extra_body={"ignore_eos": True, "allowed_token_ids": allowed})
    return engine, request


def with_extra(request: dict, **extra) -> dict:
    return request | {"extra_body": request.get("extra_body", {}) | extra}


@pytest.mark.parametrize("skip", [None, True, False])
def test_skip_special_tokens_on_completions(served, client, llm, special_ids, mixed, skip):
    """The text as LLM.generate's with the same flag (absent: True, vLLM's default), streamed or
    not; the special tokens the output holds show only with false."""
    engine, request = mixed
    flag = {} if skip is None else {"skip_special_tokens": skip}
    ref_text, ref_ids, _ = reference(llm, "Hello", **engine, **flag)
    assert set(ref_ids) & set(special_ids), "the output should hold special tokens"
    assert ref_text == llm.tokenizer.decode(ref_ids, skip_special_tokens=skip is not False)
    full = client.completions.create(model=MODEL_NAME, prompt="Hello", **with_extra(request, **flag))
    text, _, _, _ = stream_completion(client, prompt="Hello", **with_extra(request, **flag))
    assert full.choices[0].text == text == ref_text
    assert ("<|im_end|>" in text or "<|im_start|>" in text or "<|endoftext|>" in text) == (skip is False)


def test_chat_skips_special_tokens_by_default(served, client, special_ids):
    """vLLM's chat default is true as well: an EOS kept by include_stop_str_in_output shows only
    with skip_special_tokens false (min_tokens holds it back for 2 tokens, then the bias forces it)."""
    eos = special_ids[2]
    params = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0, logit_bias={str(eos): 100})
    contents = {}
    for skip in (None, True, False):
        extra = {"min_tokens": 2, "include_stop_str_in_output": True} | (
            {} if skip is None else {"skip_special_tokens": skip})
        full = client.chat.completions.create(**params, extra_body=extra)
        chunks = list(client.chat.completions.create(**params, extra_body=extra, stream=True))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert full.choices[0].message.content == streamed and full.choices[0].finish_reason == "stop"
        assert full.usage.completion_tokens == 3
        contents[skip] = streamed
    assert contents[None] == contents[True] and not contents[True].endswith("<|im_end|>")
    assert contents[False] == contents[True] + "<|im_end|>"


@pytest.mark.parametrize("spaces", [True, False])
def test_spaces_between_special_tokens_accepted(served, client, llm, special_ids, spaces):
    """Accepted as vLLM's; with tokenizer.json it changes nothing (nor does it in vLLM's fast
    detokenizer): special tokens one after another, written as LLM.generate writes them."""
    engine = dict(temperature=1.0, seed=1, max_tokens=12, ignore_eos=True, allowed_token_ids=special_ids,
                  skip_special_tokens=False)
    ref_text, ref_ids, _ = reference(llm, "Hello", **engine)
    assert ref_text == "".join(SPECIAL[special_ids.index(t)] for t in ref_ids)
    r = client.completions.create(model=MODEL_NAME, prompt="Hello", temperature=1.0, seed=1, max_tokens=12,
                                  extra_body={"ignore_eos": True, "allowed_token_ids": special_ids,
                                              "skip_special_tokens": False, "spaces_between_special_tokens": spaces})
    assert r.choices[0].text == ref_text


@pytest.mark.parametrize("k", [1, 10])
def test_truncate_prompt_tokens_on_completions(served, client, llm, k):
    """The completion of the prompt's last k tokens (greedy: the same as LLM.generate's on the cut
    prompt), its usage counting those k, for token ids and for text."""
    ids = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog, twice over.").ids
    assert len(ids) > 10
    ref_text, _, _ = reference(llm, [ids[-k:]], temperature=0, max_tokens=8, ignore_eos=True)
    for prompt in (ids, llm.tokenizer.decode(ids)):
        params = dict(max_tokens=8, temperature=0, extra_body={"ignore_eos": True, "truncate_prompt_tokens": k})
        full = client.completions.create(model=MODEL_NAME, prompt=prompt, **params)
        text, _, usage, _ = stream_completion(client, prompt=prompt, **params)
        assert full.choices[0].text == text == ref_text
        assert full.usage.prompt_tokens == usage.prompt_tokens == k
        assert full.usage.total_tokens == k + 8
    whole, _, _ = reference(llm, [ids], temperature=0, max_tokens=8, ignore_eos=True)
    assert whole != ref_text


def test_truncation_lets_a_prompt_past_max_model_len_run(served, client, llm):
    """Cut before it is checked: a prompt longer than max_model_len is served; echoed, it is the
    tokens kept."""
    ids = [5 + i % 300 for i in range(MAX_MODEL_LEN + 30)]
    body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": 4, "temperature": 0}
    assert httpx.post(served.base_url + "/v1/completions", json=body, timeout=60).status_code == 400
    r = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=4, temperature=0, echo=True,
                                  extra_body={"truncate_prompt_tokens": 12})
    ref_text, _, _ = reference(llm, [ids[-12:]], temperature=0, max_tokens=4)
    assert r.usage.prompt_tokens == 12
    assert r.choices[0].text == llm.tokenizer.decode(ids[-12:], skip_special_tokens=False) + ref_text


def test_truncate_prompt_tokens_on_chat(served, client, llm):
    """The rendered conversation cut to its last k tokens; without max_tokens, the default fills
    what max_model_len leaves after the cut prompt."""
    rendered = httpx.post(served.base_url + "/tokenize", json={"model": MODEL_NAME, "messages": MESSAGES},
                          timeout=10).json()["tokens"]
    k = 6
    ref_text, _, _ = reference(llm, [rendered[-k:]], temperature=0, max_tokens=5, ignore_eos=True)
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True, "truncate_prompt_tokens": k})
    assert r.choices[0].message.content == ref_text and r.usage.prompt_tokens == k
    long = [{"role": "user", "content": "fox " * MAX_MODEL_LEN}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=long, temperature=0,
                                       extra_body={"ignore_eos": True, "truncate_prompt_tokens": MAX_MODEL_LEN - 3})
    assert r.usage.prompt_tokens == MAX_MODEL_LEN - 3 and r.usage.completion_tokens == 3
    assert r.choices[0].finish_reason == "length"


BAD = [
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "truncate_prompt_tokens must be"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "truncate_prompt_tokens must be"),
    ({"truncate_prompt_tokens": MAX_MODEL_LEN + 1}, "truncate_prompt_tokens",
     f"truncate_prompt_tokens={MAX_MODEL_LEN + 1} exceeds max_model_len={MAX_MODEL_LEN}"),
    ({"truncate_prompt_tokens": "ten"}, "truncate_prompt_tokens", "truncate_prompt_tokens"),
    ({"skip_special_tokens": "maybe"}, "skip_special_tokens", "skip_special_tokens"),
    ({"spaces_between_special_tokens": [1]}, "spaces_between_special_tokens", "spaces_between_special_tokens"),
    # vLLM's server does not take it either (its text is the response)
    ({"detokenize": False}, "detokenize", "detokenize is not a supported parameter"),
]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("fields, param, words", BAD, ids=[str(b[0]) for b in BAD])
def test_bad_values_are_a_400_naming_the_field(served, route, fields, param, words):
    body = {"model": MODEL_NAME, "max_tokens": 4} | (
        {"prompt": "Hello"} if route == "/v1/completions" else {"messages": MESSAGES}) | fields
    r = httpx.post(served.base_url + route, json=body, timeout=10)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["param"] == param, error

