"""The OpenAI-compatible HTTP API: routes, request checks, and response shapes.

Each request is checked and tokenized on the event loop, then handed to the AsyncEngine, which
sends it to the engine process; its tokens come back as RequestDeltas. Anything wrong with a request is a 4xx with OpenAI's error
JSON before it reaches the engine, so one bad request never disturbs the others. A client that
goes away gets its request aborted, which frees its KV blocks before the engine's next step.
"""
import asyncio
import dataclasses
import json
import logging
import math
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from mini_engine import __version__
from mini_engine.chat_template import (ChatTemplate, checkpoint_special_tokens, continue_final_message,
                                       template_message)
from mini_engine.config import EngineConfig
from mini_engine.engine.prompt_embeds import (PLACEHOLDER_TOKEN, check_prompt_embeds, conflict_message,
                                             conflicting_field, decode_prompt_embeds)
from mini_engine.lora import LoRARequest
from mini_engine.pooling_params import PoolingParams, truncate_prompt
from mini_engine.sampling_params import SamplingParams, check_truncate_prompt_tokens
from mini_engine.server.async_engine import RequestDelta, RequestStream
from mini_engine.server.beam_search_endpoint import BeamSearchEndpoint
from mini_engine.server.constraints import forced_tool, structured_outputs
from mini_engine.server.data_parallel import start_engines
from mini_engine.server.dev_endpoints import add_dev_routes, add_profile_routes, dev_mode, profiling
from mini_engine.server.embeddings import PoolingEndpoints
from mini_engine.server.logprobs_json import LogprobsJSON
from mini_engine.server.lora_modules import LoRAModulePath, LoRAModules, runtime_updating_allowed
from mini_engine.server.metrics import ServerMetrics
from mini_engine.server.middleware import ServerLoad, add_middleware
from mini_engine.server.output_parsers import ChatOutputParser, ParsedText, ParserOptions
from mini_engine.server.protocol import (MAX_LOGPROBS, ChatCompletionRequest, ClassificationRequest,
                                         CompletionRequest, DetokenizeRequest, EmbeddingRequest,
                                         LoadLoRAAdapterRequest, PoolingRequest, ProtocolError,
                                         RerankRequest, SamplingRequest, ScoreRequest, TokenizeRequest,
                                         UnloadLoRAAdapterRequest, completion_body, error_body, error_response,
                                         model_card, random_id, response_id, usage)
from mini_engine.server.responses import ResponsesEndpoint
from mini_engine.server.responses_protocol import ResponsesRequest
from mini_engine.server.sagemaker import add_invocations_route
from mini_engine.server.serving_options import RESPONSE_ROLE, ServingOptions
from mini_engine.server.stats_logger import StatsLogger, log_stats_interval
from mini_engine.tokenizer import encode_prompt, load_tokenizer

logger = logging.getLogger("mini_engine.server")

# OpenAI's default for /v1/completions, and vLLM's for an explicit null too (its CompletionRequest
# validator normalize_null_max_tokens): chat's default, the rest of the context, does not apply here.
DEFAULT_COMPLETION_MAX_TOKENS = 16

# The request fields that pass to SamplingParams when the client sets them (not null): the rest
# come from the checkpoint's generation_config.json where it sets them, else SamplingParams'.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty", "repetition_penalty",
                   "min_p")



@dataclasses.dataclass
class Echo:
    """A completion request's echo=true: the prompt, as text and token ids (and those as the token
    strings logprobs show), goes before each completion; drop_output: max_tokens was 0, so the
    prompt alone is returned."""
    text: str
    prompt_token_ids: list[int]
    token_strings: list[str]
    drop_output: bool


@dataclasses.dataclass
class Prompts:
    """A request's prompts (a completion request may send several) and their choices: choice k is
    completion k % n of prompt k // n, as vLLM numbers them; echoes: each prompt's, with echo=true;
    chat_echo: with a chat request's echo=true, the text that goes before each choice's content
    (OpenAIServer.chat_echo's); role: a chat answer's (OpenAIServer.chat_request_role's);
    logprobs_json: how its logprobs name tokens (OpenAIServer.request_logprobs_json's)."""
    token_ids: list[list[int]]
    n: int
    echoes: list[Echo] | None = None
    chat_echo: str = ""
    role: str = RESPONSE_ROLE
    logprobs_json: LogprobsJSON = dataclasses.field(kw_only=True)


