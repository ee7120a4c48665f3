"""The server through the official openai client: completions and chat, streamed and not,
against each other and against LLM.generate; stop strings, stop tokens, logprobs, seeds."""
import base64
import io
import itertools
import json
import re

import httpx
import pytest
import torch

from mini_engine import SamplingParams
from mini_engine.chat_template import ChatTemplate
from tests.server.conftest import CHATML_TEMPLATE, MODEL_NAME, NUM_KV_BLOCKS, launched_server

PROMPTS = ["Hello world", "Größe 你好 😀", [5, 17, 300, 42, 7]]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Straße? 你好 🚀"}]


def reference(llm, prompt, **params):
    out = llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0].outputs[0]
    return out.text, out.token_ids, out.finish_reason


def stream_completion(client, **kwargs):
    chunks = list(client.completions.create(model=MODEL_NAME, stream=True, stream_options={"include_usage": True},
                                            **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] is not None and all(r is None for r in reasons[:-1])
    assert chunks[-1].usage is not None and not chunks[-1].choices, "the last chunk carries the usage"
    return text, reasons[-1], chunks[-1].usage, chunks


def test_models_health_metrics(served, client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(served.base_url + "/health").status_code == 200
    r = httpx.get(served.base_url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in ["num_requests_running", "num_requests_waiting", "kv_cache_blocks_used", "prefix_cache_hit_rate",
                 "generation_tokens_total", "time_to_first_token_seconds_bucket",
                 "time_per_output_token_seconds_bucket"]:
        assert f"mini_engine:{name}" in r.text
    assert served.metrics()["mini_engine:kv_cache_blocks_total"] == NUM_KV_BLOCKS


@pytest.mark.parametrize("prompt", PROMPTS, ids=["ascii", "multibyte", "token-ids"])
def test_completion_streamed_equals_unstreamed_equals_llm(served, client, llm, prompt):
    params = dict(max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(model=MODEL_NAME, prompt=prompt, **params)
    text, reason, usage, _ = stream_completion(client, prompt=prompt, **params)
    ref_text, ref_ids, _ = reference(llm, prompt, temperature=0, max_tokens=40, ignore_eos=True)
    assert full.choices[0].text == text == ref_text
    assert len(text) > 5 and len(set(ref_ids)) > 3, "degenerate outputs prove nothing: raise the weights' std"
    assert full.choices[0].finish_reason == reason == "length"
    assert full.usage.completion_tokens == usage.completion_tokens == 40
    assert full.usage.prompt_tokens == usage.prompt_tokens == len(llm.engine.tokenize(prompt))


def test_chat_streamed_equals_unstreamed_equals_llm(served, client, llm, tiny_model):
    params = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**params)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **params))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.created for c in chunks}) == 1 and len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    prompt = ChatTemplate.from_pretrained(tiny_model).render(MESSAGES)
    ref_text, _, _ = reference(llm, prompt, temperature=0, max_tokens=30, ignore_eos=True)
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == text == ref_text
    assert full.choices[0].finish_reason == [c for c in chunks if c.choices][-1].choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == chunks[-1].usage.completion_tokens == 30
    assert full.usage.prompt_tokens == len(llm.engine.tokenize(prompt))


def test_chat_logprobs(served, client, llm, tiny_model):
    """OpenAI's chat logprobs (logprobs=true, top_logprobs=n): an entry a generated token, its
    text, log-probability and UTF-8 bytes and its row's n best; streamed as unstreamed, and the
    offline engine's values."""
    params = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3,
                  extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**params).choices[0].logprobs.content
    prompt = ChatTemplate.from_pretrained(tiny_model).render(MESSAGES)
    offline = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3),
                           use_tqdm=False)[0].outputs[0]
    tokenizer = llm.engine.tokenizer
    assert [e.token for e in full] == [tokenizer.decode([t], skip_special_tokens=False) for t in offline.token_ids]
    assert [e.logprob for e in full] == pytest.approx([lp.logprob for lp in offline.logprobs], abs=1e-5)
    for e in full:
        assert e.bytes == list(e.token.encode("utf-8")) and len(e.top_logprobs) == 3
        assert e.logprob == pytest.approx(max(t.logprob for t in e.top_logprobs), abs=1e-5), "greedy takes the best"
        assert all(t.bytes == list(t.token.encode("utf-8")) for t in e.top_logprobs)
    chunks = list(client.chat.completions.create(stream=True, **params))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    # (The second request reads the prompt's KV from the prefix cache: its values may differ in the
    # last bits.)
    assert [e.token for e in streamed] == [e.token for e in full]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in full], abs=1e-5)
    # logprobs=true alone: each token's own, no alternatives; and none without logprobs.
    alone = client.chat.completions.create(**(params | {"top_logprobs": None})).choices[0].logprobs.content
    assert [e.logprob for e in alone] == pytest.approx([e.logprob for e in full]) and all(
        e.top_logprobs == [] for e in alone)
    assert client.chat.completions.create(**(params | {"logprobs": False, "top_logprobs": None})).choices[0].logprobs \
        is None


