"""The server's engine, in a process of its own (vLLM v1's engine core does the same).

In one process, the engine's step loop and the HTTP side shared one interpreter lock: with 256
requests streaming, their Python work per token (JSON chunks, queues, socket writes) took
turns with the step loop's, and the saturated server ran at half the offline engine's speed
(benchmarks/NOTES.md, "Serving"). Here the step loop owns a process and the GPU; the API process
sends it commands and reads, once a step, what every request gained. If the HTTP side falls
behind, its deltas pile up and are sent merged; the engine never waits for it.

Messages (tuples, cheap to pickle), the API process to the engine:
    ("add", request_id, prompt_token_ids, params, priority, lora_request, cache_salt, prompt_embeds as bytes),
    ("abort", request_id),
    ("call", token, name, args), ("shutdown",)
and the engine to the API process:
    ("ready", RequestLimits) or ("failed", traceback text or message), once, at start-up;
    ("step", deltas, EngineStats) after every step, and after every batch of commands it applies;
    each delta an EngineDelta's fields as a plain tuple (EngineDelta._make rebuilds it);
    ("called", token, result, error) for each call: one of ENGINE_CALLS, run between two steps
    (an adapter loaded at run time checked; sleep mode; the prefix cache reset), error None or
    (exception type name, message).
Detokenization and stop strings run here, beside the scheduler, so that a request that hits a
stop string is aborted, and its blocks freed, before the next step.
"""
import atexit
import contextlib
import logging
import multiprocessing
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import NamedTuple

from mini_engine.config import EngineConfig
from mini_engine.detokenizer import IncrementalDetokenizer
from mini_engine.engine.engine import LLMEngine, StepOutput
from mini_engine.engine.prompt_embeds import from_message
from mini_engine.lora import LoRARequest
from mini_engine.pooling_params import PoolingParams

logger = logging.getLogger("mini_engine.server")

# What the API process may ask of the engine loop itself (EngineLoop's methods, by name): they
# answer when they are done, which may be steps later.
LOOP_CALLS = frozenset({"pause_generation", "resume_generation", "is_paused"})
# What the API process may ask of the engine between two steps (AsyncEngine.call), by name. Each
# raises ValueError (a bad argument) or RuntimeError (not now: e.g. sleep with requests running).
ENGINE_CALLS = {
    "check_lora": LLMEngine.check_lora,
    "reset_prefix_cache": LLMEngine.reset_prefix_cache,
    "sleep": LLMEngine.sleep,
    "wake_up": LLMEngine.wake_up,
    "is_sleeping": LLMEngine.is_sleeping,
    "start_profile": LLMEngine.start_profile,
    "stop_profile": LLMEngine.stop_profile,
    "load_weights": LLMEngine.load_weights,
}


@dataclass(slots=True)
class EngineStats:
    """The engine's state after a step, for the server's gauges."""
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_hit_tokens: int
    prefix_cache_queried_tokens: int
    num_preemptions: int
    # The host tier's (kv_offloading_size) lookups and hits, in tokens: vLLM's "external" prefix cache.
    external_prefix_cache_queried_tokens: int = 0
    external_prefix_cache_hit_tokens: int = 0
    # Speculative decoding's totals since start (speculative.SpecDecodeStats), 0 without it.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()       # accepted drafts by position, 0 = the first
    # With enable_lora: the names of the adapters the running and the waiting requests run, each
    # once, in queue order (vLLM's lora_requests_info labels); empty without LoRA.
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    # The step's tokens as vLLM's iteration_tokens_total counts them (EngineLoop.process); 0 for a
    # report of commands alone.
    step_tokens: int = 0
    # When the report was made (time.perf_counter(), the API process's clock too on Linux): the
    # engine's time for the tokens it brings, as vLLM's engine-core timestamps.
    time: float = 0.0

    @classmethod
    def of(cls, engine: LLMEngine, step_tokens: int = 0) -> "EngineStats":
        bm, spec, scheduler = engine.block_manager, engine.spec_decode_stats, engine.scheduler
        running = waiting = ()
        if engine.config.enable_lora:
            running, waiting = (tuple(dict.fromkeys(s.lora_request.lora_name for s in queue if s.lora_request))
                                for queue in (scheduler.running, scheduler.waiting))
        return cls(len(scheduler.running), len(scheduler.waiting), bm.num_blocks - bm.num_free_blocks,
                   bm.num_blocks, bm.prefix_cache_hit_tokens, bm.prefix_cache_queried_tokens, engine.num_preemptions,
                   bm.host_cache_queried_tokens, bm.host_cache_hit_tokens, spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens,
                   tuple(spec.accepted_per_position), running, waiting, step_tokens, time.perf_counter())


