"""Requests that arrive together and over time, and clients that leave mid-request."""
import asyncio
import threading

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME


def test_64_concurrent_streams_complete_with_their_token_counts(served):
    async def one(client, i):
        max_tokens = 4 + i % 29
        stream = await client.completions.create(
            model=MODEL_NAME, prompt=[(7 * i + j) % 400 for j in range(3 + i % 40)], max_tokens=max_tokens,
            temperature=0 if i % 2 else 0.9, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        token_chunks, text, reason, usage = 0, "", None, None
        async for chunk in stream:
            if chunk.choices:
                token_chunks += 1
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            usage = chunk.usage or usage
        return max_tokens, token_chunks, reason, usage.completion_tokens

    async def main():
        async with openai.AsyncOpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(64))), 120)

    for max_tokens, token_chunks, reason, completion_tokens in asyncio.run(main()):
        assert (reason, completion_tokens) == ("length", max_tokens)
        assert 1 <= token_chunks <= max_tokens      # a chunk per token, or fewer when the client lags


def test_disconnected_streams_are_aborted_and_free_their_blocks(served):
    before = served.metrics()
    num_clients = 6
    with served.openai_client() as client:
        streams = [client.completions.create(model=MODEL_NAME, prompt=f"Client {i} says hello", max_tokens=480,
                                             stream=True, extra_body={"ignore_eos": True})
                   for i in range(num_clients)]
        for stream in streams:
            for _, chunk in zip(range(3), stream):     # read a little, then hang up
                assert chunk.choices[0].finish_reason is None
        assert served.metrics()["mini_engine:kv_cache_blocks_used"] > 0
        for stream in streams:
            stream.close()
    after = served.wait_idle()
    aborted = after.get("mini_engine:request_success_total:abort", 0) - before.get(
        "mini_engine:request_success_total:abort", 0)
    assert aborted == num_clients
    generated = after["mini_engine:generation_tokens_total"] - before["mini_engine:generation_tokens_total"]
    assert generated < num_clients * 480


def test_disconnected_unstreamed_requests_are_aborted(served):
    before = served.metrics().get("mini_engine:request_success_total:abort", 0)
    body = {"model": MODEL_NAME, "prompt": "Nobody waits for this", "max_tokens": 490, "ignore_eos": True}

    def post():
        with pytest.raises(httpx.TimeoutException):
            httpx.post(served.base_url + "/v1/completions", json=body, timeout=httpx.Timeout(5, read=0.3))

    threads = [threading.Thread(target=post) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    after = served.wait_idle()
    assert after.get("mini_engine:request_success_total:abort", 0) - before == 4


def test_requests_arriving_while_others_run(served):
    """New requests join a running batch between steps; each finishes with its own length."""
    results = {}

    def run(i, max_tokens):
        with served.openai_client() as c:
            r = c.completions.create(model=MODEL_NAME, prompt=f"Request {i}", max_tokens=max_tokens,
                                     extra_body={"ignore_eos": True})
            results[i] = (max_tokens, r.usage.completion_tokens, r.choices[0].finish_reason)

    threads = []
    for i in range(8):
        threads.append(threading.Thread(target=run, args=(i, 200 - 20 * i)))
        threads[-1].start()
        threading.Event().wait(0.05)     # arrivals spread over time
    for t in threads:
        t.join(timeout=60)
    assert len(results) == 8
    for max_tokens, completion_tokens, reason in results.values():
        assert (completion_tokens, reason) == (max_tokens, "length")