def test_chat_default_max_tokens_fills_the_context(served, client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == 512


def test_chat_default_max_tokens_fits_a_pool_smaller_than_the_context(tiny_model, tmp_path):
    """16 blocks of 16 slots hold 257 tokens (the last is never computed), less than max_model_len
    512: the default fills the pool instead of asking for more than it could ever hold."""
    with launched_server(tiny_model, tmp_path, num_kv_blocks=16) as server:
        body = {"model": MODEL_NAME, "messages": MESSAGES, "temperature": 0, "ignore_eos": True}
        r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert r.json()["usage"]["total_tokens"] == 16 * 16 + 1
        assert server.wait_idle()["mini_engine:kv_cache_blocks_used"] == 0


def test_stop_strings(served, client, llm):
    prompt = "Hello world"
    ref_text, _, _ = reference(llm, prompt, temperature=0, max_tokens=60, ignore_eos=True)
    # A stop string from the middle of the greedy text, made of whole characters.
    start = next(i for i in range(12, len(ref_text) - 3) if "\ufffd" not in ref_text[i:i + 3])
    stop = ref_text[start:start + 3]
    expected = ref_text[:ref_text.find(stop)]
    params = dict(prompt=prompt, max_tokens=60, temperature=0, stop=[stop, "never appears ~~~"],
                  extra_body={"ignore_eos": True})
    full = client.completions.create(model=MODEL_NAME, **params)
    text, reason, usage, _ = stream_completion(client, **params)
    assert full.choices[0].text == text == expected
    assert full.choices[0].finish_reason == reason == "stop"
    assert full.usage.completion_tokens == usage.completion_tokens < 60
    # A stop string that never appears changes nothing.
    text, reason, usage, _ = stream_completion(client, prompt=prompt, max_tokens=60, temperature=0,
                                               stop="never appears ~~~", extra_body={"ignore_eos": True})
    assert (text, reason, usage.completion_tokens) == (ref_text, "length", 60)


def test_stop_token_ids(served, client, llm):
    prompt = "Größe"
    _, ref_ids, _ = reference(llm, prompt, temperature=0, max_tokens=30, ignore_eos=True)
    stop_id = ref_ids[6]
    ref_text, stopped_ids, ref_reason = reference(llm, prompt, temperature=0, max_tokens=30, ignore_eos=True,
                                                  stop_token_ids=[stop_id])
    assert ref_reason == "stop" and stopped_ids == ref_ids[:ref_ids.index(stop_id) + 1]
    assert ref_text == llm.tokenizer.decode(stopped_ids[:-1])      # the stop token's text left out
    text, reason, usage, _ = stream_completion(client, prompt=prompt, max_tokens=30, temperature=0,
                                               extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
    assert (text, reason, usage.completion_tokens) == (ref_text, "stop", len(stopped_ids))


def test_min_tokens_holds_back_the_stop_token(served, client, llm):
    """vLLM's min_tokens: the stop token that ended the output above is held back for 10 tokens."""
    prompt = "Größe"
    _, ref_ids, _ = reference(llm, prompt, temperature=0, max_tokens=30, ignore_eos=True)
    stop_id = ref_ids[6]
    params = dict(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id], min_tokens=10)
    ref_text, held_ids, ref_reason = reference(llm, prompt, **params)
    assert len(held_ids) > 10 and stop_id not in held_ids[:10]
    text, reason, usage, _ = stream_completion(client, prompt=prompt, max_tokens=30, temperature=0,
                                               extra_body={"ignore_eos": True, "stop_token_ids": [stop_id],
                                                           "min_tokens": 10})
    assert (text, reason, usage.completion_tokens) == (ref_text, ref_reason, len(held_ids))


def test_logprobs(served, client, llm):
    params = dict(prompt="Hello", max_tokens=8, temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    full = client.completions.create(model=MODEL_NAME, **params).choices[0].logprobs
    assert len(full.tokens) == len(full.token_logprobs) == len(full.top_logprobs) == 8
    # The offline engine's values (tests/engine checks those against transformers').
    offline = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3),
                           use_tqdm=False)[0].outputs[0].logprobs
    assert full.token_logprobs == pytest.approx([lp.logprob for lp in offline], abs=1e-5)
    for sampled, top in zip(full.token_logprobs, full.top_logprobs):
        assert sampled <= 0 and 1 <= len(top) <= 3
        assert sampled == pytest.approx(max(top.values()), abs=1e-5), "greedy samples the most likely token"
    _, _, _, chunks = stream_completion(client, **params)
    streamed = [lp for c in chunks if c.choices and c.choices[0].logprobs
                for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(full.token_logprobs, abs=1e-5)
    # logprobs=0: the sampled token's log-probability alone, in top_logprobs too (OpenAI's "up to
    # logprobs+1 elements", as vLLM's).
    zero = client.completions.create(model=MODEL_NAME, **(params | {"logprobs": 0})).choices[0].logprobs
    assert len(zero.token_logprobs) == 8
    assert zero.top_logprobs == [{token: lp} for token, lp in zip(zero.tokens, zero.token_logprobs)]
    # Sampled, a token outside its row's best comes first, beside them.
    sampled = client.completions.create(model=MODEL_NAME, **(params | {"temperature": 1.5, "seed": 3,
                                                                        "logprobs": 1, "max_tokens": 32}))
    lp = sampled.choices[0].logprobs
    assert all(list(top)[0] == token and top[token] == value and len(top) <= 2
               for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
    assert any(len(top) == 2 for top in lp.top_logprobs), "some sampled token was not its row's best"


def test_seeded_sampling_is_reproducible(served, client, llm):
    params = dict(model=MODEL_NAME, prompt="Hello world", max_tokens=20, temperature=1.0, seed=7,
                  extra_body={"ignore_eos": True})
    first, second = (client.completions.create(**params).choices[0].text for _ in range(2))
    assert first == second
    assert first == reference(llm, "Hello world", temperature=1.0, seed=7, max_tokens=20, ignore_eos=True)[0]
    other = client.completions.create(**(params | {"seed": 8})).choices[0].text
    assert other != first


def test_top_k_top_p_accepted(served, client):
    r = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=5, temperature=0.8, top_p=0.9,
                                  extra_body={"top_k": 5, "ignore_eos": True})
    assert r.usage.completion_tokens == 5


def test_penalties_and_min_p_reach_the_engine(served, client, llm):
    """OpenAI's presence and frequency penalties, vLLM's repetition_penalty and min_p: the same
    tokens as LLM.generate with the same SamplingParams, and other tokens than without them."""
    penalties = dict(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.3)
    params = dict(prompt="Hello world", max_tokens=12, temperature=0)
    r = client.completions.create(model=MODEL_NAME, presence_penalty=1.0, frequency_penalty=0.5,
                                  extra_body={"repetition_penalty": 1.3, "ignore_eos": True}, **params)
    text = r.choices[0].text
    assert text == reference(llm, "Hello world", temperature=0, max_tokens=12, ignore_eos=True, **penalties)[0]
    assert text != reference(llm, "Hello world", temperature=0, max_tokens=12, ignore_eos=True)[0]
    sampled = dict(prompt="Hello world", max_tokens=12, temperature=1.0, seed=3)
    r = client.completions.create(model=MODEL_NAME, extra_body={"min_p": 0.2, "ignore_eos": True}, **sampled)
    assert r.choices[0].text == reference(llm, "Hello world", temperature=1.0, seed=3, max_tokens=12,
                                          ignore_eos=True, min_p=0.2)[0]


def test_logit_bias_reaches_the_engine(served, client, llm):
    """OpenAI's logit_bias, keys as strings: the same text as LLM.generate with it, not without."""
    params = dict(prompt="Hello world", max_tokens=6, temperature=0)
    r = client.completions.create(model=MODEL_NAME, logit_bias={"300": 100}, extra_body={"ignore_eos": True},
                                  **params)
    text = r.choices[0].text
    assert text == reference(llm, "Hello world", temperature=0, max_tokens=6, ignore_eos=True,
                             logit_bias={300: 100})[0]
    assert text != reference(llm, "Hello world", temperature=0, max_tokens=6, ignore_eos=True)[0]
    # As vLLM's server: a bias past 100 is clamped to it.
    clamped = client.completions.create(model=MODEL_NAME, logit_bias={"300": 1000}, extra_body={"ignore_eos": True},
                                        **params)
    assert clamped.choices[0].text == text


def test_n_completions_streamed_and_not_equal_llms(served, client, llm):
    """n choices, index 0..n-1, each what LLM.generate gives completion k (seed + k); the
    streamed chunks, put together by index, the same; usage counts the prompt once."""
    params = dict(model=MODEL_NAME, prompt="Hello world", max_tokens=8, temperature=1.0, seed=11, n=3,
                  extra_body={"ignore_eos": True})
    r = client.completions.create(**params)
    expected = [o.text for o in llm.generate("Hello world", SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=8,
                                                                         ignore_eos=True), use_tqdm=False)[0].outputs]
    assert [c.index for c in r.choices] == [0, 1, 2] and [c.text for c in r.choices] == expected
    assert len(set(expected)) > 1
    prompt_tokens = len(llm.tokenizer.encode("Hello world").ids)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_tokens, 24)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **params))
    streamed = ["", "", ""]
    for chunk in chunks:
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == expected and chunks[-1].usage.completion_tokens == 24
    # The completions' deltas of one engine step go out together, as one chunk of several choices.
    assert max(len(chunk.choices) for chunk in chunks) > 1
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, n=2, temperature=1.0,
                                          extra_body={"top_k": 1})
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content      # top-1: the same twice
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, n=2,
                                                 temperature=1.0, extra_body={"top_k": 1}, stream=True))
    streamed = ["", ""]
    for chunk in chunks:
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == [chat.choices[0].message.content] * 2
    assert served.wait_idle()["mini_engine:kv_cache_blocks_used"] == 0


