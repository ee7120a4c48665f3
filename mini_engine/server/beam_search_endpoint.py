"""vLLM's beam search on /v1/completions and /v1/chat/completions: `use_beam_search: true`, `n`
the beam width, and each prompt's n best beams its n choices, best first.

The search's bookkeeping is mini_engine/beam_search.py's BeamSearch, the one LLM.beam_search
runs. Here, as in vLLM's OpenAIServing.beam_search, each step sends every live beam to the engine
as a one-token request that asks for 2 x n logprobs, all at once, and awaits them together before
the next step. They go through the server's own request path (OpenAIServer.add): the prompt
checks, the LoRA adapter the request's model names, its priority and cache_salt, the metrics and
the KV pool's accounting are a normal completion's; the prefix cache holds each beam's tokens
from its previous step (under the request's salt). A client that leaves mid-search has its
step's requests aborted, their KV blocks freed, and no more steps run.

As vLLM's: a choice's text is its generated tokens' (special tokens kept, as vLLM's
tokenizer.decode gives them), less the EOS that ended it unless include_stop_str_in_output;
usage counts the prompt once and the returned beams' tokens, that EOS likewise (not the tokens of
beams the search dropped); logprobs, where asked, are each token's step's (at most the 2 x n the
step asked for); /v1/completions refuses stream=true (vLLM's "Streaming is not currently
supported with beam search"), and a chat stream sends the finished beams whole once the search is
over, as vLLM's. Where vLLM's server silently ignores a sampling field under beam search (top_p,
stop, seed, ...), this one refuses it (SamplingRequest.beam_search_ignores).
"""
import asyncio
import dataclasses
import time

from fastapi import Request
from fastapi.responses import Response

from mini_engine.beam_search import BeamSearch, BeamSearchParams, BeamSearchSequence, text_token_ids
from mini_engine.layers.sampler import SampleLogprobs
from mini_engine.lora import LoRARequest
from mini_engine.sampling_params import SamplingParams
from mini_engine.server.async_engine import RequestDelta, RequestStream, merge
from mini_engine.server.protocol import ChatCompletionRequest, ProtocolError, SamplingRequest, random_id, response_id


async def final_delta(stream: RequestStream) -> RequestDelta:
    """A request's deltas, merged into one."""
    whole = None
    async for delta in stream:
        whole = delta if whole is None else merge(whole, delta)
    return whole


