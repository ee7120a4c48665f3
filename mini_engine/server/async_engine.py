"""The API process's handle on the engine process (server/engine_process.py).

Handlers on the asyncio side check a request against the engine's RequestLimits, register its
RequestStream and send it to the engine process. A reader thread waits on the engine's output
queue and hands each step's deltas to the event loop, one call_soon_threadsafe per step, where
they go to each request's asyncio.Queue and into the metrics.
"""
import asyncio
import itertools
import queue
import threading
import time
from dataclasses import dataclass

from mini_engine.config import EngineConfig
from mini_engine.engine.prompt_embeds import as_message
from mini_engine.layers.sampler import SampleLogprobs
from mini_engine.lora import LoRARequest
from mini_engine.pooling_params import PoolingParams
from mini_engine.sampling_params import SamplingParams
from mini_engine.server.engine_process import EngineDelta, EngineStats, start_engine_process
from mini_engine.server.metrics import EngineMetrics


@dataclass
class RequestDelta:
    """What one step added to a request."""
    text: str
    token_ids: list[int]
    logprobs: list[SampleLogprobs] | None
    finish_reason: str | None           # "stop", "length", "abort", "error", or None while running
    num_prompt_tokens: int
    num_output_tokens: int              # so far
    error: str | None = None
    prompt_logprobs: list[SampleLogprobs | None] | None = None     # on the first delta, where asked
    embedding: list[float] | None = None    # an embedding request's, on its one delta
    num_cached_tokens: int = 0          # the prompt tokens the prefix cache served


class RequestStream:
    """The handler's side of a request: iterate it for deltas until the one with a finish_reason."""

    def __init__(self, request_id: str, num_prompt_tokens: int):
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        self.finished = False
        self.num_output_tokens = 0
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        # The engine's times (perf_counter) of its first admission and of its first and last tokens.
        self.scheduled_time: float | None = None
        self.first_token_step_time: float | None = None
        self.last_token_step_time: float | None = None
        self.max_tokens: int | None = None              # a generation request's

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestDelta:
        if self.finished:
            raise StopAsyncIteration
        delta = await self.queue.get()
        # A handler that fell behind the engine sends what piled up as one delta: under load the
        # HTTP side then does work per wake-up rather than per token.
        while delta.finish_reason is None and not self.queue.empty():
            delta = merge(delta, self.queue.get_nowait())
        self.finished = delta.finish_reason is not None
        return delta


def merge(first: RequestDelta, second: RequestDelta) -> RequestDelta:
    logprobs = None if first.logprobs is None and second.logprobs is None else \
        (first.logprobs or []) + (second.logprobs or [])
    return RequestDelta(first.text + second.text, first.token_ids + second.token_ids, logprobs,
                        second.finish_reason, second.num_prompt_tokens, second.num_output_tokens, second.error,
                        first.prompt_logprobs or second.prompt_logprobs,
                        second.embedding if second.embedding is not None else first.embedding,
                        second.num_cached_tokens)