class EngineDelta(NamedTuple):
    """What a step (or a command) added to a request. prompt_logprobs only on a request's first
    delta, where it asked for them; embedding on an embedding request's one delta;
    num_cached_tokens, the prompt tokens the prefix cache served when it was first scheduled;
    scheduled_time, when that was (Sequence.first_scheduled_time), on its first delta with tokens."""
    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list | None
    finish_reason: str | None
    num_output_tokens: int
    error: str | None = None
    prompt_logprobs: list | None = None
    embedding: list[float] | None = None
    num_cached_tokens: int = 0
    scheduled_time: float | None = None


def ended(request_id: str, reason: str, num_output_tokens: int = 0, error: str | None = None,
          num_cached_tokens: int = 0) -> EngineDelta:
    """The last delta of a request that ends without new tokens (aborted, refused, failed)."""
    return EngineDelta(request_id, "", [], None, reason, num_output_tokens, error, num_cached_tokens=num_cached_tokens)


@dataclass(slots=True)
class RequestState:
    """What the engine process keeps of a request besides its Sequence."""
    detokenizer: IncrementalDetokenizer | None      # None: an embedding request's (it has no text)
    num_output_tokens: int = 0
    prompt_logprobs_sent: bool = False
    # The prompt tokens the prefix cache served, as of the first output (a preempted request's
    # recompute may hit the cache again: usage counts its first admission, as vLLM's).
    num_cached_tokens: int | None = None


PAUSE_MODES = ("abort", "wait", "keep")


def pause_mode(mode: str, wait_for_inflight_requests: bool | None) -> str:
    """pause_generation's mode, where vLLM's deprecated wait_for_inflight_requests may still give it."""
    return mode if wait_for_inflight_requests is None else ("wait" if wait_for_inflight_requests else "abort")