class BeamSearchEndpoint:
    def __init__(self, server):
        """server: the OpenAIServer, whose request path, tokenizer and response builders these share."""
        self.server = server

    async def respond(self, raw: Request, req: SamplingRequest, prompts, max_tokens: int, max_tokens_param: str,
                      lora_request: LoRARequest | None, chat_prompt: str | None = None) -> Response:
        """prompts: the request's Prompts (app.py), n their beam width; max_tokens_param: the field
        that set max_tokens; chat_prompt: a chat request's rendered prompt, for its output parsers."""
        server = self.server
        chat = isinstance(req, ChatCompletionRequest)
        if req.stream and not chat:
            raise ProtocolError("Streaming is not currently supported with beam search", param="stream")
        params = self.params(req, max_tokens, max_tokens_param)
        num_logprobs = self.num_logprobs(req, params)
        self.validate(prompts.token_ids, params, "messages" if chat else "prompt")
        parsers = None if not chat else server.output_parsers(req, chat_prompt, SamplingParams(n=params.beam_width))
        request_id = random_id("chatcmpl" if chat else "cmpl")
        model = server.response_model_name(lora_request)
        created = int(time.time())

        async def search_then_respond() -> Response:
            best = await self.search(request_id, prompts.token_ids, params, req.priority, lora_request,
                                     req.cache_salt)
            # Each returned beam as a finished stream of one delta: the response is then built, and
            # its output parsed, as any completion's.
            streams = [self.finished_stream(f"{request_id}-{k}", len(ids), beam, params, num_logprobs)
                       for ids, beams in zip(prompts.token_ids, best) for k, beam in enumerate(beams)]
            answer_id = response_id(raw, req, request_id)
            if req.stream:
                return server.streamed(server.stream_events(streams, answer_id, created, chat, req.include_usage,
                                                            prompts, parsers, model, req.continuous_usage), [])
            return await server.collect(streams, answer_id, created, chat, prompts, parsers, model)

        # The search aborts its own step's requests when the client leaves (search's finally).
        return await server.unless_disconnected(raw, search_then_respond(), [])

    # ---- the request's checks ----

    def params(self, req: SamplingRequest, max_tokens: int, max_tokens_param: str) -> BeamSearchParams:
        """vLLM's to_beam_search_params: n the beam width, temperature the request's, else the
        checkpoint's generation_config default, else 1.0 (SamplingParams')."""
        if (param := req.beam_search_ignores()) is not None:
            raise ProtocolError(f"{param}={getattr(req, param)!r} is not supported with use_beam_search=true (beam "
                                f"search ranks its beams by their log-probabilities alone)", param=param)
        temperature = req.temperature if req.temperature is not None else \
            self.server.config.default_sampling_params().temperature
        try:
            params = BeamSearchParams(beam_width=1 if req.n is None else req.n, max_tokens=max_tokens,
                                      ignore_eos=req.ignore_eos, temperature=temperature,
                                      length_penalty=req.length_penalty,
                                      include_stop_str_in_output=req.include_stop_str_in_output)
        except ValueError as e:     # the message starts with the parameter's name
            name = str(e).split(" ", 1)[0]
            param = {"beam_width": "n", "max_tokens": max_tokens_param}.get(name, name)
            message = f"n is the beam width with use_beam_search: {e}" if param == "n" else \
                str(e).replace(name, param, 1)
            raise ProtocolError(message, param=param) from None
        limits = self.server.async_engine.limits
        most = min(limits.max_logprobs, limits.vocab_size)
        if params.num_candidates > most:
            raise ProtocolError(f"use_beam_search with n={params.beam_width} asks for {params.num_candidates} "
                                f"candidate tokens a step (2 x n), more than the server's max_logprobs={most}: start "
                                f"it with --max-logprobs {params.num_candidates} or more", param="n")
        return params

    @staticmethod
    def num_logprobs(req: SamplingRequest, params: BeamSearchParams) -> int | None:
        """The top tokens each returned token's logprobs show (None: not asked): at most the 2 x n
        candidates its step asked for (the endpoint checked them against MAX_LOGPROBS already)."""
        if isinstance(req, ChatCompletionRequest):
            param, k = "top_logprobs", (req.top_logprobs or 0) if req.logprobs else None
        else:
            param, k = "logprobs", req.logprobs
        if k is not None and k > params.num_candidates:
            raise ProtocolError(f"{param}={k} with use_beam_search asks for more than the {params.num_candidates} "
                                f"candidate tokens (2 x n) each step computes", param=param)
        return k

    def validate(self, prompts: list[list[int]], params: BeamSearchParams, param: str) -> None:
        """Every beam grows from its prompt to max_tokens more tokens: checked whole now, as
        LLM.beam_search checks it, so that no step fails half-way through the search."""
        whole = dataclasses.replace(params.step_params(), max_tokens=params.max_tokens)
        for i, prompt in enumerate(prompts):
            try:
                self.server.async_engine.limits.validate(prompt, whole)
            except (ValueError, TypeError) as e:
                raise ProtocolError(f"prompt {i}: {e}" if len(prompts) > 1 else str(e), param=param) from None

    # ---- the search ----

    async def search(self, request_id: str, prompts: list[list[int]], params: BeamSearchParams, priority: int,
                     lora_request: LoRARequest | None, cache_salt: str | None) -> list[list[BeamSearchSequence]]:
        """Each prompt's best beams, best first; each step's requests are "{request_id}-{step}"
        (and "-{beam}" after it where there are several)."""
        server = self.server
        search = BeamSearch(prompts, [lora_request] * len(prompts), params,
                            frozenset(server.async_engine.limits.eos_token_ids))
        step_params, step = params.step_params(), 0
        while beams := search.step_requests():
            streams = server.add(f"{request_id}-{step}", [beam.tokens for beam in beams], step_params, priority,
                                 lora_request, cache_salt)
            try:
                outputs = await asyncio.gather(*map(final_delta, streams))
            finally:        # those unfinished: the client left (this task was cancelled)
                server.abort(streams)
            for output in outputs:
                if not output.token_ids or not output.logprobs:
                    # The engine failed or aborted the beam's request (an adapter that can no
                    # longer be read, the engine process gone): the search cannot go on.
                    raise ProtocolError(output.error or f"a beam's step ended without a token ({output.finish_reason})",
                                        500)
            search.advance(outputs)
            step += 1
        return search.result()

    def finished_stream(self, request_id: str, num_prompt_tokens: int, beam: BeamSearchSequence,
                        params: BeamSearchParams, num_logprobs: int | None) -> RequestStream:
        token_ids = text_token_ids(beam, params)[num_prompt_tokens:]
        logprobs = None if num_logprobs is None else \
            [SampleLogprobs(lp.logprob, lp.top[:num_logprobs]) for lp in beam.logprobs[:len(token_ids)]]
        tokenizer = self.server.tokenizer
        text = tokenizer.decode(token_ids, skip_special_tokens=False) if tokenizer is not None else ""
        stream = RequestStream(request_id, num_prompt_tokens)
        stream.queue.put_nowait(RequestDelta(text, token_ids, logprobs, beam.finish_reason, num_prompt_tokens,
                                             len(token_ids)))
        return stream