class AsyncEngine:
    def __init__(self, config: EngineConfig, metrics: EngineMetrics, lora_requests: tuple[LoRARequest, ...] = (),
                 visible_devices: str | None = None, cancelled: threading.Event | None = None):
        """Starts the engine process and waits for its engine (model, KV pool, CUDA graphs) and
        for it to read lora_requests' adapters (RuntimeError, naming the adapter, if one is bad).
        visible_devices: the process's CUDA_VISIBLE_DEVICES (data parallelism gives each engine
        its own GPUs); None, this process's. cancelled: stops the wait (start_engine_process's)."""
        self.metrics = metrics
        self.process, self.commands, self.outputs, self.limits = start_engine_process(
            config, lora_requests, visible_devices=visible_devices, cancelled=cancelled)
        self.streams: dict[str, RequestStream] = {}         # event loop thread only
        self.calls: dict[int, asyncio.Future] = {}      # event loop thread only
        self.call_ids = itertools.count()
        self.asleep = False         # since sleep() returned, until wake_up() woke every tag
        self.loop: asyncio.AbstractEventLoop | None = None
        self.reader: threading.Thread | None = None
        self.stopping = False

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.reader = threading.Thread(target=self.read, name="mini_engine-engine-reader", daemon=True)
        self.reader.start()

    def shutdown(self) -> None:
        self.stopping = True
        if self.process.is_alive():
            self.commands.put(("shutdown",))
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
        if self.reader is not None:
            self.reader.join(timeout=5)
        # Dropped, so that their semaphores are released now: uvicorn ends the process by its
        # signal, which skips the exit hooks that would (the resource tracker then warns of leaks).
        self.commands.close()
        self.commands.join_thread()
        self.outputs.close()
        self.commands = self.outputs = None

    @property
    def is_alive(self) -> bool:
        return self.process.is_alive() and self.reader is not None and self.reader.is_alive()

    def next_engine(self, prompt_token_ids: list[int] = ()) -> "AsyncEngine":
        """The engine a request goes to: this one (data_parallel.DataParallelEngines picks one of several)."""
        return self

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | PoolingParams,
                    validated: bool = False, priority: int = 0, lora_request: LoRARequest | None = None,
                    cache_salt: str | None = None, prompt_embeds=None) -> RequestStream:
        """Raises ValueError for a request the engine could never run, before it is sent
        (validated: the caller has checked these ids and params already). lora_request: an
        adapter the engine has read already (the server's, checked by check_lora). cache_salt: the
        request's (vLLM's), whose prefix-cache blocks serve only requests of the same salt.
        prompt_embeds: the prompt's embeddings, checked already (engine/prompt_embeds.py), whose
        placeholders prompt_token_ids are; they cross to the engine's process as bytes."""
        assert prompt_embeds is None or validated, "prompt embeddings are checked by the caller"
        if not validated:
            self.limits.validate(prompt_token_ids, params)
        if not self.is_alive:
            raise RuntimeError("the engine process is not running")
        if self.asleep:
            raise RuntimeError("the engine is asleep (sleep mode): POST /wake_up first")
        stream = RequestStream(request_id, len(prompt_token_ids))
        self.streams[request_id] = stream
        self.metrics.prompt_tokens.inc(len(prompt_token_ids))
        if isinstance(params, SamplingParams):
            stream.max_tokens = params.max_tokens
        self.commands.put(("add", request_id, list(prompt_token_ids), params, priority, lora_request, cache_salt,
                           None if prompt_embeds is None else as_message(prompt_embeds)))
        return stream

    async def call(self, name: str, *args):
        """Runs engine_process.ENGINE_CALLS[name](engine, *args) between two steps; returns its
        result, or raises its ValueError or RuntimeError (RuntimeError too if the engine is gone)."""
        if not self.is_alive:
            raise RuntimeError("the engine process is not running")
        token = next(self.call_ids)
        future = self.calls[token] = self.loop.create_future()
        self.commands.put(("call", token, name, args))
        try:
            result, error = await future
        finally:
            self.calls.pop(token, None)
        if error is not None:
            kind, message = error
            raise (ValueError if kind == "ValueError" else RuntimeError)(message)
        return result

    async def check_lora(self, lora_request: LoRARequest) -> None:
        """Has the engine read and check an adapter (one loaded while the server runs): raises
        ValueError with the engine's reason if it cannot run it."""
        await self.call("check_lora", lora_request)

    async def sleep(self, level: int) -> None:
        """Sleep mode (LLM.sleep's): from its return, new requests are refused until wake_up."""
        await self.call("sleep", level)
        self.asleep = True

    async def wake_up(self, tags: list[str] | None) -> None:
        await self.call("wake_up", tags)
        self.asleep = await self.call("is_sleeping")

    def abort(self, request_id: str) -> None:
        """Idempotent; the engine frees the request's blocks before its next step."""
        if self.commands is not None and self.process.is_alive():
            self.commands.put(("abort", request_id))

    # ---- the reader thread ----

    def read(self) -> None:
        while True:
            try:
                message = self.outputs.get(timeout=1.0)
            except queue.Empty:
                if self.stopping or not self.process.is_alive():
                    break
                continue
            except (EOFError, OSError):
                break
            try:
                if message[0] == "step":
                    self.loop.call_soon_threadsafe(self.deliver, message[1], message[2])
                elif message[0] == "called":
                    self.loop.call_soon_threadsafe(self.called, message[1], message[2], message[3])
            except RuntimeError:        # the event loop has closed (an AsyncLLM's caller has returned)
                return
        reason = "the server is shutting down" if self.stopping else "the engine process exited"
        try:
            self.loop.call_soon_threadsafe(self.fail_all, reason)
        except RuntimeError:        # the event loop has already closed: nobody is waiting
            pass

    # ---- the event loop thread ----

    def deliver(self, deltas: list[tuple], stats: EngineStats) -> None:
        now = time.perf_counter()
        m = self.metrics
        for d in map(EngineDelta._make, deltas):
            stream = self.streams.get(d.request_id)
            if stream is None:
                continue
            stream.num_output_tokens = d.num_output_tokens
            if d.scheduled_time is not None:
                stream.scheduled_time = d.scheduled_time
            if d.token_ids:
                stream.last_token_step_time = stats.time
                if stream.first_token_step_time is None:
                    stream.first_token_step_time = stats.time
                m.generation_tokens.inc(len(d.token_ids))
                if stream.first_token_time is None:
                    stream.first_token_time = now
                    m.ttft.observe(now - stream.arrival_time)
            if d.finish_reason is not None:
                del self.streams[d.request_id]
                m.finished(d.finish_reason)
                m.e2e.observe(now - stream.arrival_time)
                if stream.first_token_time is not None and d.num_output_tokens > 1:
                    m.tpot.observe((now - stream.first_token_time) / (d.num_output_tokens - 1))
                m.finished_request(stream)
            stream.queue.put_nowait(RequestDelta(d.text, d.token_ids, d.logprobs, d.finish_reason,
                                                 stream.num_prompt_tokens, d.num_output_tokens, d.error,
                                                 d.prompt_logprobs, d.embedding, d.num_cached_tokens or 0))
        m.update_engine_state(stats)

    def called(self, token: int, result, error: tuple[str, str] | None) -> None:
        future = self.calls.get(token)
        if future is not None and not future.done():      # not cancelled by a client gone
            future.set_result((result, error))

    def fail_all(self, message: str) -> None:
        for stream in self.streams.values():
            stream.queue.put_nowait(RequestDelta("", [], None, "error", stream.num_prompt_tokens,
                                                 stream.num_output_tokens, message))
        self.streams.clear()
        for future in self.calls.values():
            if not future.done():
                future.set_exception(RuntimeError(message))
