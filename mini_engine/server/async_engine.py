"""The engine's step loop, running in one background thread, fed by request handlers.

LLMEngine is synchronous and not thread-safe, so only the engine thread ever touches it. Handlers
on the asyncio side hand it commands (add, abort) through a queue it drains between steps; it
hands each request's output back through that request's asyncio.Queue, one call_soon_threadsafe
per step. Detokenization and stop strings run on the engine thread too, so a request that hits
a stop string is aborted, and its blocks freed, before the next step.
"""
import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from mini_engine.engine.engine import LLMEngine, StepOutput
from mini_engine.layers.sampler import SampleLogprobs
from mini_engine.sampling_params import SamplingParams
from mini_engine.detokenizer import IncrementalDetokenizer
from mini_engine.server.metrics import ServerMetrics

logger = logging.getLogger("mini_engine.server")


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


class RequestStream:
    """The handler's side of a request: iterate it for deltas until the one with a finish_reason."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        self.finished = False

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
                        second.finish_reason, second.num_prompt_tokens, second.num_output_tokens, second.error)


@dataclass
class RequestState:
    """The engine thread's side of a request."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    stream: RequestStream
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    num_output_tokens: int = 0


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics):
        self.engine = engine
        self.metrics = metrics
        self.commands: deque[tuple[str, object]] = deque()   # appended by handlers, drained by the loop
        self.wakeup = threading.Event()
        self.states: dict[str, RequestState] = {}            # engine thread only
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.stopping = False

    # ---- the handlers' side (event loop thread) ----

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.thread = threading.Thread(target=self.run, name="mini_engine-step-loop", daemon=True)
        self.thread.start()

    def shutdown(self) -> None:
        self.stopping = True
        self.wakeup.set()
        if self.thread is not None:
            self.thread.join(timeout=30)

    @property
    def is_alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> RequestStream:
        """Raises ValueError for a request the engine could never run (validation reads only
        the engine's fixed configuration, so it is safe off the engine thread)."""
        self.engine.validate(prompt_token_ids, params)
        stream = RequestStream(request_id)
        detokenizer = IncrementalDetokenizer(self.engine.tokenizer, params.stop)
        self.submit("add", RequestState(request_id, prompt_token_ids, params, detokenizer, stream))
        return stream

    def abort(self, request_id: str) -> None:
        """Idempotent; the engine frees the request's blocks before its next step."""
        self.submit("abort", request_id)

    def submit(self, command: str, arg: object) -> None:
        self.commands.append((command, arg))
        self.wakeup.set()

    def deliver(self, deltas: list[tuple[RequestStream, RequestDelta]]) -> None:
        for stream, delta in deltas:
            stream.queue.put_nowait(delta)

    # ---- the engine thread ----

    def run(self) -> None:
        try:
            while not self.stopping:
                self.drain_commands()
                if not self.engine.has_unfinished_requests():
                    self.metrics.update_engine_state(self.engine)
                    self.wakeup.wait()
                    self.wakeup.clear()
                    continue
                try:
                    outputs = self.engine.step()
                except Exception:
                    logger.exception("engine step failed; failing every request in flight")
                    self.fail_all("the engine failed while running this request")
                    continue
                self.process(outputs)
                self.metrics.update_engine_state(self.engine)
        finally:
            self.fail_all("the server is shutting down")

    def drain_commands(self) -> None:
        deltas = []
        while self.commands:
            command, arg = self.commands.popleft()
            if command == "add":
                state: RequestState = arg
                try:
                    self.engine.add_request(state.prompt_token_ids, state.params, state.request_id, validated=True)
                except (ValueError, TypeError) as e:
                    deltas.append((state.stream, self.final_delta(state, "error", str(e))))
                    continue
                self.states[state.request_id] = state
                self.metrics.prompt_tokens.inc(len(state.prompt_token_ids))
            elif command == "abort":
                state = self.states.get(arg)
                if state is not None:
                    self.engine.abort_request(state.request_id)
                    deltas.append((state.stream, self.finish(state, "abort")))
        self.send(deltas)

    def process(self, outputs: list[StepOutput]) -> None:
        now = time.perf_counter()
        deltas = []
        for out in outputs:
            state = self.states.get(out.seq.request_id)
            if state is None:
                continue
            if state.first_token_time is None:
                state.first_token_time = now
                self.metrics.ttft.observe(now - state.arrival_time)
            state.num_output_tokens += len(out.new_token_ids)
            self.metrics.generation_tokens.inc(len(out.new_token_ids))
            text = state.detokenizer.update(out.new_token_ids, out.finished)
            reason = out.seq.finish_reason if out.finished else None
            if state.detokenizer.stopped:
                if not out.finished:
                    self.engine.abort_request(state.request_id)    # blocks free before the next step
                reason = "stop"
            delta = RequestDelta(text, out.new_token_ids, out.logprobs, None, len(state.prompt_token_ids),
                                 state.num_output_tokens)
            if reason is not None:
                self.finish(state, reason)
                delta.finish_reason = reason
            deltas.append((state.stream, delta))
        self.send(deltas)

    def finish(self, state: RequestState, reason: str) -> RequestDelta:
        self.states.pop(state.request_id, None)
        now = time.perf_counter()
        self.metrics.finished(reason)
        self.metrics.e2e.observe(now - state.arrival_time)
        if state.first_token_time is not None and state.num_output_tokens > 1:
            self.metrics.tpot.observe((now - state.first_token_time) / (state.num_output_tokens - 1))
        return self.final_delta(state, reason)

    def final_delta(self, state: RequestState, reason: str, error: str | None = None) -> RequestDelta:
        return RequestDelta("", [], None, reason, len(state.prompt_token_ids), state.num_output_tokens, error)

    def fail_all(self, message: str) -> None:
        deltas = []
        for state in list(self.states.values()):
            self.engine.abort_request(state.request_id)
            self.states.pop(state.request_id, None)
            deltas.append((state.stream, self.final_delta(state, "error", message)))
        while self.commands:
            command, arg = self.commands.popleft()
            if command == "add":
                deltas.append((arg.stream, self.final_delta(arg, "error", message)))
        self.send(deltas)

    def send(self, deltas: list[tuple[RequestStream, RequestDelta]]) -> None:
        if deltas and self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.deliver, deltas)
