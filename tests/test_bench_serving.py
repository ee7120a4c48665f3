"""bench_serving's client reads a server's stream as server-sent events split it."""
import asyncio
import json

import httpx

from bench_serving import send

# Raw line breaks that JSON leaves unescaped (the server writes its chunks with ensure_ascii=False,
# as vLLM's do): str.splitlines, and so httpx's aiter_lines, breaks a line at each of them.
TEXT = "a\u2028b\x85c\u2029d\x1ce"


def events() -> bytes:
    chunks = [{"choices": [{"index": 0, "text": piece}]} for piece in (TEXT, "é😀")]
    chunks.append({"choices": [], "usage": {"completion_tokens": 3}})
    return b"".join(f"data: {json.dumps(c, ensure_ascii=False)}\r\n\r\n".encode() for c in chunks) + b"data: [DONE]\n\n"


def test_send_reads_chunks_whose_text_holds_unicode_line_breaks():
    body = events()

    async def pieces():             # cut everywhere: inside a CR LF and inside a character
        for i in range(0, len(body), 5):
            yield body[i:i + 5]

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=pieces(), headers={"content-type": "text/event-stream"})

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://server") as client:
            return await send(client, "m", [1, 2], 3, 0.0)
    result = asyncio.run(run())
    assert result.ok and result.error == "" and result.num_output_tokens == 3
    assert 0 < result.ttft <= result.latency