def test_a_batch_of_prompts(served, client, llm):
    """OpenAI's batch: a list of prompts (texts, or token ids), choice i * n + k answering prompt i
    with completion k, each what LLM.generate gives it, streamed or not; usage counts each prompt
    once; echo puts each choice's own prompt before it."""
    prompts = ["Hello world", "Größe 你好 😀"]
    params = dict(model=MODEL_NAME, prompt=prompts, max_tokens=6, temperature=1.0, seed=5, n=2,
                  extra_body={"ignore_eos": True})
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    expected = [o.text for out in outs for o in out.outputs]
    r = client.completions.create(**params)
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and [c.text for c in r.choices] == expected
    prompt_tokens = sum(len(llm.tokenizer.encode(p).ids) for p in prompts)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_tokens, 24)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **params))
    streamed = [""] * 4
    for chunk in chunks:
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == expected and chunks[-1].usage.prompt_tokens == prompt_tokens
    ids = [[5, 17, 300, 42, 7], [9, 8, 7]]
    r = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=4, temperature=0, echo=True,
                                  extra_body={"ignore_eos": True})
    assert [c.text for c in r.choices] == [llm.tokenizer.decode(prompt, skip_special_tokens=False) +
                                           reference(llm, prompt, temperature=0, max_tokens=4, ignore_eos=True)[0]
                                           for prompt in ids]