class EngineLoop:
    def __init__(self, engine: LLMEngine, outputs: multiprocessing.Queue):
        self.engine = engine
        self.outputs = outputs
        self.states: dict[str, RequestState] = {}
        # vLLM's pause_generation: while paused (engine.paused) no step runs, and requests that
        # arrive are held here until resume_generation; while a pause of mode "wait" waits for the
        # running requests to end, they are held too, and the pause calls wait to be answered
        # (pause_waiters, their tokens; pause_clears_cache, whether any asked for clear_cache).
        self.held: list[tuple] = []
        self.pause_waiters: list[int] = []
        self.pause_clears_cache = False

    def steps(self) -> bool:
        return self.engine.has_unfinished_requests() and not self.engine.paused

    def run(self, commands: multiprocessing.Queue) -> None:
        self.send([])       # the pool's size and state, for /metrics before any request
        while True:
            if self.pause_waiters and not self.engine.has_unfinished_requests():
                self.paused()                       # a pause of mode "wait": the last request ended
            batch = []
            if not self.steps():
                try:        # idle: wait for work, and check each second that the server is still there
                    batch.append(commands.get(timeout=1.0))
                except queue.Empty:
                    if not multiprocessing.parent_process().is_alive():
                        return
                    continue
            while True:
                try:
                    batch.append(commands.get_nowait())
                except queue.Empty:
                    break
            if any(command[0] == "shutdown" for command in batch):
                return
            if batch:
                deltas = []
                for command in batch:
                    if deltas and command[0] == "call" and command[2] in LOOP_CALLS:
                        self.send(deltas)           # what came before it, before its answer
                        deltas = []
                    deltas += self.apply(command)
                self.send(deltas)
            if not self.steps():
                continue
            try:
                outputs = self.engine.step()
            except Exception:
                logger.exception("engine step failed; failing every request in flight")
                self.send(self.fail_all("the engine failed while running this request"))
                continue
            self.send(*self.process(outputs))

    def send(self, deltas: list[EngineDelta], step_tokens: int = 0) -> None:
        # As plain tuples: a named tuple pickles through a Python-level __reduce__, ~7x slower, and the
        # queue's feeder thread pickles while this thread prepares the next step (entry 66).
        self.outputs.put(("step", [tuple(delta) for delta in deltas], EngineStats.of(self.engine, step_tokens)))

    def apply(self, command: tuple) -> list[EngineDelta]:
        if command[0] == "add" and (self.engine.paused or self.pause_waiters):
            self.held.append(command)
            return []
        if command[0] == "add":
            _, request_id, prompt_token_ids, params, priority, lora_request, cache_salt, prompt_embeds = command
            if self.engine.is_sleeping():       # one sent as sleep() was: the API refuses the next ones
                return [ended(request_id, "error", error="the engine is asleep: wake_up first")]
            try:
                # The API process validated it with the same RequestLimits.
                self.engine.add_request(prompt_token_ids, params, request_id, validated=True, priority=priority,
                                        lora_request=lora_request, cache_salt=cache_salt,
                                        prompt_embeds=None if prompt_embeds is None else from_message(prompt_embeds))
            except (ValueError, TypeError) as e:
                return [ended(request_id, "error", error=str(e))]
            self.states[request_id] = RequestState(None if isinstance(params, PoolingParams) else
                                                   IncrementalDetokenizer.for_request(self.engine.tokenizer, params))
            return []
        if command[0] == "abort":
            request_id = command[1]
            held = [c for c in self.held if c[1] == request_id]
            if held:                        # never added: it ends here
                self.held.remove(held[0])
                return [ended(request_id, "abort")]
            if request_id in self.states:
                return [self.end_aborted(request_id)]
        if command[0] == "call" and command[2] in LOOP_CALLS:
            _, token, name, args = command
            try:
                return getattr(self, name)(token, *args)
            except (ValueError, RuntimeError) as e:
                self.outputs.put(("called", token, None, (type(e).__name__, str(e))))
                return []
        if command[0] == "call":
            _, token, name, args = command
            try:
                result, error = ENGINE_CALLS[name](self.engine, *args), None
            except (ValueError, RuntimeError) as e:
                result, error = None, (type(e).__name__, str(e))
            self.outputs.put(("called", token, result, error))
        return []

    # ---- vLLM's pause_generation, resume_generation, is_paused (calls that need the loop) ----

    def pause_generation(self, token: int, mode: str = "abort", clear_cache: bool = True) -> list[EngineDelta]:
        """No step runs until resume_generation, and requests that arrive wait for it. mode "abort":
        the unfinished requests end now, as aborted (with what they have); "wait": they run to their
        end first, and the call is answered then; "keep": they stay, frozen, and go on after
        resume. clear_cache: the prefix cache is reset once paused (a kept request's K and V too:
        it recomputes its prompt and output after resume, under the weights of then), so that no
        token after resume reads K and V of the weights before. Already paused: answered at once.
        The requests' last deltas are sent before the answer."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        if self.engine.paused:
            self.outputs.put(("called", token, True, None))
            return []
        self.pause_waiters.append(token)
        self.pause_clears_cache |= clear_cache
        try:
            if mode == "abort":
                self.send([self.end_aborted(request_id) for request_id in list(self.states)])
                self.engine.wait_in_flight()        # its tokens belong to the requests just ended
            elif mode == "keep":
                outputs = self.engine.preempt_running() if clear_cache else self.engine.wait_in_flight()
                self.send(*self.process(outputs))
        except Exception:
            # The step in flight failed (as a step of run's would): its requests fail, and what
            # it hashed is forgotten.
            logger.exception("the step in flight failed as generation paused; failing every request in flight")
            self.engine.block_manager.reset_prefix_cache()
            self.send(self.fail_all("the engine failed while running this request"))
        if mode == "keep" or not self.engine.has_unfinished_requests():
            self.paused()
        return []

    def end_aborted(self, request_id: str) -> EngineDelta:
        state = self.states.pop(request_id)
        self.engine.abort_request(request_id)
        return ended(request_id, "abort", state.num_output_tokens, num_cached_tokens=state.num_cached_tokens or 0)

    def paused(self) -> None:
        """The pause is done: its calls are answered."""
        self.engine.paused = True
        if self.pause_clears_cache:
            self.engine.reset_prefix_cache()
        for token in self.pause_waiters:
            self.outputs.put(("called", token, True, None))
        self.pause_waiters, self.pause_clears_cache = [], False

    def resume_generation(self, token: int) -> list[EngineDelta]:
        """Steps run again: the frozen requests go on, and those held start. A pause of mode "wait"
        still waiting for its requests is called off (its calls answered with an error)."""
        if self.engine.is_sleeping():
            raise RuntimeError("the engine is asleep: wake_up before resume_generation (the requests would "
                               "run on released memory)")
        for waiter in self.pause_waiters:
            self.outputs.put(("called", waiter, None, ("RuntimeError", "resume_generation was called before the "
                                                        "running requests ended: not paused")))
        self.pause_waiters, self.pause_clears_cache = [], False
        self.engine.paused = False
        held, self.held = self.held, []
        self.outputs.put(("called", token, True, None))
        return [delta for command in held for delta in self.apply(command)]

    def is_paused(self, token: int) -> list[EngineDelta]:
        """Paused, or pausing (a pause of mode "wait", which holds new requests already)."""
        self.outputs.put(("called", token, self.engine.paused or bool(self.pause_waiters), None))
        return []

    def process(self, outputs: list[StepOutput]) -> tuple[list[EngineDelta], int]:
        """The step's deltas, and its tokens as vLLM's iteration_tokens_total counts them: each
        token generated, and the prompt of each request that got its first (or, pooling, its output)."""
        deltas, step_tokens = [], 0
        for out in outputs:
            state = self.states.get(out.seq.request_id)
            if state is None:
                continue
            delta = self.delta(out, state)
            prompt_done = delta.scheduled_time is not None or delta.embedding is not None
            step_tokens += len(delta.token_ids) + (out.seq.num_prompt_tokens if prompt_done else 0)
            deltas.append(delta)
        return deltas, step_tokens

    def delta(self, out: StepOutput, state: RequestState) -> EngineDelta:
        """What a step's output adds to its request, through its detokenizer and stop strings."""
        request_id = out.seq.request_id
        if state.detokenizer is None:           # an embedding request: done, with its vector
            del self.states[request_id]
            return EngineDelta(request_id, "", [], None, out.seq.finish_reason, 0,
                               embedding=out.seq.embedding, num_cached_tokens=out.seq.num_cached_tokens)
        first = state.num_cached_tokens is None
        if first:
            state.num_cached_tokens = out.seq.num_cached_tokens
        token_ids, logprobs = out.new_token_ids, out.logprobs
        try:
            text, used = state.detokenizer.update_until_stop(token_ids, out.finished, out.ended_on_stop_token)
        except Exception as e:
            # A tokenizer that fails on what the model sampled ends that request alone, not the
            # engine process and everyone's requests.
            logger.exception("request %s: its output could not be detokenized; ending it", request_id)
            del self.states[request_id]
            self.engine.abort_request(request_id)
            return ended(request_id, "error", state.num_output_tokens,
                         f"the server could not detokenize this request's output ({type(e).__name__}: {e})",
                         state.num_cached_tokens)
        reason = out.seq.finish_reason if out.finished else None
        if state.detokenizer.stopped:
            if not out.finished:
                self.engine.abort_request(request_id)    # blocks free before the next step
            reason = "stop"
            # A step of speculative decoding may bring tokens past the stop string: dropped.
            token_ids, logprobs = token_ids[:used], None if logprobs is None else logprobs[:used]
        state.num_output_tokens += len(token_ids)
        if reason is not None:
            del self.states[request_id]
        # The prompt's log-probabilities, where asked, are all known by its first token.
        prompt_logprobs = None
        if out.seq.prompt_logprobs is not None and not state.prompt_logprobs_sent:
            prompt_logprobs, state.prompt_logprobs_sent = out.seq.prompt_logprobs, True
        return EngineDelta(request_id, text, token_ids, logprobs, reason, state.num_output_tokens,
                           prompt_logprobs=prompt_logprobs, num_cached_tokens=state.num_cached_tokens,
                           scheduled_time=out.seq.first_scheduled_time if first else None)

    def fail_all(self, message: str) -> list[EngineDelta]:
        deltas = []
        for request_id, state in self.states.items():
            self.engine.abort_request(request_id)
            deltas.append(ended(request_id, "error", state.num_output_tokens, message, state.num_cached_tokens or 0))
        self.states.clear()
        return deltas


