"""AsyncLLM: vLLM's asyncio entry to the engine (vllm.v1.engine.async_llm.AsyncLLM), for programs
that orchestrate generation themselves (an RL trainer's rollouts, an agent framework, a server of
their own):

    llm = AsyncLLM("path/to/Qwen3-0.6B", max_num_seqs=256)
    async for output in llm.generate("Hello", SamplingParams(max_tokens=32), request_id="r1"):
        print(output.outputs[0].text)        # all of it so far (SamplingParams.output_kind)

The engine runs in a process of its own, as the server's does (server/engine_process.py: it
schedules, steps, detokenizes and matches stop strings there), and this process is the server's
AsyncEngine without HTTP: requests stream their deltas back through one queue, so many concurrent
generate() calls share the engine's batches. A generate() whose caller stops iterating (breaks,
or is cancelled) aborts its request, and the engine frees its KV blocks before its next step.
Needs prometheus-client (the server's extra): the engine's metrics are kept as the server keeps
them, and metrics_text() gives them in Prometheus' format.
"""
import asyncio
import itertools
from multiprocessing.reduction import ForkingPickler
from collections.abc import AsyncIterator

from mini_engine.config import EngineConfig
from mini_engine.llm import prompt_cache_salt, unwrap_prompt
from mini_engine.lora import LoRARequest
from mini_engine.layers.pooler import task_output
from mini_engine.outputs import CompletionOutput, PoolingOutput, PoolingRequestOutput, RequestOutput
from mini_engine.pooling_params import PoolingParams, check_task_parameters, resolve_pooling_task, truncate_prompt
from mini_engine.sampling_params import RequestOutputKind, SamplingParams
from mini_engine.tokenizer import encode_prompt, load_tokenizer, load_transformers_tokenizer