def test_tokenize_and_detokenize(served, client, llm):
    """vLLM's /tokenize and /detokenize: a prompt's ids as the completion endpoint counts them, chat
    messages' as the chat endpoint does, and the text of ids back."""
    def post(route, body):
        return httpx.post(served.base_url + route, json=body, timeout=60)
    text = "Größe 你好 😀"
    r = post("/tokenize", {"model": MODEL_NAME, "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    ids = llm.tokenizer.encode(text).ids
    assert r.json() == {"count": len(ids), "max_model_len": 512, "tokens": ids,
                        "token_strs": [llm.tokenizer.id_to_token(t) for t in ids]}
    completion = client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=1)
    assert completion.usage.prompt_tokens == len(ids)
    counted = post("/tokenize", {"messages": MESSAGES}).json()
    assert counted["token_strs"] is None
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=1)
    assert counted["count"] == len(counted["tokens"]) == chat.usage.prompt_tokens
    assert post("/detokenize", {"model": MODEL_NAME, "tokens": ids}).json() == {"prompt": text}
    special = llm.tokenizer.token_to_id("<|im_end|>")
    assert post("/detokenize", {"tokens": [special]}).json() == {"prompt": "<|im_end|>"}
    for route, body, status, words in [
            ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "either prompt or messages"),
            ("/tokenize", {}, 400, "either prompt or messages"),
            ("/tokenize", {"model": "gpt-4", "prompt": "a"}, 404, "does not exist"),
            ("/detokenize", {"tokens": [10 ** 7]}, 400, "outside the vocabulary"),
            ("/detokenize", {"tokens": "abc"}, 400, "tokens")]:
        r = post(route, body)
        assert r.status_code == status and words in r.json()["error"]["message"], (body, r.text)


UNIT_SCHEMA = {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}}, "required": ["unit"],
               "additionalProperties": False}


def test_structured_outputs(served, client, llm):
    """OpenAI's response_format json_schema and vLLM's structured_outputs (choice, regex), in both
    endpoints, streamed or not, each what LLM.generate gives with the same StructuredOutputsParams."""
    from mini_engine.structured_outputs import StructuredOutputsParams
    json_schema = {"type": "json_schema", "json_schema": {"name": "unit", "schema": UNIT_SCHEMA}}
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=60, temperature=0,
                                          response_format=json_schema)
    assert json.loads(chat.choices[0].message.content)["unit"] in ("C", "F")
    assert chat.choices[0].finish_reason == "stop"
    prompt = ChatTemplate.from_pretrained(llm.engine.config.model).render(MESSAGES)
    offline = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(
        json=UNIT_SCHEMA)), use_tqdm=False)[0].outputs[0].text
    assert chat.choices[0].message.content == offline
    for spec, valid in [({"choice": ["yes", "no", "Größe"]}, lambda t: t in ("yes", "no", "Größe")),
                        ({"regex": "[0-9]{2}-[a-c]{3}"}, lambda t: re.fullmatch("[0-9]{2}-[a-c]{3}", t))]:
        params = dict(model=MODEL_NAME, prompt="Hello", max_tokens=20, temperature=1.0, seed=4,
                      extra_body={"structured_outputs": spec})
        text = client.completions.create(**params).choices[0].text
        streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **params) if c.choices)
        assert valid(text) and streamed == text
        expected = llm.generate("Hello", SamplingParams(temperature=1.0, seed=4, max_tokens=20,
                                                        structured_outputs=StructuredOutputsParams(**spec)),
                                use_tqdm=False)[0].outputs[0].text
        assert text == expected
    anything = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=30,
                                              response_format={"type": "json_object"})
    assert anything.choices[0].message.content.startswith("{")


