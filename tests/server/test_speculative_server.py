"""`--speculative-config` (vLLM's flag, JSON): the server's completions are plain decoding's, a stop
string that a step's first token completes cuts the step's later tokens from the response, streamed
or not, and no KV block is left in use."""
import json
import re

import httpx

from mini_engine import LLM, SamplingParams
from tests.engine.test_speculative import NGRAM, STOP_PROMPTS, stop_inside_a_step
from tests.server.conftest import MODEL_NAME, NUM_KV_BLOCKS, launched_server


def completion(server, body: dict) -> dict:
    r = httpx.post(server.base_url + "/v1/completions", timeout=60, json={"model": MODEL_NAME, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def streamed_text(server, body: dict) -> tuple[str, int, str]:
    """The streamed text, the count of tokens in its logprobs, and the finish reason."""
    text, num_tokens, reason = "", 0, None
    with httpx.stream("POST", server.base_url + "/v1/completions", timeout=60,
                      json={"model": MODEL_NAME, "stream": True, **body}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[len("data: "):])["choices"][0]
            text += choice["text"]
            num_tokens += len((choice.get("logprobs") or {}).get("tokens") or [])
            reason = choice["finish_reason"] or reason
    return text, num_tokens, reason


def accepted_per_position(server) -> dict[str, float]:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^mini_engine:spec_decode_num_accepted_tokens_per_pos_total\{[^}]*position="(\d+)"[^}]*\} ([0-9.e+-]+)$', text,
        re.MULTILINE)}


def test_a_speculative_server_answers_as_plain_decoding(tiny_model, tmp_path):
    plain = LLM(tiny_model, num_kv_blocks=NUM_KV_BLOCKS, block_size=16)
    spec = LLM(tiny_model, num_kv_blocks=NUM_KV_BLOCKS, block_size=16, speculative_config=NGRAM)
    prompt, (stop, ids) = next((p, found) for p in STOP_PROMPTS
                               if (found := stop_inside_a_step(spec.engine, p)) is not None)
    greedy = {"prompt": prompt, "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    want_free = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
    want_stop = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, stop=[stop]),
                               use_tqdm=False)[0].outputs[0]
    assert want_stop.token_ids == ids
    with launched_server(tiny_model, tmp_path, options=("--speculative-config", json.dumps(NGRAM))) as server:
        assert completion(server, greedy)["text"] == want_free.text
        got = completion(server, greedy | {"stop": [stop], "logprobs": 1})
        assert (got["text"], got["finish_reason"]) == (want_stop.text, "stop")
        assert len(got["logprobs"]["tokens"]) == len(ids)
        assert streamed_text(server, greedy | {"stop": [stop], "logprobs": 1}) == (want_stop.text, len(ids), "stop")
        m = server.wait_idle()
        server_per_position = accepted_per_position(server)
    # vLLM's spec_decode counters: the steps of several tokens above were accepted drafts.
    drafts, accepted = m["mini_engine:spec_decode_num_draft_tokens_total"], m["mini_engine:spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted <= drafts and m["mini_engine:spec_decode_num_drafts_total"] > 0
    # And vLLM's accepted tokens by position: they sum to the accepted tokens, none more than the first's.
    per_position = server_per_position
    assert sum(per_position.values()) == accepted and max(per_position.values()) == per_position.get("0")