class AsyncLLM:
    def __init__(self, model: str, **kwargs):
        """model and engine options as LLM's (EngineConfig's fields). Returns once the engine's
        process has loaded the model and sized its KV pool."""
        from mini_engine.server.async_engine import AsyncEngine
        from mini_engine.server.metrics import EngineMetrics, ServerMetrics
        from mini_engine.server.stats_logger import StatsLogger

        self.config = EngineConfig.from_kwargs(model, **kwargs)
        self.tokenizer = load_tokenizer(self.config.tokenizer_path)
        self.server_metrics = ServerMetrics(model, self.config.max_loras if self.config.enable_lora else None,
                                            max_model_len=self.config.max_model_len)
        self.engine = AsyncEngine(self.config, EngineMetrics(self.server_metrics, model, "0"))
        self.stats = StatsLogger(self.server_metrics, model)
        self.limits = self.engine.limits
        self.checked_loras: set[int] = set()
        self.request_counter = itertools.count()
        self.children: dict[str, list[str]] = {}     # a running generate()'s id -> its completions' ids
        self.hf_tokenizer = None
        self.stopped = False

    def __del__(self):
        # As vLLM's: an AsyncLLM dropped without shutdown() does not leave its engine's process
        # (and its GPU memory) behind. (getattr: __init__ may have failed before the engine started.)
        if getattr(self, "engine", None) is not None:
            self.shutdown()

    # ---- vLLM's AsyncLLM methods ----

    async def generate(self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None,
                       *, lora_request: LoRARequest | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """The request's RequestOutput as its tokens arrive: after every engine step that brought
        some (CUMULATIVE, the default: all of the output so far; DELTA: only what is new, and only
        the completions that changed), or once, finished (FINAL_ONLY). prompt: a text, token ids,
        or vLLM's {"prompt": ...} / {"prompt_token_ids": ...} dict, with an optional cache_salt.
        Raises ValueError before anything runs for a request the engine could never run, and
        RuntimeError if the engine fails the request (or its process dies)."""
        self.start()
        if self.config.runner == "pooling":
            raise ValueError("this AsyncLLM runs a pooling model (runner='pooling'): encode() gives its outputs")
        params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        request_id = str(next(self.request_counter)) if request_id is None else str(request_id)
        ids = self.prompt_token_ids(prompt, params)
        salt = prompt_cache_salt(prompt)
        completions = [params] if params.n == 1 else [params.completion(k) for k in range(params.n)]
        for child in completions:
            self.limits.validate(ids, child)
        await self.check_admission(request_id, priority, lora_request)
        child_ids = [request_id] if params.n == 1 else [f"{k}_{request_id}" for k in range(params.n)]
        if busy := [c for c in child_ids if c in self.engine.streams]:
            raise ValueError(f"request id {busy[0]!r}, which completion {child_ids.index(busy[0])} of {request_id!r} "
                             "would take, is already running")
        streams = [self.engine.add_request(c, ids, child, validated=True, priority=priority, lora_request=lora_request,
                                           cache_salt=salt) for c, child in zip(child_ids, completions)]
        text = unwrap_prompt(prompt)
        output = RequestOutput(request_id, text if isinstance(text, str) else None, ids,
                               [CompletionOutput(k, "", [], None) for k in range(params.n)])
        sent = DeltaMarks(params.n)
        merged: asyncio.Queue = asyncio.Queue()
        readers = [asyncio.ensure_future(self.read_stream(k, stream, merged)) for k, stream in enumerate(streams)]
        self.children[request_id] = child_ids
        running = len(streams)
        try:
            while running:
                changed = set()
                k, delta = await merged.get()
                while True:        # every delta already here: one output for what one step brought
                    if delta.finish_reason == "error":
                        raise RuntimeError(f"request {child_ids[k]}: {delta.error}")
                    add_delta(output, k, delta, params)
                    changed.add(k)
                    running -= delta.finish_reason is not None
                    if merged.empty():
                        break
                    k, delta = merged.get_nowait()
                output.finished = running == 0
                if params.output_kind is RequestOutputKind.CUMULATIVE:
                    yield cumulative(output)
                elif params.output_kind is RequestOutputKind.DELTA:
                    yield sent.delta_of(output, changed)
                elif output.finished:
                    yield output
        finally:
            for reader in readers:
                reader.cancel()
            if self.children.get(request_id) is child_ids:
                del self.children[request_id]
            for c, stream in zip(child_ids, streams):
                if not stream.finished:      # its stream goes when the engine's "abort" comes back
                    self.engine.abort(c)

    async def encode(self, prompt, pooling_params: PoolingParams | None = None, request_id: str | None = None, *,
                     pooling_task: str | None = None, lora_request: LoRARequest | None = None,
                     priority: int = 0) -> AsyncIterator[PoolingRequestOutput]:
        """vLLM's AsyncLLM.encode, for a pooling model (runner="pooling"): the prompt's pooled
        output, yielded once, as LLM.encode gives it (`outputs.data`: an embedding, a classifier's
        labels' probabilities, a cross-encoder's score; pooling_task as LLM.encode's)."""
        self.start()
        if self.config.runner != "pooling":
            raise ValueError("encode needs a pooling model: AsyncLLM(path, runner='pooling')")
        pooler = self.config.pooler
        task = resolve_pooling_task(pooling_task, pooler)
        params = pooling_params if pooling_params is not None else PoolingParams()
        check_task_parameters(params, task, pooler)
        request_id = str(next(self.request_counter)) if request_id is None else str(request_id)
        ids = self.prompt_token_ids(prompt, params)
        self.limits.validate(ids, params)
        await self.check_admission(request_id, priority, lora_request)
        stream = self.engine.add_request(request_id, ids, params, validated=True, priority=priority,
                                         lora_request=lora_request, cache_salt=prompt_cache_salt(prompt))
        try:
            async for delta in stream:
                if delta.finish_reason == "error":
                    raise RuntimeError(f"request {request_id}: {delta.error}")
                if delta.embedding is not None:
                    yield PoolingRequestOutput(request_id, ids, PoolingOutput(task_output(delta.embedding, pooler)))
        finally:
            if not stream.finished:
                self.engine.abort(request_id)

    async def abort(self, request_id: str | list[str]) -> None:
        """Ends the request (each of its n completions): its generate() yields it finished, "abort"."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            for c in self.children.get(rid, ()):
                if c in self.engine.streams:
                    self.engine.abort(c)

    def shutdown(self) -> None:
        """Stops the engine's process; requests still running end with an error. Again, it does nothing."""
        if not self.stopped:
            self.stopped = True
            self.engine.shutdown()

    async def get_tokenizer(self):
        """vLLM's: the checkpoint's tokenizer as transformers loads it (apply_chat_template, ...);
        self.tokenizer is the engine's own (the tokenizers library's)."""
        if self.hf_tokenizer is None:
            self.hf_tokenizer = load_transformers_tokenizer(self.config.tokenizer_path, self.tokenizer is not None,
                                                            "AsyncLLM")
        return self.hf_tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.config.default_sampling_params()

    async def check_health(self) -> None:
        self.start()
        if not self.engine.is_alive:
            raise RuntimeError("the engine process is not running")

    @property
    def is_running(self) -> bool:
        """The engine's process runs (and, once a call has started it, its output reader)."""
        return not self.stopped and (self.engine.is_alive if self.engine.reader is not None
                                     else self.engine.process.is_alive())

    async def reset_prefix_cache(self, reset_connector: bool = False) -> bool:
        self.start()
        return await self.engine.call("reset_prefix_cache", reset_connector)

    async def pause_generation(self, *, mode: str = "abort", wait_for_inflight_requests: bool | None = None,
                               clear_cache: bool = True) -> None:
        """vLLM's, for weight updates between an RL trainer's steps: no engine step runs until
        resume_generation(), and generate() calls made meanwhile wait for it. mode "abort" ends the
        unfinished requests now (their outputs end with finish_reason "abort"), "wait" lets them
        finish first, "keep" freezes them to go on after resume. clear_cache: no token after resume
        reads K and V computed before (a kept request recomputes its prompt and output). Returns
        once paused; load_weights may then run under kept requests. wait_for_inflight_requests:
        vLLM's older form, True for "wait" and False for "abort"."""
        from mini_engine.server.engine_process import pause_mode
        self.start()
        await self.engine.call("pause_generation", pause_mode(mode, wait_for_inflight_requests), clear_cache)

    async def resume_generation(self) -> None:
        self.start()
        await self.engine.call("resume_generation")

    async def is_paused(self) -> bool:
        self.start()
        return await self.engine.call("is_paused")

    async def sleep(self, level: int = 1) -> None:
        """Sleep mode (enable_sleep_mode), as LLM.sleep: the weights' and the KV pool's memory
        given back until wake_up; generate() is refused meanwhile."""
        self.start()
        await self.engine.sleep(level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        self.start()
        await self.engine.wake_up(tags)

    async def is_sleeping(self) -> bool:
        self.start()
        return await self.engine.call("is_sleeping")

    async def load_weights(self, weights) -> int:
        """LLM.load_weights' update (runner/weight_updates.py), sent to the engine's process between
        two steps, as an RL trainer's rollouts with vLLM's AsyncLLM update it: Hugging Face names and
        tensors (a dict, named_parameters(), or pairs). They cross as torch's multiprocessing moves
        tensors (a CPU tensor through shared memory, a GPU's by CUDA IPC, held here until the engine
        has written them). Raises ValueError for a bad name, shape or value, with nothing written, and
        RuntimeError while requests are unfinished (unless generation is paused: pause_generation);
        returns the tensors written."""
        self.start()
        pairs = [(name, tensor.detach()) for name, tensor in (weights.items() if isinstance(weights, dict) else weights)]
        try:
            # Pickled here first: the queue's feeder thread would only print its failure (shared
            # memory full, say), and the call would wait for ever.
            ForkingPickler.dumps(pairs)
        except Exception as e:
            raise ValueError(f"load_weights: the tensors cannot be sent to the engine's process "
                             f"({type(e).__name__}: {e})") from e
        return await self.engine.call("load_weights", pairs)

    async def start_profile(self, profile_dir: str | None = None) -> None:
        """LLM.start_profile's torch.profiler, in the engine's process."""
        self.start()
        await self.engine.call("start_profile", profile_dir)

    async def stop_profile(self) -> str:
        """Stops it; returns the Chrome trace's path."""
        self.start()
        return await self.engine.call("stop_profile")

    async def do_log_stats(self) -> None:
        """vLLM's: the server's periodic stats line (server/stats_logger.py), logged now, over the
        time since the last one (at INFO, "mini_engine.server")."""
        self.stats.log()

    def metrics_text(self) -> str:
        """The engine's metrics in Prometheus' text format, as the server's /metrics gives them."""
        from prometheus_client import generate_latest
        return generate_latest(self.server_metrics.registry).decode()

    # ---- helpers ----

    def start(self) -> None:
        """The engine's output reader, on the running event loop: the first call's (one loop an AsyncLLM)."""
        if self.stopped:
            raise RuntimeError("this AsyncLLM has been shut down")
        loop = asyncio.get_running_loop()
        if self.engine.loop is None:
            self.engine.start()
        elif self.engine.loop is not loop:
            raise RuntimeError("an AsyncLLM serves the event loop that first used it")

    def prompt_token_ids(self, prompt, params: SamplingParams | PoolingParams) -> list[int]:
        """A pooling model's text gets the tokenizer's special tokens, as LLMEngine.tokenize gives them."""
        ids = encode_prompt(self.tokenizer, unwrap_prompt(prompt), add_special_tokens=self.config.runner == "pooling")
        return truncate_prompt(ids, params, self.config.max_model_len)

    async def check_admission(self, request_id: str, priority: int, lora_request: LoRARequest | None) -> None:
        """What generate() and encode() check of a request before it is sent: its priority, its
        adapter (read by the engine), an id no running request holds, and an engine awake."""
        self.config.check_priority(priority)
        if lora_request is not None:
            await self.check_lora(lora_request)
        if request_id in self.children or request_id in self.engine.streams:
            raise ValueError(f"request id {request_id!r} is already running")
        if self.engine.asleep:
            raise RuntimeError("the engine is asleep (sleep mode): wake_up() first")

    async def check_lora(self, lora_request: LoRARequest) -> None:
        """Has the engine read an adapter before its first request (ValueError with the engine's reason)."""
        if not self.config.enable_lora:
            raise ValueError("lora_request needs enable_lora=True")
        if lora_request.lora_int_id not in self.checked_loras:
            await self.engine.check_lora(lora_request)
            self.checked_loras.add(lora_request.lora_int_id)

    @staticmethod
    async def read_stream(k: int, stream, merged: asyncio.Queue) -> None:
        async for delta in stream:
            merged.put_nowait((k, delta))


def add_delta(output: RequestOutput, k: int, delta, params: SamplingParams) -> None:
    """Completion k of output, and the request's prompt-side fields, with one delta added."""
    completion = output.outputs[k]
    completion.text += delta.text
    completion.token_ids.extend(delta.token_ids)
    if params.logprobs is not None and delta.logprobs:
        if completion.logprobs is None:
            completion.logprobs = []
        completion.logprobs.extend(delta.logprobs)
        completion.cumulative_logprob = (completion.cumulative_logprob or 0.0) + sum(lp.logprob for lp in delta.logprobs)
    completion.finish_reason = delta.finish_reason
    if delta.prompt_logprobs is not None:
        output.prompt_logprobs = delta.prompt_logprobs
    output.num_cached_tokens = max(output.num_cached_tokens, delta.num_cached_tokens)


def cumulative(output: RequestOutput) -> RequestOutput:
    """The output so far. As vLLM's, its token_ids and logprobs lists are the request's own, which
    later steps extend (copying them at every step would cost a request quadratic time in its
    length): a caller that keeps an output past the next one copies them."""
    return RequestOutput(output.request_id, output.prompt, output.prompt_token_ids,
                         [CompletionOutput(c.index, c.text, c.token_ids, c.finish_reason, c.logprobs,
                                           c.cumulative_logprob) for c in output.outputs],
                         output.finished, output.num_cached_tokens, prompt_logprobs=output.prompt_logprobs)


class DeltaMarks:
    """How much of each completion's text, tokens and logprobs the DELTA outputs so far have held."""

    def __init__(self, n: int):
        self.marks = [(0, 0, 0)] * n
        self.prompt_sent = False

    def delta_of(self, output: RequestOutput, changed: set[int]) -> RequestOutput:
        """The completions that changed, each with what is new since the last output; the prompt's
        log-probabilities with the first output only."""
        parts = []
        for k in sorted(changed):
            c = output.outputs[k]
            text_at, ids_at, logprobs_at = self.marks[k]
            parts.append(CompletionOutput(k, c.text[text_at:], c.token_ids[ids_at:], c.finish_reason,
                                          None if c.logprobs is None else c.logprobs[logprobs_at:], c.cumulative_logprob))
            self.marks[k] = (len(c.text), len(c.token_ids), len(c.logprobs or []))
        prompt_logprobs = None if self.prompt_sent else output.prompt_logprobs
        self.prompt_sent = self.prompt_sent or prompt_logprobs is not None
        return RequestOutput(output.request_id, output.prompt, output.prompt_token_ids, parts, output.finished,
                             output.num_cached_tokens, prompt_logprobs=prompt_logprobs)