def test_bad_words_reach_the_engine(served, client, llm):
    params = dict(temperature=0, max_tokens=12, ignore_eos=True)
    plain, tokens, _ = reference(llm, "Hello world", **params)
    # A token of the output that is a word of its own (its text encodes back to it alone).
    word = next(text for t in tokens if (text := llm.tokenizer.decode([t])).strip() == text and text
                and llm.tokenizer.encode(text).ids == [t])
    r = client.completions.create(model=MODEL_NAME, prompt="Hello world", max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True, "bad_words": [word]})
    assert r.choices[0].text == reference(llm, "Hello world", bad_words=[word], **params)[0] != plain


def test_streams_end_with_usage_only_when_asked(served, client):
    """As OpenAI: without stream_options.include_usage every chunk has a choice, so a client that
    reads chunk.choices[0] of each one works."""
    params = dict(model=MODEL_NAME, prompt="Hello", max_tokens=5, temperature=0, stream=True)
    chunks = list(client.completions.create(**params))
    assert all(c.choices and c.usage is None for c in chunks)
    asked = list(client.completions.create(stream_options={"include_usage": True}, **params))
    assert not asked[-1].choices and asked[-1].usage.completion_tokens == 5


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(served, client):
    """vLLM's stream_options.continuous_usage_stats: each chunk carries the usage so far (the role
    chunk none of the output yet), the stream still ends with the usage chunk (asked for by it
    unless include_usage is false), and its counts are the last chunk's."""
    params = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=7, temperature=0, stream=True,
                  extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(**params, stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chunks)
    final, streamed = chunks[-1], chunks[:-1]
    assert not final.choices and final.usage.completion_tokens == 7
    assert streamed[0].choices[0].delta.role == "assistant" and streamed[0].usage.completion_tokens == 0
    counts = [c.usage.completion_tokens for c in streamed]
    assert counts == sorted(counts) and counts[-1] == 7 and len(set(counts)) > 2, counts
    assert {c.usage.prompt_tokens for c in chunks} == {final.usage.prompt_tokens}
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    # Two completions of one prompt: the prompt once, both completions' tokens.
    both = list(client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4, n=2, temperature=0.8,
                                          seed=1, stream=True, extra_body={"ignore_eos": True},
                                          stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert both[-2].usage.completion_tokens == both[-1].usage.completion_tokens == 8
    assert both[-1].usage.prompt_tokens == both[0].usage.prompt_tokens
    off = list(client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4, temperature=0, stream=True,
                                         stream_options={"include_usage": False, "continuous_usage_stats": True}))
    assert all(c.choices and c.usage is None for c in off)


def test_development_and_profile_routes_exist_only_when_asked(served):
    """As vLLM's: /sleep and the like with VLLM_SERVER_DEV_MODE=1, /start_profile with
    VLLM_TORCH_PROFILER_DIR (tests/server/test_dev_endpoints.py); this server has neither."""
    for route in ("/sleep", "/reset_prefix_cache", "/start_profile", "/stop_profile"):
        assert httpx.post(served.base_url + route, timeout=60).status_code == 404, route


