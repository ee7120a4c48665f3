"""OpenAI's Responses API, as vLLM's server offers it: POST /v1/responses, and GET
/v1/responses/{id} for the responses the server keeps.

A request is its chat request (responses_protocol.py): rendered, checked, sampled and parsed by the
chat endpoint's own machinery, so a response's text is what /v1/chat/completions gives for the
same messages and parameters; the parsed text becomes output items (responses_output.py), sent as
they come as OpenAI's stream events, or whole.

Responses are kept only where the server runs with VLLM_ENABLE_RESPONSES_API_STORE=1, vLLM's
switch: then `store` defaults to true, as OpenAI's, and a kept response can be read back and
continued (`previous_response_id`). Without it a request that asks for store=true is refused,
where vLLM's drops the flag silently: a client that asks to keep a response means to read it back.
"""
import copy
import json
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from mini_engine.reasoning import THINK_END, THINK_START
from mini_engine.sampling_params import SamplingParams
from mini_engine.server.async_engine import RequestStream
from mini_engine.server.output_parsers import ChatOutputParser, ParsedText
from mini_engine.server.protocol import ProtocolError, error_response
from mini_engine.server.responses_output import ResponseOutput, count_reasoning_tokens, item_id
from mini_engine.server.responses_protocol import (ResponsesRequest, append_items, chat_messages,
                                                   in_responses_terms)

STORE_ENV = "VLLM_ENABLE_RESPONSES_API_STORE"
# vLLM's store keeps every response, and grows without end; this one forgets the oldest.
MAX_STORED_RESPONSES = 1024
# A response's status, by the engine's finish reason: "length" is max_output_tokens (or the
# context) cutting it short; "abort", the engine ending it (as vLLM's, "cancelled").
STATUS = {"stop": "completed", "length": "incomplete", "abort": "cancelled"}
# The event that ends a stream, by status, as OpenAI's.
FINAL_EVENT = {"completed": "response.completed", "incomplete": "response.incomplete",
               "cancelled": "response.failed", "failed": "response.failed"}


def store_enabled() -> bool:
    return os.environ.get(STORE_ENV, "0").strip().lower() in ("1", "true")


def sse_event(event: dict) -> str:
    """OpenAI's Responses streams name each event (and send no [DONE])."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def usage(num_prompt_tokens: int, num_output_tokens: int, num_reasoning_tokens: int, num_cached_tokens: int) -> dict:
    """num_cached_tokens: the prompt tokens the prefix cache served."""
    return {"input_tokens": num_prompt_tokens, "input_tokens_details": {"cached_tokens": num_cached_tokens},
            "output_tokens": num_output_tokens, "output_tokens_details": {"reasoning_tokens": num_reasoning_tokens},
            "total_tokens": num_prompt_tokens + num_output_tokens}


@dataclass
class StoredResponse:
    body: dict
    messages: list[dict]        # the chat messages it answered, without its instructions


class ResponseStore:
    """The newest `capacity` responses, in memory, by id."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES):
        self.capacity = capacity
        self.responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, stored: StoredResponse) -> None:
        self.responses[stored.body["id"]] = stored
        while len(self.responses) > self.capacity:
            self.responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self.responses.get(response_id)


@dataclass
class ResponseRun:
    """What a response needs while its request runs."""
    stream: RequestStream
    body: dict                  # the response as response.created shows it
    parser: ChatOutputParser | None
    stored_messages: list[dict] | None      # None: not kept