class StreamedEchoes:
    """echo=true in a stream, as vLLM streams it: each choice's first chunk holds its prompt (with
    logprobs, the prompt's tokens' first), then its first tokens (none where max_tokens was 0). A
    prompt's log-probabilities come with its first completion's first delta (SamplingParams.
    completion): a sibling whose tokens come sooner is held until that delta has come."""

    def __init__(self, prompts: Prompts):
        self.prompts = prompts
        self.prompt_logprobs: list[list | None] = [None] * len(prompts.token_ids)
        self.sent = [False] * len(prompts.token_ids) * prompts.n
        self.held: dict[int, list[RequestDelta]] = {}

    def ready(self, ready: list[tuple[int, RequestDelta]]) -> list[tuple[int, RequestDelta]]:
        """What may go out of the deltas ready now: a choice's held ones merged with its new ones
        once its prompt's log-probabilities have come, or at once where it asked for none."""
        n = self.prompts.n
        for k, delta in ready:
            self.prompt_logprobs[k // n] = self.prompt_logprobs[k // n] or delta.prompt_logprobs
        for k, delta in ready:
            if not self.sent[k]:
                self.held.setdefault(k, []).append(delta)
        out = [(k, delta) for k, delta in ready if self.sent[k]]
        for k in sorted(self.held):
            deltas = self.held[k]
            # The prompt's first completion brings what there is of them: it never waits, nor
            # does a sibling once it has gone out.
            asked = any(d.logprobs is not None for d in deltas)   # a last delta may have no tokens
            waits = asked and self.prompt_logprobs[k // n] is None and k % n and not self.sent[k // n * n]
            if not waits or deltas[-1].finish_reason == "error":
                del self.held[k]
                out.append((k, deltas[0] if len(deltas) == 1 else dataclasses.replace(
                    deltas[-1], text="".join(d.text for d in deltas),
                    token_ids=[t for d in deltas for t in d.token_ids],
                    logprobs=[lp for d in deltas for lp in d.logprobs or []] if asked else None)))
        return sorted(out, key=lambda item: item[0])

    def first(self, k: int, delta: RequestDelta, logprobs_json: LogprobsJSON) -> tuple[RequestDelta, dict | None, int]:
        """Choice k's first delta with its prompt before it, its logprobs, and the text offset after it."""
        self.sent[k] = True
        echo = self.prompts.echoes[k // self.prompts.n]
        offset = sum(map(len, echo.token_strings))
        logprobs, offset = logprobs_json.delta_logprobs(delta, False, offset)
        if echo.drop_output:
            delta = dataclasses.replace(delta, text="", token_ids=[], num_output_tokens=0)
            logprobs = None if logprobs is None else {key: [] for key in logprobs}
        delta = dataclasses.replace(delta, text=echo.text + delta.text)
        prompt_logprobs = self.prompt_logprobs[k // self.prompts.n]
        if logprobs is not None and prompt_logprobs is not None:
            prompt = logprobs_json.echoed_prompt_logprobs(echo.token_strings, prompt_logprobs)
            logprobs = {key: prompt[key] + logprobs[key] for key in prompt}
        return delta, logprobs, offset


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


class AbortOnCloseResponse(StreamingResponse):
    """A streaming response that aborts its request however it ends: finished, client gone
    (Starlette cancels the stream), or failed while writing."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def interleaved(streams: list[RequestStream]) -> AsyncIterator[list[tuple[int, RequestDelta]]]:
    """The deltas of every stream as they come, until all have finished: at each wake-up, those
    ready then, as (stream index, delta) in index order (a response sends them as one chunk)."""
    if len(streams) == 1:
        async for delta in streams[0]:
            yield [(0, delta)]
        return
    waiting = {asyncio.ensure_future(anext(stream)): k for k, stream in enumerate(streams)}
    try:
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            ready = []
            for task in sorted(done, key=waiting.get):
                k = waiting.pop(task)
                try:
                    ready.append((k, task.result()))
                except StopAsyncIteration:
                    continue
                waiting[asyncio.ensure_future(anext(streams[k]))] = k
            if ready:
                yield ready
    finally:
        for task in waiting:
            task.cancel()


async def wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class OpenAIServer:
    def __init__(self, config: EngineConfig, model_name: str, parsers: ParserOptions | None = None,
                 lora_modules: list[LoRAModulePath] = (), options: ServingOptions = ServingOptions()):
        self.config = config
        self.model_name = model_name
        self.parsers = parsers or ParserOptions()
        self.metrics = ServerMetrics(model_name, config.max_loras if config.enable_lora else None,
                                     options.data_parallel_size, config.max_model_len)
        self.loras = LoRAModules(model_name, lora_modules)
        self.async_engine = start_engines(config, self.metrics, tuple(self.loras.requests.values()),
                                          options.data_parallel_size)
        self.tokenizer = load_tokenizer(config.tokenizer_path)
        # By the tokens' text: prompt_logprobs' decoded_token stay text with return_tokens_as_token_ids, as vLLM's.
        self.logprobs_json = LogprobsJSON(self.tokenizer)
        self.options = options
        self.chat_template = ChatTemplate.from_pretrained(config.tokenizer_path, options.chat_template)
        self.chat_special_tokens = checkpoint_special_tokens(config.tokenizer_path)    # for a request's own template
        self.beam_search = BeamSearchEndpoint(self)

    # ---- from an OpenAI request to the engine's ----

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the served model); a 404 for a name this
        server does not serve."""
        return self.loras.resolve(model)

    def check(self, req: SamplingRequest) -> LoRARequest | None:
        lora_request = self.check_model(req.model)
        if self.config.runner == "pooling":
            raise ProtocolError("this server runs a pooling model (--runner pooling): use /v1/embeddings, /classify, "
                                "/pooling, /score or /rerank")
        param = req.unsupported()
        if param is not None:
            raise ProtocolError(f"{param}={getattr(req, param)!r} is not supported by this server", param=param)
        if req.length_penalty != 1.0 and not req.use_beam_search:
            raise ProtocolError(f"length_penalty={req.length_penalty!r} applies only to beam search "
                                "(use_beam_search=true)", param="length_penalty")
        if req.stream_options is not None and not req.stream:
            raise ProtocolError("stream_options is only allowed with stream=true", param="stream_options")
        if req.prompt_logprobs is not None and req.stream:
            raise ProtocolError("prompt_logprobs is not supported with stream=true", param="prompt_logprobs")
        if req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= MAX_LOGPROBS:
            raise ProtocolError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {req.prompt_logprobs}",
                                param="prompt_logprobs")
        self.check_priority(req.priority)
        return lora_request

    def response_model_name(self, lora_request: LoRARequest | None) -> str:
        """A response's `model`: the adapter's name where the request named one (vLLM's)."""
        return self.model_name if lora_request is None else lora_request.lora_name

    def request_logprobs_json(self, req: SamplingRequest) -> LogprobsJSON:
        """How a request's logprobs name tokens: as "token_id:{id}" where its return_tokens_as_token_ids
        asks, or where it leaves that unset and the server runs with --return-tokens-as-token-ids
        (vLLM's rule); else by their text."""
        as_token_ids = req.return_tokens_as_token_ids
        if as_token_ids is None:
            as_token_ids = self.options.return_tokens_as_token_ids
        return LogprobsJSON(self.tokenizer, True) if as_token_ids else self.logprobs_json

    def check_priority(self, priority: int) -> None:
        if priority and self.config.scheduling_policy != "priority":
            raise ProtocolError(f"priority {priority} needs a server started with --scheduling-policy priority",
                                param="priority")

    def sampling_params(self, req: SamplingRequest, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        # Only what the client set: the defaults belong to the config (the checkpoint's
        # generation_config.json) and to SamplingParams.
        set_by_client = {name: value for name in SAMPLING_FIELDS if (value := getattr(req, name)) is not None}
        constraint = structured_outputs(req)
        if req.logit_bias:               # OpenAI's keys are token ids written as strings
            try:      # and, as vLLM's server does, biases clamped to [-100, 100] (NaN refused below)
                set_by_client["logit_bias"] = {int(token): bias if math.isnan(bias) else min(100.0, max(-100.0, bias))
                                               for token, bias in req.logit_bias.items()}
            except ValueError:
                raise ProtocolError(f"logit_bias keys must be token ids, got {sorted(req.logit_bias)}",
                                    param="logit_bias") from None
        try:
            return self.config.default_sampling_params(
                max_tokens=max_tokens, ignore_eos=req.ignore_eos, stop_token_ids=req.stop_token_ids,
                stop=req.stop_list, seed=req.seed, logprobs=logprobs, n=1 if req.n is None else req.n,
                min_tokens=req.min_tokens, include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens,
                spaces_between_special_tokens=req.spaces_between_special_tokens,
                truncate_prompt_tokens=req.truncate_prompt_tokens,
                allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words,
                prompt_logprobs=req.prompt_logprobs if req.prompt_logprobs is not None else prompt_logprobs,
                structured_outputs=constraint, extra_args=req.vllm_xargs, **set_by_client)
        except ValueError as e:     # the message starts with the parameter's name
            raise ProtocolError(str(e), param=str(e).split(" ", 1)[0]) from None

    @staticmethod
    def prompt_list(prompt: str | list) -> list[str | list[int]]:
        """A completion request's prompt as OpenAI's API takes it: a text, token ids, or a batch of
        either."""
        return prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]

    def tokenize(self, prompt: str | list[int], where: str = "prompt", add_special_tokens: bool = False,
                 param: str = "prompt") -> list[int]:
        try:
            return encode_prompt(self.tokenizer, prompt, add_special_tokens)
        except ValueError as e:
            raise ProtocolError(f"{where}: {e}" if where != param else str(e), param=param) from None

    def truncated(self, prompts: list[list[int]], req: SamplingRequest) -> list[list[int]]:
        """Each prompt's last req.truncate_prompt_tokens tokens (vLLM's; -1: max_model_len), cut here,
        before anything counts them: a chat's default max_tokens, usage's prompt_tokens, echo."""
        try:
            check_truncate_prompt_tokens(req.truncate_prompt_tokens)
            self.async_engine.limits.check_truncation(req.truncate_prompt_tokens)
        except ValueError as e:
            raise ProtocolError(str(e), param="truncate_prompt_tokens") from None
        return [truncate_prompt(ids, req, self.config.max_model_len) for ids in prompts]

    def add(self, request_id: str, prompts: list[list[int]], params: SamplingParams | PoolingParams,
            priority: int = 0, lora_request: LoRARequest | None = None,
            cache_salt: str | None = None, prompt_embeds: list | None = None) -> list[RequestStream]:
        """A stream for each of the params.n completions of each prompt, in that order: one request
        for one prompt and n = 1; else vLLM's ids ("{request_id}-{prompt}" for a batch of prompts,
        "{index}_..." for each of n, seeded seed + index), and the n of a prompt share it, which the
        prefix cache computes once. All are validated before any is sent: one bad prompt of a
        batch refuses the request. prompt_embeds: each prompt's embeddings, checked, where prompts
        are their placeholders (embedded_prompts)."""
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        for i, prompt in enumerate(prompts):        # the children differ in seed alone
            try:
                self.async_engine.limits.validate(prompt, params)
            except (ValueError, TypeError) as e:
                raise ProtocolError(f"prompt {i}: {e}" if len(prompts) > 1 else str(e)) from None
        n = params.n if isinstance(params, SamplingParams) else 1
        if self.options.enable_log_requests:
            for prompt_id, prompt in zip(ids, prompts):
                shown = prompt if self.options.max_log_len is None else prompt[:self.options.max_log_len]
                logger.info("Received request %s: params: %s, prompt_token_ids: %s%s, lora_request: %s, prompt_embeds: %s",
                            prompt_id, params, shown, " ..." if len(shown) < len(prompt) else "", lora_request,
                            prompt_embeds is not None)
        embeds = prompt_embeds or [None] * len(prompts)
        completions = [(prompt, embedded, child_id, child)
                       for prompt_id, prompt, embedded in zip(ids, prompts, embeds)
                       for child_id, child in ([(prompt_id, params)] if n == 1 else
                                               [(f"{k}_{prompt_id}", params.completion(k)) for k in range(params.n)])]
        try:
            # One engine for all of them (one of several under data parallelism), so that a prompt's
            # n completions share its prefix-cache blocks; chosen by the first prompt's tokens (a
            # prompt given as embeddings has placeholders, which say nothing of its blocks).
            engine = self.async_engine.next_engine(prompts[0] if prompt_embeds is None else [])
            return [engine.add_request(child_id, prompt, child, validated=True, priority=priority,
                                       lora_request=lora_request, cache_salt=cache_salt, prompt_embeds=embedded)
                    for prompt, embedded, child_id, child in completions]
        except (ValueError, TypeError) as e:
            raise ProtocolError(str(e)) from None
        except RuntimeError as e:        # the engine process is gone
            raise ProtocolError(str(e), 503) from None

    def max_tokens(self, asked: int | None, default: Callable[[], int]) -> int:
        """A request's max_tokens: what it asked for, else default() (a completion's 16, a chat's
        rest of the context), and at most generation_config's max_new_tokens where it sets one
        (vLLM's cap on every request, applied without an error)."""
        value = asked if asked is not None else default()
        cap = self.config.max_new_tokens
        return value if cap is None else min(value, cap)

    def remaining_tokens(self, prompt_token_ids: list[int]) -> int:
        """A chat request's default max_tokens: as many as max_model_len and the KV pool leave after
        the prompt (a pool smaller than one max_model_len sequence would otherwise refuse every
        request that gave no max_tokens)."""
        limits = self.async_engine.limits
        left = limits.max_sequence_tokens() - len(prompt_token_ids)
        if left < 1:
            raise ProtocolError(f"the prompt has {len(prompt_token_ids)} tokens, which leaves no room to generate "
                                f"within max_model_len={limits.max_model_len} and a KV pool of "
                                f"{limits.num_blocks * limits.block_size} tokens", param="messages")
        return left

    def request_chat_template(self, req: ChatCompletionRequest) -> tuple[ChatTemplate, str]:
        """The template a request renders with, and the field to blame where it fails: its own
        (`chat_template`, or vLLM's `chat_template_kwargs.chat_template`, which wins as there),
        only where the server trusts requests' templates; else the server's."""
        kwargs = req.chat_template_kwargs or {}
        param = "chat_template_kwargs" if kwargs.get("chat_template") is not None else "chat_template"
        source = kwargs.get("chat_template") if param == "chat_template_kwargs" else req.chat_template
        if source is None:
            if self.chat_template is None:
                raise ProtocolError("this model has no chat template (tokenizer_config.json), and the server was "
                                    "started without --chat-template: send the prompt itself (/v1/completions, or a "
                                    "pooling endpoint's input), not messages")
            return self.chat_template, "messages"
        if not self.options.trust_request_chat_template:
            # vLLM's refusal: a template is code the server runs, and one could loop or take all memory
            raise ProtocolError("Chat template is passed with request, but --trust-request-chat-template is not "
                                "set. Refused request with untrusted chat template.", param=param)
        try:
            return ChatTemplate(source, self.chat_special_tokens), param
        except ValueError as e:
            raise ProtocolError(str(e), param=param) from None

    def render_chat(self, req: ChatCompletionRequest) -> tuple[str, list[int]]:
        """The prompt's text and its token ids. req.continue_final_message (vLLM's, which the
        pooling endpoints take too): the text ends with the last message's content, left open."""
        if req.continue_final_message and req.add_generation_prompt:
            raise ProtocolError("continue_final_message and add_generation_prompt cannot both be true: the first "
                                "continues the last message, the second starts a new one (send "
                                "add_generation_prompt: false)", param="continue_final_message")
        template, blamed = self.request_chat_template(req)
        try:
            messages = [template_message(m.model_dump(exclude_none=True)) for m in req.messages]
        except ValueError as e:
            raise ProtocolError(str(e), param="messages") from None
        kwargs = dict(req.chat_template_kwargs or {})
        kwargs.pop("chat_template", None)           # the template itself (request_chat_template's)
        if reserved := {"messages", "add_generation_prompt", "continue_final_message"} & kwargs.keys():
            raise ProtocolError(f"chat_template_kwargs may not set {sorted(reserved)}: they are the request's own",
                                param="chat_template_kwargs")
        if req.tools:       # shown to the model whatever the tool_choice, as vLLM's default, nulls too
            kwargs = kwargs | {"tools": [tool.model_dump() for tool in req.tools]}
        try:
            text = template.render(messages, req.add_generation_prompt, **kwargs)
        except ValueError as e:     # the template failed on these messages
            raise ProtocolError(f"the chat template cannot render these messages: {e}", param=blamed) from None
        if req.continue_final_message:
            try:
                text = continue_final_message(text, messages)
            except ValueError as e:
                raise ProtocolError(str(e), param="messages") from None
        return text, self.tokenize(text)

    def chat_request_role(self, req: ChatCompletionRequest) -> str:
        """The role of a chat response's messages, as vLLM's get_chat_request_role: a generation
        prompt opens a turn in the response role (--response-role, "assistant"); without one the
        choices continue the final message, in its role."""
        if req.add_generation_prompt or not req.messages:
            return self.options.response_role
        return req.messages[-1].role

    @staticmethod
    def chat_echo(req: ChatCompletionRequest, role: str) -> str:
        """A chat request's echo=true, as vLLM's: the final message's content goes before each
        choice's where that message has the response's role (chat_request_role's)."""
        final = req.messages[-1] if req.messages else None
        if not req.echo or final is None or final.role != role:
            return ""
        return template_message(final.model_dump(exclude_none=True)).get("content") or ""

    def check_tools(self, req: ChatCompletionRequest) -> None:
        if req.tool_choice is not None and req.tools is None:       # as OpenAI's and vLLM's
            raise ProtocolError("tool_choice is only allowed when tools are set", param="tool_choice")
        forced_tool(req)
        if req.parses_tool_calls and not self.parsers.auto_tool_choice:
            raise ProtocolError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                                'set (or send tool_choice "none")', param="tool_choice")

    def output_parsers(self, req: ChatCompletionRequest, prompt: str,
                       params: SamplingParams) -> list[ChatOutputParser] | None:
        """A parser for each of the params.n completions, where the server parses reasoning or the
        request's tool calls; None where neither (the text goes out as it is)."""
        # Structured outputs (a forced tool_choice's too) hold only what follows the thought where
        # the engine has the reasoning parser (serve.py gives it --reasoning-parser); an engine
        # without it holds the output from its first token, and none of it is reasoning.
        reasoning = self.parsers.reasoning_parser is not None and (
            params.structured_outputs is None or self.config.reasoning_parser is not None)
        forced = forced_tool(req)
        if not reasoning and not req.parses_tool_calls and forced is None:
            return None
        tools = [tool.model_dump() for tool in req.tools or []]
        return [ChatOutputParser(prompt, reasoning, req.parses_tool_calls, req.parallel_tool_calls is not False, forced,
                                 self.parsers.tool_call_parser or "hermes", tools) for _ in range(params.n)]

    # ---- from the engine's deltas to OpenAI's responses ----

    def choice(self, index: int, text: str, finish_reason: str | None, chat: bool, logprobs: dict | None = None,
               chunk: bool = False, role: str = RESPONSE_ROLE) -> dict:
        if not chat:
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        key, message = ("delta", {"content": text}) if chunk else ("message", {"role": role, "content": text})
        return {"index": index, key: message, "logprobs": logprobs, "finish_reason": finish_reason}

    @staticmethod
    def parsed_choice(index: int, parsed: ParsedText, parser: ChatOutputParser, finish_reason: str | None,
                      logprobs: dict | None, chunk: bool = False, role: str = RESPONSE_ROLE) -> dict:
        """A chat choice whose text went through the output parsers: as vLLM's, the reasoning in
        `reasoning`, the calls in `tool_calls` and finish_reason "tool_calls" once a call was made;
        a streamed delta holds only what it adds."""
        finish_reason = parser.finish_reason(finish_reason)
        if chunk:
            message = {key: value for key, value in (("reasoning", parsed.reasoning), ("content", parsed.content))
                       if value}
            if parsed.tool_calls:
                message["tool_calls"] = [call.to_json(streamed=True) for call in parsed.tool_calls]
            return {"index": index, "delta": message, "logprobs": logprobs, "finish_reason": finish_reason}
        message = {"role": role, "content": parsed.content or None}
        if parser.reasoning is not None:
            message["reasoning"] = parsed.reasoning or None
        if parser.tool_calls is not None:
            message["tool_calls"] = [call.to_json() for call in parsed.tool_calls]
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def usage_of(self, last: list[RequestDelta], n: int) -> dict:
        """Each prompt once, however many (n) completions share it, and every completion's tokens;
        with --enable-prompt-tokens-details, the prompt tokens the prefix cache served."""
        cached = sum(delta.num_cached_tokens for delta in last[::n])
        return usage(sum(delta.num_prompt_tokens for delta in last[::n]),
                     sum(delta.num_output_tokens for delta in last),
                     cached if self.options.enable_prompt_tokens_details else None)

    async def stream_events(self, streams: list[RequestStream], request_id: str, created: int, chat: bool,
                            include_usage: bool, prompts: Prompts, parsers: list[ChatOutputParser] | None = None,
                            model: str | None = None, continuous_usage: bool = False) -> AsyncIterator[str]:
        """continuous_usage: every chunk carries the request's usage so far (vLLM's
        continuous_usage_stats; its chunks hold one choice each, and count that choice's tokens,
        where one here may hold several, and counts all the request's)."""
        model = model or self.model_name
        offsets, last, failed = [0] * len(streams), [None] * len(streams), None

        def so_far() -> dict | None:
            if not continuous_usage:
                return None
            return usage(sum(stream.num_prompt_tokens for stream in streams[::prompts.n]),
                         sum(delta.num_output_tokens for delta in last if delta is not None))
        if chat:
            first = [{"index": k, "delta": {"role": prompts.role, "content": ""}, "logprobs": None,
                      "finish_reason": None} for k in range(len(streams))]
            yield sse(completion_body(request_id, created, model, first, so_far(), chunk=True, chat=True))
            if prompts.chat_echo:       # as vLLM's, a chunk of its own before the choices' tokens
                echoed = [self.choice(k, prompts.chat_echo, None, True, chunk=True) for k in range(len(streams))]
                yield sse(completion_body(request_id, created, model, echoed, so_far(), chunk=True, chat=True))
        echoes = StreamedEchoes(prompts) if prompts.echoes is not None else None
        async for ready in interleaved(streams):
            choices = []          # the deltas ready together go out as one chunk
            if echoes is not None:
                ready = echoes.ready(ready)
            for k, delta in ready:
                last[k] = delta
                if delta.finish_reason == "error":
                    failed = delta.error or "the request failed"
                    break
                if not delta.token_ids and delta.finish_reason is None:
                    continue
                if echoes is not None and not echoes.sent[k]:
                    delta, logprobs, offsets[k] = echoes.first(k, delta, prompts.logprobs_json)
                    last[k] = delta
                    choices.append(self.choice(k, delta.text, delta.finish_reason, chat, logprobs, True))
                    continue
                logprobs, offsets[k] = prompts.logprobs_json.delta_logprobs(delta, chat, offsets[k])
                if parsers is None:
                    choices.append(self.choice(k, delta.text, delta.finish_reason, chat, logprobs, True))
                    continue
                choice = self.parsed_choice(k, parsers[k].feed(delta.text, final=delta.finish_reason is not None),
                                            parsers[k], delta.finish_reason, logprobs, chunk=True)
                if choice["delta"] or logprobs is not None or delta.finish_reason is not None:
                    choices.append(choice)
            if failed is not None:
                yield sse(error_body(failed, 500))
                break
            if choices:
                yield sse(completion_body(request_id, created, model, choices, so_far(), chunk=True, chat=chat))
        if include_usage and failed is None:
            u = self.usage_of(last, prompts.n)
            yield sse(completion_body(request_id, created, model, [], u, chunk=True, chat=chat))
        yield sse("[DONE]")

    async def collect(self, streams: list[RequestStream], request_id: str, created: int, chat: bool,
                      prompts: Prompts, parsers: list[ChatOutputParser] | None = None,
                      model: str | None = None) -> JSONResponse:
        n, echoes = prompts.n, prompts.echoes
        texts, logprobs = [[] for _ in streams], [None] * len(streams)
        # Echoed, a completion's tokens start where its prompt's token strings end.
        offsets = [sum(map(len, echoes[k // n].token_strings)) if echoes else 0 for k in range(len(streams))]
        last = [None] * len(streams)
        prompt_logprobs = [None] * len(prompts.token_ids)       # each prompt's, which its first completion computes
        async for ready in interleaved(streams):
            for k, delta in ready:
                last[k] = delta
                prompt_logprobs[k // n] = prompt_logprobs[k // n] or delta.prompt_logprobs
                if delta.finish_reason == "error":
                    return error_response(delta.error or "the request failed", 500)
                if delta.logprobs is not None:
                    lp, offsets[k] = prompts.logprobs_json.delta_logprobs(delta, chat, offsets[k])
                    logprobs[k] = lp if logprobs[k] is None else {key: logprobs[k][key] + lp[key] for key in lp}
                texts[k].append(delta.text)
        if echoes is not None:
            for k in range(len(streams)):
                texts[k], logprobs[k], last[k] = self.echoed(echoes[k // n], texts[k], logprobs[k], last[k],
                                                             prompt_logprobs[k // n], prompts.logprobs_json)
        if parsers is None:
            choices = [self.choice(k, "".join(texts[k]), last[k].finish_reason, chat, logprobs[k], role=prompts.role)
                       for k in range(len(streams))]
        else:
            choices = [self.parsed_choice(k, parsers[k].feed("".join(texts[k]), final=True), parsers[k],
                                          last[k].finish_reason, logprobs[k], role=prompts.role)
                       for k in range(len(streams))]
        if chat and prompts.chat_echo:
            for choice in choices:
                choice["message"]["content"] = prompts.chat_echo + (choice["message"]["content"] or "")
        body = completion_body(request_id, created, model or self.model_name, choices, self.usage_of(last, n),
                               chat=chat)
        # Where vLLM puts them: the chat response's, each completion's (its prompt's).
        values = [None if lp is None else self.logprobs_json.prompt_logprobs_json(ids, lp)
                  for ids, lp in zip(prompts.token_ids, prompt_logprobs)]
        for k, place in enumerate([body] if chat else choices):
            if values[k // n] is not None:
                place["prompt_logprobs"] = values[k // n]
        return JSONResponse(body)

    @staticmethod
    def echoed(echo: Echo, text: list[str], logprobs: dict | None, last: RequestDelta, prompt_logprobs: list | None,
               logprobs_json: LogprobsJSON) -> tuple[list[str], dict | None, RequestDelta]:
        """A completion with its prompt before it (and, where echo.drop_output, the prompt alone,
        no completion tokens counted); logprobs with the prompt's first, from its prompt_logprobs."""
        if echo.drop_output:
            text = []
            logprobs = None if logprobs is None else {key: [] for key in logprobs}
            last = dataclasses.replace(last, num_output_tokens=0)
        text = [echo.text, *text]
        if prompt_logprobs is None or logprobs is None:
            return text, logprobs, last
        prompt = logprobs_json.echoed_prompt_logprobs(echo.token_strings, prompt_logprobs)
        return text, {key: prompt[key] + logprobs[key] for key in prompt}, last

    async def respond(self, raw: Request, request_id: str, streams: list[RequestStream], chat: bool,
                      streaming: bool, include_usage: bool, prompts: Prompts,
                      parsers: list[ChatOutputParser] | None = None, model: str | None = None,
                      continuous_usage: bool = False) -> Response:
        """streams: one for each completion (choice) asked for (add's); parsers: a chat response's
        output parsers, one for each (output_parsers'); model: the responses' `model` (default:
        the served model's name)."""

        created = int(time.time())
        if streaming:
            return self.streamed(self.stream_events(streams, request_id, created, chat, include_usage, prompts,
                                                    parsers, model, continuous_usage), streams)
        return await self.unless_disconnected(
            raw, self.collect(streams, request_id, created, chat, prompts, parsers, model), streams)

    def streamed(self, events: AsyncIterator[str], streams: list[RequestStream]) -> AbortOnCloseResponse:
        """Server-sent events, whose requests are aborted however the stream ends."""
        return AbortOnCloseResponse(events, lambda: self.abort(streams))

    def abort(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            if not stream.finished:
                self.async_engine.abort(stream.request_id)

    async def unless_disconnected(self, raw: Request, response: Awaitable[Response],
                                  streams: list[RequestStream]) -> Response:
        """A response written at the end (not streamed): awaited while watching for the client
        leaving, whose requests are then aborted (their KV blocks freed)."""
        collector = asyncio.ensure_future(response)
        watcher = asyncio.ensure_future(wait_for_disconnect(raw))
        try:
            await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if collector.done():
                return collector.result()
            collector.cancel()
            return error_response("the client disconnected", 499)
        finally:
            watcher.cancel()
            self.abort(streams)

    # ---- routes ----

    def tokenize_route(self, req: TokenizeRequest) -> dict:
        """vLLM's /tokenize: what the completion or chat endpoint would make of this prompt."""
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ProtocolError("give either prompt or messages", param="prompt")
        if self.tokenizer is None:
            raise ProtocolError("this checkpoint has no tokenizer.json")
        text = req.prompt
        if req.messages is not None:
            chat = ChatCompletionRequest(messages=req.messages, tools=req.tools,
                                         add_generation_prompt=req.add_generation_prompt,
                                         continue_final_message=req.continue_final_message,
                                         chat_template=req.chat_template,
                                         chat_template_kwargs=req.chat_template_kwargs)
            text, _ = self.render_chat(chat)
        special = req.add_special_tokens if req.add_special_tokens is not None else \
            self.config.runner == "pooling" and req.messages is None
        ids = self.tokenizer.encode(text, add_special_tokens=special).ids
        return {"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": ids,
                "token_strs": [self.tokenizer.id_to_token(t) for t in ids] if req.return_token_strs else None}

    def detokenize_route(self, req: DetokenizeRequest) -> dict:
        """vLLM's /detokenize: the text of token ids, special tokens included."""
        self.check_model(req.model)
        if self.tokenizer is None:
            raise ProtocolError("this checkpoint has no tokenizer.json")
        vocab = self.tokenizer.get_vocab_size()
        if bad := [t for t in req.tokens if not 0 <= t < vocab]:
            raise ProtocolError(f"tokens outside the vocabulary (0 to {vocab - 1}): {bad[:8]}", param="tokens")
        return {"prompt": self.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        lora_request = self.check(req)
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise ProtocolError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}", param="logprobs")
        if req.prompt_embeds is not None:
            # (OpenAI's client needs a prompt: vLLM's example sends "" beside prompt_embeds.)
            if req.prompt not in (None, ""):
                raise ProtocolError("give prompt or prompt_embeds, not both", param="prompt")
            return await self.embedded_completions(req, raw, lora_request)
        if req.prompt is None:
            raise ProtocolError("give prompt (or, with --enable-prompt-embeds, vLLM's prompt_embeds)", param="prompt")
        inputs = self.prompt_list(req.prompt)
        several = len(inputs) > 1
        whole = [self.tokenize(prompt, f"prompt {i}" if several else "prompt") for i, prompt in enumerate(inputs)]
        prompts = self.truncated(whole, req)
        max_tokens = self.max_tokens(req.max_tokens, lambda: DEFAULT_COMPLETION_MAX_TOKENS)
        logprobs_json = self.request_logprobs_json(req)
        if req.use_beam_search:         # n is the beam width, its n best beams the choices
            return await self.beam_search.respond(raw, req, Prompts(prompts, 1 if req.n is None else req.n,
                                                                    logprobs_json=logprobs_json),
                                                  max_tokens, "max_tokens", lora_request)
        echoes = None
        if req.echo:
            # A truncated prompt echoes the tokens kept, what the model saw (vLLM's echoes a text
            # prompt whole, beside the kept tokens' logprobs).
            echoes = [self.echo(prompt if len(ids) == len(all_ids) else ids, ids, max_tokens, logprobs_json)
                      for prompt, all_ids, ids in zip(inputs, whole, prompts)]
            if max_tokens == 0:     # one token is generated, and dropped
                max_tokens = 1
        params = self.sampling_params(req, max_tokens, req.logprobs, req.logprobs if echoes else None)
        request_id = random_id("cmpl")
        streams = self.add(request_id, prompts, params, req.priority, lora_request, req.cache_salt)
        return await self.respond(raw, response_id(raw, req, request_id), streams, False, req.stream, req.include_usage,
                                  Prompts(prompts, params.n, echoes, logprobs_json=logprobs_json),
                                  model=self.response_model_name(lora_request), continuous_usage=req.continuous_usage)

    async def embedded_completions(self, req: CompletionRequest, raw: Request,
                                   lora_request: LoRARequest | None) -> Response:
        """vLLM's prompt_embeds: each a base64 of torch.save(a [num_tokens, hidden_size] tensor),
        checked (and truncated) as LLM.generate checks them, a prompt each (engine/prompt_embeds.py)."""
        if not self.config.enable_prompt_embeds:        # before any of the client's bytes are unpickled
            raise ProtocolError("prompt_embeds needs the server started with --enable-prompt-embeds",
                                param="prompt_embeds")
        for name in ("echo", "use_beam_search"):
            if getattr(req, name):
                raise ProtocolError(f"{name} needs a prompt's tokens, which prompt_embeds have not", param=name)
        values = [req.prompt_embeds] if isinstance(req.prompt_embeds, str) else req.prompt_embeds
        if not values:
            raise ProtocolError("prompt_embeds is empty", param="prompt_embeds")
        max_tokens = self.max_tokens(req.max_tokens, lambda: DEFAULT_COMPLETION_MAX_TOKENS)
        params = self.sampling_params(req, max_tokens, req.logprobs, None)
        if (name := conflicting_field(params)) is not None:
            raise ProtocolError(conflict_message(name), param=name)
        embeds = []
        for i, value in enumerate(values):
            where = f"prompt_embeds {i}" if len(values) > 1 else "prompt_embeds"
            try:
                embeds.append(check_prompt_embeds(decode_prompt_embeds(value), params,
                                                  self.config.model_config.hidden_size, self.config.max_model_len,
                                                  self.async_engine.limits.prompt_embeds_dtype))
            except (ValueError, TypeError) as e:
                raise ProtocolError(f"{where}: {e}", param="prompt_embeds") from None
        prompts = [[PLACEHOLDER_TOKEN] * len(e) for e in embeds]
        request_id = random_id("cmpl")
        streams = self.add(request_id, prompts, params, req.priority, lora_request, req.cache_salt, embeds)
        return await self.respond(raw, response_id(raw, req, request_id), streams, False, req.stream, req.include_usage,
                                  Prompts(prompts, params.n, logprobs_json=self.request_logprobs_json(req)),
                                  model=self.response_model_name(lora_request), continuous_usage=req.continuous_usage)

    def echo(self, prompt: str | list[int], prompt_token_ids: list[int], max_tokens: int,
             logprobs_json: LogprobsJSON) -> Echo:
        """As vLLM's echo: the prompt's text before each completion's and, with logprobs, its tokens'
        (prompt_logprobs); max_tokens 0 returns the prompt alone."""
        if not prompt_token_ids:
            raise ProtocolError("the prompt is empty", param="prompt")
        # Token ids decode with their special tokens, as the token strings of logprobs show them.
        text = prompt if isinstance(prompt, str) else \
            self.tokenizer.decode(prompt_token_ids, skip_special_tokens=False) if self.tokenizer else ""
        limit = self.async_engine.limits.max_model_len
        if max_tokens == 0 and len(prompt_token_ids) >= limit:
            raise ProtocolError(f"echo with max_tokens=0 needs a prompt shorter than max_model_len={limit} "
                                f"(one token is generated, and dropped), got {len(prompt_token_ids)} tokens",
                                param="prompt")
        strings = [logprobs_json.token_text(t) for t in prompt_token_ids]
        return Echo(text, prompt_token_ids, strings, max_tokens == 0)

    def models_route(self) -> dict:
        """vLLM's /v1/models: the served model, then each LoRA adapter (parent: its base model)."""
        limit = self.config.max_model_len
        return {"object": "list", "data": [model_card(self.model_name, limit, root=self.config.model),
                                           *self.loras.cards(limit)]}

    async def load_lora_adapter(self, req: LoadLoRAAdapterRequest) -> Response:
        """vLLM's: serves one more adapter, once the engine has read and checked it."""
        if not self.config.enable_lora:
            raise ProtocolError("this server runs no LoRA adapters: start it with --enable-lora")
        if not req.lora_name or not req.lora_path:
            raise ProtocolError("Both 'lora_name' and 'lora_path' must be provided.")
        try:
            lora_request = self.loras.new_request(req.lora_name, req.lora_path)
        except ValueError as e:
            raise ProtocolError(str(e), param="lora_name") from None
        try:
            await self.async_engine.check_lora(lora_request)
        except ValueError as e:
            raise ProtocolError(str(e), param="lora_path") from None
        except RuntimeError as e:        # the engine process is gone
            raise ProtocolError(str(e), 503) from None
        try:
            self.loras.add(lora_request)
        except ValueError as e:         # another request loaded that name while the engine read this one
            raise ProtocolError(str(e), param="lora_name") from None
        return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.", media_type="text/plain")

    def unload_lora_adapter(self, req: UnloadLoRAAdapterRequest) -> Response:
        """vLLM's: the name is no longer served. Requests already running with the adapter finish
        with it; the engine drops it from its cache as it reads others (max_cpu_loras)."""
        lora_request = self.loras.requests.get(req.lora_name)
        if lora_request is None or req.lora_int_id not in (None, lora_request.lora_int_id):
            raise ProtocolError(f"The lora adapter '{req.lora_name}' cannot be found.", 404, "lora_name")
        self.loras.remove(req.lora_name)
        return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.", media_type="text/plain")

    async def chat_completions(self, req: ChatCompletionRequest, raw: Request) -> Response:
        lora_request = self.check(req)
        self.check_tools(req)
        prompt, prompt_token_ids = self.render_chat(req)
        [prompt_token_ids] = self.truncated([prompt_token_ids], req)
        max_tokens = self.max_tokens(req.max_completion_tokens if req.max_completion_tokens is not None
                                     else req.max_tokens, lambda: self.remaining_tokens(prompt_token_ids))
        # As OpenAI's and vLLM's: top_logprobs asks for the best of each token's row, and needs logprobs.
        if req.top_logprobs is not None and not req.logprobs:
            raise ProtocolError("top_logprobs needs logprobs=true", param="top_logprobs")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise ProtocolError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
                                param="top_logprobs")
        role = self.chat_request_role(req)
        echo = self.chat_echo(req, role)
        if req.use_beam_search:         # n is the beam width, its n best beams the choices
            param = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
            prompts = Prompts([prompt_token_ids], 1 if req.n is None else req.n, chat_echo=echo, role=role,
                              logprobs_json=self.request_logprobs_json(req))
            return await self.beam_search.respond(raw, req, prompts, max_tokens, param, lora_request, prompt)
        params = self.sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
        request_id = random_id("chatcmpl")
        streams = self.add(request_id, [prompt_token_ids], params, req.priority, lora_request, req.cache_salt)
        return await self.respond(raw, response_id(raw, req, request_id), streams, True, req.stream, req.include_usage,
                                  Prompts([prompt_token_ids], params.n, chat_echo=echo, role=role,
                                          logprobs_json=self.request_logprobs_json(req)),
                                  self.output_parsers(req, prompt, params), self.response_model_name(lora_request),
                                  continuous_usage=req.continuous_usage)


def build_app(config: EngineConfig, model_name: str, parsers: ParserOptions | None = None,
              lora_modules: list[LoRAModulePath] = (), options: ServingOptions = ServingOptions()) -> FastAPI:
    """Starts the engine process (and waits for it, and for it to read lora_modules' adapters)
    before it returns."""
    server = OpenAIServer(config, model_name, parsers, lora_modules, options)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.async_engine.start()
        stats = None
        if not options.disable_log_stats:
            stats = asyncio.ensure_future(StatsLogger(server.metrics, model_name, options.data_parallel_size)
                                          .run(log_stats_interval()))
        try:
            yield
        finally:        # the engine process stopped however the app ends (run_batch's may end by an error)
            if stats is not None:
                stats.cancel()
            server.async_engine.shutdown()

    docs = {"openapi_url": None, "docs_url": None, "redoc_url": None} if options.disable_fastapi_docs else {}
    app = FastAPI(title="mini_engine", version=__version__, lifespan=lifespan, **docs)
    app.state.server = server
    app.state.server_load = ServerLoad()
    add_middleware(app, options, app.state.server_load)

    @app.exception_handler(ProtocolError)
    async def protocol_error(request: Request, e: ProtocolError):
        return error_response(str(e), e.status_code, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return error_response(f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": "))
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        where = ".".join(loc)
        message = f"{where}: {first.get('msg')}" if where else str(first.get("msg", "invalid request"))
        if first.get("type") == "extra_forbidden":
            message = f"{where} is not a supported parameter"
        return error_response(message, param=where or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return error_response(str(e.detail), e.status_code)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return await server.completions(req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return await server.chat_completions(req, raw)

    responses = ResponsesEndpoint(server)

    @app.post("/v1/responses")
    async def create_response(req: ResponsesRequest, raw: Request):
        return await responses.create(req, raw)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        return responses.retrieve(response_id)

    pooling = PoolingEndpoints(server)

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest, raw: Request):
        return await pooling.embeddings(req, raw)

    @app.post("/classify")
    @app.post("/v1/classify")
    async def classify(req: ClassificationRequest, raw: Request):
        return await pooling.classify(req, raw)

    @app.post("/pooling")
    async def pooling_route(req: PoolingRequest, raw: Request):
        return await pooling.pooling(req, raw)

    @app.post("/score")
    @app.post("/v1/score")
    async def score(req: ScoreRequest, raw: Request):
        return await pooling.score(req, raw)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(req: RerankRequest, raw: Request):
        return await pooling.rerank(req, raw)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        return server.tokenize_route(req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        return server.detokenize_route(req)

    @app.get("/v1/models")
    async def models():
        return server.models_route()

    if runtime_updating_allowed():      # as vLLM, only where the environment asks for them
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(req: LoadLoRAAdapterRequest):
            return await server.load_lora_adapter(req)

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
            return server.unload_lora_adapter(req)

    if dev_mode():       # as vLLM's, only where the environment asks for them
        add_dev_routes(app, server.async_engine)
    if profiling():
        add_profile_routes(app, server.async_engine)

    @app.get("/health")
    @app.get("/ping")           # SageMaker's, GET or POST, as vLLM's
    @app.post("/ping")
    async def health():
        if not server.async_engine.is_alive:
            return error_response("the engine process is not running", 503)
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/load")
    async def load():
        return {"server_load": app.state.server_load.in_progress}

    add_invocations_route(app, server, pooling)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