def engine_main(config: EngineConfig, commands: multiprocessing.Queue, outputs: multiprocessing.Queue,
                log_level: int = logging.WARNING, lora_requests: tuple[LoRARequest, ...] = ()) -> None:
    """The engine process: builds the engine (model, KV pool, CUDA graphs) and reads the server's
    LoRA adapters, reports ready or the error that stopped it, then steps until told to shut down
    or the server is gone. It logs at the server's level (a spawned process starts with logging
    unconfigured)."""
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(log_level)
    try:
        engine = LLMEngine(config)
    except BaseException:
        outputs.put(("failed", traceback.format_exc()))
        return
    # Every adapter read now: a bad one (a wrong path, a rank above max_lora_rank, a module the
    # model lacks) stops the server at start-up, as vLLM's, rather than failing its requests later.
    for lora_request in lora_requests:
        try:
            engine.check_lora(lora_request)
        except ValueError as e:
            outputs.put(("failed", f"cannot serve the LoRA adapter {lora_request.lora_name!r}: {e}"))
            engine.shutdown()
            return
    outputs.put(("ready", engine.limits))
    try:
        EngineLoop(engine, outputs).run(commands)
    finally:
        engine.shutdown()


# A spawned process takes this process's environment as it is when it starts: engines started
# side by side (data parallelism) set theirs one at a time.
SPAWN_ENVIRONMENT_LOCK = threading.Lock()