class ResponsesEndpoint:
    def __init__(self, server):
        """server: the OpenAIServer, whose checks, chat template, parsers and engine these share."""
        self.server = server
        self.store = ResponseStore() if store_enabled() else None
        tokenizer = server.tokenizer
        self.think_tokens = (None, None) if tokenizer is None else \
            (tokenizer.token_to_id(THINK_START), tokenizer.token_to_id(THINK_END))

    async def create(self, req: ResponsesRequest, raw: Request) -> Response:
        server = self.server
        server.check_model(req.model)       # an unknown model's 404 first, as the other endpoints'
        if (param := req.unsupported()) is not None:
            raise ProtocolError(f"{param}={getattr(req, param)!r} is not supported by this server", param=param)
        keep = self.keeps(req)
        history = self.history(req.previous_response_id)
        messages = chat_messages(req, history)
        response_id = item_id("resp")
        try:
            chat = req.chat_request(messages)
            lora_request = server.check(chat)
            server.check_tools(chat)
            prompt, prompt_token_ids = server.render_chat(chat)
            max_tokens = server.max_tokens(chat.max_tokens, lambda: server.remaining_tokens(prompt_token_ids))
            params = server.sampling_params(chat, max_tokens, None)
            parsers = server.output_parsers(chat, prompt, params)
            streams = server.add(response_id, [prompt_token_ids], params, req.priority, lora_request, chat.cache_salt)
        except ProtocolError as e:
            raise in_responses_terms(e) from None
        body = self.response_body(req, response_id, server.response_model_name(lora_request), params, keep)
        run = ResponseRun(streams[0], body, parsers[0] if parsers else None,
                          messages[1 if req.instructions else 0:] if keep else None)
        if req.stream:
            return server.streamed((sse_event(event) async for event in self.events(run)), streams)
        return await server.unless_disconnected(raw, self.collect(run), streams)

    def retrieve(self, response_id: str) -> dict:
        """GET /v1/responses/{id}: a kept response."""
        return self.stored(response_id, "response_id").body

    # ---- a request's parts ----

    def keeps(self, req: ResponsesRequest) -> bool:
        """Whether this response is kept: store's value, true by default, where the server keeps any."""
        if self.store is None:
            if req.store:
                raise ProtocolError(f"store=true needs a server that keeps responses (started with {STORE_ENV}=1, "
                                    "vLLM's switch): send store=false", param="store")
            return False
        return req.store is not False

    def stored(self, response_id: str, param: str) -> StoredResponse:
        stored = self.store.get(response_id) if self.store is not None else None
        if stored is None:
            kept = "" if self.store is not None else f" (this server keeps no responses: start it with {STORE_ENV}=1)"
            raise ProtocolError(f"Response with id '{response_id}' not found.{kept}", 404, param)
        return stored

    def history(self, previous_response_id: str | None) -> list[dict]:
        """The conversation a previous response ended: the messages it answered (its instructions
        left out, as OpenAI's), then its output as the assistant's turn."""
        if previous_response_id is None:
            return []
        previous = self.stored(previous_response_id, "previous_response_id")
        return append_items(copy.deepcopy(previous.messages), previous.body["output"], "previous response's output")

    @staticmethod
    def response_body(req: ResponsesRequest, response_id: str, model: str, params: SamplingParams,
                      keep: bool) -> dict:
        """The response while it runs, with the request's parameters echoed (temperature and
        top_p those it runs with: the request's, else the checkpoint's defaults)."""
        reasoning = req.reasoning.model_dump(exclude={"generate_summary"}) if req.reasoning else \
            {"effort": None, "summary": None}
        return {"id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
                "model": model, "output": [], "usage": None, "error": None, "incomplete_details": None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls,
                "previous_response_id": req.previous_response_id, "reasoning": reasoning, "store": keep,
                "temperature": params.temperature, "top_p": params.top_p,
                "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
                "tool_choice": req.tool_choice, "tools": req.tools, "truncation": "disabled", "user": req.user,
                "background": False, "service_tier": req.service_tier or "auto", "top_logprobs": 0}

    # ---- from the engine's deltas to the response ----

    async def events(self, run: ResponseRun) -> AsyncIterator[dict]:
        """The response's stream events, the last of them the finished response (response.completed,
        .incomplete or .failed)."""
        output = ResponseOutput()
        yield output.event("response.created", response=run.body)
        yield output.event("response.in_progress", response=run.body)
        token_ids, last = [], None
        async for delta in run.stream:
            last = delta
            if delta.finish_reason == "error":
                error = {"code": "server_error", "message": delta.error or "the request failed"}
                yield output.event("response.failed", response=run.body | {"status": "failed", "error": error,
                                                                           "output": output.items})
                return
            token_ids += delta.token_ids
            final = delta.finish_reason is not None
            parsed = ParsedText(content=delta.text) if run.parser is None else run.parser.feed(delta.text, final)
            for event in output.feed(parsed):
                yield event
        status = STATUS.get(last.finish_reason, "completed")
        for event in output.finish(status):
            yield event
        done = run.body | {"status": status, "output": output.items,
                           "usage": usage(last.num_prompt_tokens, last.num_output_tokens,
                                          self.reasoning_tokens(run.parser, output.items, token_ids),
                                          last.num_cached_tokens)}
        if status == "incomplete":
            done["incomplete_details"] = {"reason": "max_output_tokens"}
        if run.stored_messages is not None:
            self.store.put(StoredResponse(done, run.stored_messages))
        yield output.event(FINAL_EVENT[status], response=done)

    async def collect(self, run: ResponseRun) -> JSONResponse:
        async for event in self.events(run):
            last = event
        response = last["response"]
        if response["status"] == "failed":
            return error_response(response["error"]["message"], 500)
        return JSONResponse(response)

    def reasoning_tokens(self, parser: ChatOutputParser | None, items: list[dict], token_ids: list[int]) -> int:
        if parser is None or parser.reasoning is None or not any(item["type"] == "reasoning" for item in items):
            return 0
        return count_reasoning_tokens(token_ids, *self.think_tokens, parser.reasoning.opened)