def test_prompt_embeds_complete_as_their_tokens_do(served, llm):
    """vLLM's prompt_embeds (base64 of torch.save(tensor), with --enable-prompt-embeds): a prompt's
    own embedding rows complete as its text does, streamed or not, one or a batch; what cannot be
    read or run is a 400 naming the field."""
    ids = llm.engine.tokenize("Hello world, once more")
    table = llm.engine.runner.model.embed_tokens.weight

    def encoded(tensor) -> str:
        buffer = io.BytesIO()
        torch.save(tensor.detach().clone(), buffer)
        return base64.b64encode(buffer.getvalue()).decode()
    body = {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    url = served.base_url + "/v1/completions"
    want = reference(llm, ids, temperature=0, max_tokens=8, ignore_eos=True)[0]
    r = httpx.post(url, json=body | {"prompt_embeds": encoded(table[ids])}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want and r.json()["usage"]["prompt_tokens"] == len(ids)
    batch = httpx.post(url, json=body | {"prompt_embeds": [encoded(table[ids]), encoded(table[ids[:3]])]},
                       timeout=60).json()
    assert [c["text"] for c in batch["choices"]] == [want, reference(llm, ids[:3], temperature=0, max_tokens=8,
                                                                     ignore_eos=True)[0]]
    streamed = httpx.post(url, json=body | {"prompt_embeds": encoded(table[ids]), "stream": True}, timeout=60).text
    chunks = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == want
    # As vLLM's example sends them with OpenAI's client, which needs a prompt: an empty one beside.
    beside = httpx.post(url, json=body | {"prompt_embeds": encoded(table[ids]), "prompt": ""}, timeout=60)
    assert beside.json()["choices"][0]["text"] == want
    for extra, match, param in [
            ({"prompt_embeds": "not base64!"}, "base64", "prompt_embeds"),
            ({"prompt_embeds": encoded(table[ids]), "prompt": "Hi"}, "not both", "prompt"),
            ({}, "give prompt", "prompt"),
            ({"prompt_embeds": encoded(table[ids][:, :5])}, "hidden_size", "prompt_embeds"),
            ({"prompt_embeds": encoded(table[ids].to(torch.float8_e4m3fn))}, "dense tensor", "prompt_embeds"),
            ({"prompt_embeds": base64.b64encode(b"not a pickle").decode()}, "torch.save", "prompt_embeds"),
            ({"prompt_embeds": encoded(table[ids]), "repetition_penalty": 1.2}, "prompt's tokens",
             "repetition_penalty"),
            ({"prompt_embeds": encoded(table[ids]), "echo": True}, "echo", "echo")]:
        bad = httpx.post(url, json=body | extra, timeout=60)
        error = bad.json()["error"]
        assert bad.status_code == 400 and match in error["message"] and error["param"] == param, (extra.keys(), bad.text)


def test_neutral_values_of_unimplemented_parameters_are_accepted(served):
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 3, "response_format": {"type": "text"},
            "tools": [], "tool_choice": "none"}
    r = httpx.post(served.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


def test_without_parsers_tools_are_shown_only_with_tool_choice_none(served):
    """A server started without --enable-auto-tool-choice takes tools with tool_choice "none" (and
    refuses them otherwise: test_server_bad_input), and its message is as ever, without the
    parsers' fields. (That the template gets them: test_reasoning_and_tool_calls.)"""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 3, "tools": tools, "tool_choice": "none"}
    r = httpx.post(served.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert set(r.json()["choices"][0]["message"]) == {"role", "content"}


def test_null_sampling_fields_take_their_defaults(served):
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, "temperature": None, "top_p": None, "n": None,
            "seed": 3}
    r = httpx.post(served.base_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    same = httpx.post(served.base_url + "/v1/completions", timeout=60,
                      json=body | {"temperature": 1.0, "top_p": 1.0, "n": 1})
    assert r.json()["choices"][0]["text"] == same.json()["choices"][0]["text"]


def test_text_offsets_count_each_tokens_characters(served, client):
    """A stop string holds text back while it might still match: the offsets must not follow it."""
    params = dict(model=MODEL_NAME, prompt="Hello", max_tokens=12, temperature=0, logprobs=1,
                  extra_body={"ignore_eos": True})
    for extra in ({}, {"stop": "never appears ~~~"}):
        for stream in (False, True):
            if stream:
                chunks = list(client.completions.create(stream=True, **params, **extra))
                tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
                offsets = [o for c in chunks if c.choices and c.choices[0].logprobs
                           for o in c.choices[0].logprobs.text_offset]
            else:
                lp = client.completions.create(**params, **extra).choices[0].logprobs
                tokens, offsets = lp.tokens, lp.text_offset
            assert len(tokens) == 12
            assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(12)], (extra, stream)


def test_allowed_token_ids_and_include_stop_str_reach_the_engine(served, client, llm):
    """vLLM's allowed_token_ids and include_stop_str_in_output, as extra fields: the same text as
    LLM.generate with the same SamplingParams, streamed or not."""
    _, free_ids, _ = reference(llm, "Hello world", temperature=0, max_tokens=8, ignore_eos=True)
    allowed = [300, 301, 302, free_ids[0] + 1]
    params = dict(temperature=0, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed)
    ref_text, ref_ids, _ = reference(llm, "Hello world", **params)
    assert set(ref_ids) <= set(allowed) and ref_ids != free_ids
    r = client.completions.create(model=MODEL_NAME, prompt="Hello world", max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True, "allowed_token_ids": allowed})
    assert r.choices[0].text == ref_text
    stop_id = ref_ids[3]
    params = dict(temperature=0, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed, stop_token_ids=[stop_id],
                  include_stop_str_in_output=True)
    kept_text, kept_ids, _ = reference(llm, "Hello world", **params)
    assert kept_text == llm.tokenizer.decode(kept_ids) and kept_ids[-1] == stop_id
    text, reason, _, _ = stream_completion(client, prompt="Hello world", max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True, "allowed_token_ids": allowed,
                                                       "stop_token_ids": [stop_id], "include_stop_str_in_output": True})
    assert (text, reason) == (kept_text, "stop")