@contextlib.contextmanager
def spawn_environment(variables: dict[str, str]):
    """os.environ with variables set, for a process started inside; restored after."""
    with SPAWN_ENVIRONMENT_LOCK:
        saved = {name: os.environ.get(name) for name in variables}
        os.environ.update(variables)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def start_engine_process(config: EngineConfig, lora_requests: tuple[LoRARequest, ...] = (), timeout: float = 900.0,
                         visible_devices: str | None = None, cancelled: threading.Event | None = None):
    """Starts the engine process and waits until its engine is built and has read the LoRA
    adapters. Returns the process, its command and output queues, and the engine's RequestLimits;
    raises RuntimeError if it failed. visible_devices: the process's CUDA_VISIBLE_DEVICES (None:
    this process's). cancelled: set by another thread (another data-parallel engine failed), the
    start stops within a second, its process killed, with a RuntimeError."""
    # spawn, not fork: the child initialises CUDA, and a forked copy of a parent that touched
    # torch's state is not safe to.
    ctx = multiprocessing.get_context("spawn")
    commands, outputs = ctx.Queue(), ctx.Queue()
    # A daemonic process may not start processes of its own, as tensor parallelism's ranks are: then
    # the engine process stops by itself when the server is gone (EngineLoop.run), and they with it.
    process = ctx.Process(target=engine_main, args=(config, commands, outputs, logging.getLogger().getEffectiveLevel(),
                                                    tuple(lora_requests)),
                          name="mini_engine-engine", daemon=config.tensor_parallel_size == 1)
    with spawn_environment({"CUDA_VISIBLE_DEVICES": visible_devices} if visible_devices is not None else {}):
        process.start()
    if not process.daemon:
        # multiprocessing joins a non-daemonic child at exit, and this one ends only when told to or
        # when this process is gone: a server that exits without AsyncEngine.shutdown tells it first.
        atexit.register(stop_engine_process, process, commands)
    waited = 0.0
    while True:
        try:
            message = outputs.get(timeout=1.0)
            break
        except queue.Empty:
            waited += 1.0
            if cancelled is not None and cancelled.is_set():
                process.kill()
                process.join()
                raise RuntimeError("start-up cancelled") from None
            if not process.is_alive():
                raise RuntimeError(f"the engine process exited (code {process.exitcode}) before it was ready")
            if waited > timeout:
                process.kill()
                raise RuntimeError(f"the engine process was not ready after {timeout:.0f} s")
    if message[0] == "failed":
        process.join(timeout=10)
        raise RuntimeError(f"the engine failed to start:\n{message[1]}")
    return process, commands, outputs, message[1]


def stop_engine_process(process, commands: multiprocessing.Queue, timeout: float = 30.0) -> None:
    if process.is_alive():
        try:
            commands.put(("shutdown",))
        except (ValueError, OSError):
            pass                # the queue was closed: AsyncEngine.shutdown ran
        process.join(timeout)
    if process.is_alive():
        process.kill()