def test_prompt_logprobs_reach_the_client(served, client, llm):
    """vLLM's prompt_logprobs extension: each completion's, and the chat response's, the prompt's
    values from LLM.generate, by token id with rank and text; the first position None."""
    prompt = "Hello world, again"
    ids = llm.tokenizer.encode(prompt).ids
    offline = llm.generate(prompt, SamplingParams(temperature=1.0, seed=4, max_tokens=3, prompt_logprobs=2),
                           use_tqdm=False)[0].prompt_logprobs
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3, temperature=1.0, seed=4, n=2,
                                  extra_body={"prompt_logprobs": 2})
    for choice in r.choices:
        got = choice.model_extra["prompt_logprobs"]
        assert len(got) == len(ids) and got[0] is None
        for token_id, entry, want in zip(ids[1:], got[1:], offline[1:]):
            assert entry[str(token_id)]["logprob"] == pytest.approx(want.logprob, abs=1e-5)
            assert entry[str(token_id)]["rank"] == want.rank
            assert {int(t) for t in entry} == {token_id} | {t for t, _ in want.top}
            assert [entry[str(t)]["rank"] for t, _ in want.top] == [1, 2]
            assert entry[str(want.top[0][0])]["decoded_token"] == llm.tokenizer.decode([want.top[0][0]])
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=2, extra_body={"prompt_logprobs": 0})
    values = chat.model_extra["prompt_logprobs"]
    assert values[0] is None and all(len(v) == 1 and next(iter(v.values()))["rank"] >= 1 for v in values[1:])


def test_echo_returns_the_prompt_and_its_logprobs(served, client, llm):
    """OpenAI's echo, as evaluation harnesses score prompts with it: the prompt's text before the
    completion's, and with logprobs its tokens' (None for the first, then LLM.generate's
    prompt_logprobs), text offsets running on through the completion's tokens; max_tokens 0
    returns the prompt alone and counts no completion tokens."""
    prompt = "Hello world, again"
    ids = llm.tokenizer.encode(prompt).ids
    offline = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2,
                                                  logprobs=2), use_tqdm=False)[0]
    only = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=2,
                                     temperature=0)
    choice = only.choices[0]
    assert choice.text == prompt and only.usage.completion_tokens == 0 and only.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert lp.tokens == [llm.tokenizer.decode([t]) for t in ids] and lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([x.logprob for x in offline.prompt_logprobs[1:]], abs=1e-5)
    assert lp.top_logprobs[0] is None and len(lp.top_logprobs[1]) >= 2
    assert lp.text_offset == list(itertools.accumulate((len(t) for t in lp.tokens[:-1]), initial=0))
    full = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, echo=True, logprobs=2,
                                     temperature=0, extra_body={"ignore_eos": True})
    choice = full.choices[0]
    assert choice.text == prompt + offline.outputs[0].text and full.usage.completion_tokens == 4
    assert len(choice.logprobs.tokens) == len(ids) + 4
    assert choice.logprobs.token_logprobs[len(ids):] == pytest.approx([x.logprob for x in offline.outputs[0].logprobs],
                                                                      abs=1e-5)
    offsets = choice.logprobs.text_offset
    assert offsets == list(itertools.accumulate((len(t) for t in choice.logprobs.tokens[:-1]), initial=0))
    plain = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, echo=True, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert plain.choices[0].text == choice.text and plain.choices[0].logprobs is None


@pytest.mark.parametrize("max_tokens", [0, 4])
@pytest.mark.parametrize("logprobs", [None, 2])
def test_echo_streamed_is_the_response_unstreamed(served, client, max_tokens, logprobs):
    """echo in a stream, as vLLM streams it: each choice's chunks put together are its choice in
    the response unstreamed (text, and with logprobs the prompt's tokens then the completion's,
    offsets running on), for a batch of two prompts with n=2, and so is the usage."""
    params = dict(model=MODEL_NAME, prompt=["Hello world, again", "Größe 你好 😀"], max_tokens=max_tokens,
                  echo=True, logprobs=logprobs, temperature=1.0, seed=3, n=2, extra_body={"ignore_eos": True})
    full = client.completions.create(**params)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **params))
    texts, lps, reasons = {}, {}, {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            reasons[c.index] = c.finish_reason
            if c.logprobs is not None:
                old = lps.setdefault(c.index, {key: [] for key in ("tokens", "token_logprobs", "top_logprobs",
                                                                  "text_offset")})
                for key in old:
                    old[key] += getattr(c.logprobs, key)
    assert len(full.choices) == 4 and full.choices[0].text.startswith("Hello world, again")
    for c in full.choices:
        assert texts[c.index] == c.text and reasons[c.index] == c.finish_reason == "length"
        if logprobs is None:
            assert c.logprobs is None and c.index not in lps
            continue
        got = lps[c.index]
        assert got["tokens"] == c.logprobs.tokens and got["text_offset"] == c.logprobs.text_offset
        assert got["token_logprobs"] == pytest.approx(c.logprobs.token_logprobs, abs=1e-5)
        assert got["top_logprobs"][0] is None and [sorted(t) for t in got["top_logprobs"][1:]] == \
            [sorted(t) for t in c.logprobs.top_logprobs[1:]]
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == \
        (full.usage.prompt_tokens, full.usage.completion_tokens) == (full.usage.prompt_tokens, 4 * max_tokens)


def test_echo_of_token_ids_keeps_their_special_tokens(served, client, llm):
    """A prompt of token ids echoes as their text with special tokens written out, as its
    logprobs' token strings show them (a review found them dropped from the text)."""
    ids = [llm.tokenizer.token_to_id("<|im_start|>"), *llm.tokenizer.encode("user\nHi").ids,
           llm.tokenizer.token_to_id("<|im_end|>")]
    r = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = r.choices[0]
    assert choice.text == "<|im_start|>user\nHi<|im_end|>" == "".join(choice.logprobs.tokens)


# A conversation whose final message, the assistant's, the model is to continue.
PREFILLED = MESSAGES + [{"role": "assistant", "content": "Straße, and"}]


def test_continue_final_message_continues_the_last_message(served, client, llm, tiny_model):
    """vLLM's continue_final_message: the prompt is transformers' rendering with the final message
    left open (no <|im_end|> after it), so the output is what LLM.generate continues that text with,
    and the choice holds the continuation alone; streamed as unstreamed; /tokenize counts the same
    tokens."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=f"{tiny_model}/tokenizer.json")
    text = hf.apply_chat_template(PREFILLED, chat_template=CHATML_TEMPLATE, tokenize=False,
                                  continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nStraße, and"), "the reference left the message open"
    ids = llm.tokenizer.encode(text).ids
    ref_text, _, _ = reference(llm, text, temperature=0, max_tokens=12, ignore_eos=True)
    params = dict(model=MODEL_NAME, messages=PREFILLED, max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True, "continue_final_message": True, "add_generation_prompt": False})
    full = client.chat.completions.create(**params)
    assert full.choices[0].message.content == ref_text and full.usage.prompt_tokens == len(ids)
    chunks = client.chat.completions.create(stream=True, **params)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref_text
    tokenized = httpx.post(served.base_url + "/tokenize", timeout=60, json={
        "messages": PREFILLED, "continue_final_message": True, "add_generation_prompt": False}).json()
    assert tokenized["tokens"] == ids
    # As vLLM's, both at once is a 400 (add_generation_prompt is true unless sent false).
    for route, body in [("/v1/chat/completions", {"model": MODEL_NAME, "messages": PREFILLED}),
                        ("/tokenize", {"messages": PREFILLED})]:
        r = httpx.post(served.base_url + route, json=body | {"continue_final_message": True}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text
        assert "cannot both be true" in r.json()["error"]["message"]


def test_chat_echo_puts_the_final_message_first(served, client):
    """vLLM's echo on chat: the final message's content before each choice's where that message has
    the response's role (so with continue_final_message, the whole answer); streamed, a chunk of its
    own after the role's; nothing where a user's message ends the conversation."""
    prefilled = dict(model=MODEL_NAME, messages=PREFILLED, max_tokens=6, temperature=1.0, seed=5, n=2,
                     extra_body={"ignore_eos": True, "continue_final_message": True, "add_generation_prompt": False})
    echo = prefilled["extra_body"] | {"echo": True}
    plain = client.chat.completions.create(**prefilled)
    echoed = client.chat.completions.create(**(prefilled | {"extra_body": echo}))
    assert [c.message.content for c in echoed.choices] == ["Straße, and" + c.message.content for c in plain.choices]
    assert echoed.usage == plain.usage
    greedy = prefilled | {"n": 1, "temperature": 0, "extra_body": echo}
    chunks = list(client.chat.completions.create(stream=True, **greedy))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[1].choices[0].delta.content == "Straße, and"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        client.chat.completions.create(**greedy).choices[0].message.content
    asked = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    not_echoed = client.chat.completions.create(**(asked | {"extra_body": {"ignore_eos": True, "echo": True}}))
    assert not_echoed.choices[0].message.content == client.chat.completions.create(**asked).choices[0].message.content


def test_a_requests_chat_template_needs_the_servers_trust(served):
    """As newer vLLM's: a request's own template (chat_template, or chat_template_kwargs' one) is
    refused unless the server was started with --trust-request-chat-template."""
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    for route, body, param in [
            ("/v1/chat/completions", {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1,
                                      "chat_template": template}, "chat_template"),
            ("/v1/chat/completions", {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1,
                                      "chat_template_kwargs": {"chat_template": template}}, "chat_template_kwargs"),
            ("/tokenize", {"messages": MESSAGES, "chat_template": template}, "chat_template")]:
        r = httpx.post(served.base_url + route, json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert "--trust-request-chat-template" in r.json()["error"]["message"]
