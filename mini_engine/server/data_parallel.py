"""Data parallelism for the server (vLLM's `--data-parallel-size`, `-dp`): N engine processes, each
holding the whole model (split over tensor_parallel_size GPUs of its own), behind one API process.

A small model serves more on a node of several GPUs as several copies than as one split copy: the
copies share nothing, so each GPU's decode steps stay as short as one engine's. The API side
sends each request to the engine that last ran the longest block-aligned start of its prompt
(PrefixAffinity: a conversation's next turn, a beam search's next step, a shared system prompt,
whose KV blocks that engine's prefix cache may still hold), among the engines within
AFFINITY_SLACK requests in flight of the least loaded; where no engine holds any of it, to the
least loaded, ties taken in turn, so that a burst spreads evenly. Engine i sees GPUs
i*tp .. (i+1)*tp - 1 of this process's (CUDA_VISIBLE_DEVICES, which it gets set to those), so
each is the single-engine server's engine, unchanged. Calls between steps (sleep, wake_up, the
prefix cache's reset, adapters checked, profiles) go to every engine.
"""
import asyncio
import itertools
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor, as_completed

import torch

from mini_engine.config import EngineConfig
from mini_engine.lora import LoRARequest
from mini_engine.server.async_engine import AsyncEngine
from mini_engine.server.metrics import ServerMetrics

# How the engines' answers to a call become the server's: the prefix cache is reset only if every
# engine's was; the server sleeps while any engine does; each engine writes a profile of its own.
COMBINED_CALLS = {"reset_prefix_cache": all, "is_sleeping": any, "is_paused": any, "stop_profile": list}


# How many more requests in flight than the least loaded engine an engine may hold and still be
# sent a request whose prompt starts as one it ran: a prefix-cache hit saves the prefill of the
# shared blocks, and a few more rows in a decode batch cost little.
AFFINITY_SLACK = 8


class PrefixAffinity:
    """For each engine, the block-aligned prompt prefixes sent to it, newest last, as the chained
    hashes of their blocks (the prefix cache's keys, less the salt and adapter, which only sharpen
    a hit): at most `capacity` an engine, about what its prefix cache can hold."""

    def __init__(self, num_engines: int, block_size: int, capacity: int):
        self.block_size, self.capacity = block_size, capacity
        self.sent: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_engines)]

    def chain(self, prompt_token_ids: list[int]) -> list[int]:
        """Each full block's hash, chained with the blocks before it."""
        hashes, previous, size = [], 0, self.block_size
        for start in range(0, len(prompt_token_ids) - size + 1, size):
            previous = hash((previous, tuple(prompt_token_ids[start:start + size])))
            hashes.append(previous)
        return hashes

    def matched_blocks(self, engine: int, chain: list[int]) -> int:
        sent = self.sent[engine]
        return next((i for i, block in enumerate(chain) if block not in sent), len(chain))

    def record(self, engine: int, chain: list[int]) -> None:
        sent = self.sent[engine]
        for block in chain:
            sent.pop(block, None)
            sent[block] = None
        while len(sent) > self.capacity:
            sent.popitem(last=False)


def engine_devices(config: EngineConfig, data_parallel_size: int) -> list[str | None]:
    """Each engine's CUDA_VISIBLE_DEVICES (None on the CPU: no GPUs to share out)."""
    if config.resolved_device().type != "cuda":
        return [None] * data_parallel_size
    if config.device not in (None, "cuda"):
        raise ValueError(f"with data_parallel_size > 1, engine i runs on its own GPUs: give device 'cuda' (or none), "
                         f"not {config.device!r}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    per_engine = config.tensor_parallel_size
    if data_parallel_size * per_engine > len(gpus):
        raise ValueError(f"data_parallel_size={data_parallel_size} x tensor_parallel_size={per_engine} needs "
                         f"{data_parallel_size * per_engine} GPUs; this process sees {len(gpus)}")
    return [",".join(gpus[i * per_engine:(i + 1) * per_engine]) for i in range(data_parallel_size)]


def start_engines(config: EngineConfig, metrics: ServerMetrics, lora_requests: tuple[LoRARequest, ...],
                  data_parallel_size: int) -> "AsyncEngine | DataParallelEngines":
    """The server's engine: one AsyncEngine, or data_parallel_size of them behind DataParallelEngines."""
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be at least 1, got {data_parallel_size}")
    if data_parallel_size == 1:
        return AsyncEngine(config, metrics.engine(0), lora_requests)
    return DataParallelEngines(config, metrics, lora_requests, data_parallel_size)


class DataParallelEngines:
    """What the server asks of its AsyncEngine, over several: next_engine() picks the one a request goes to."""

    def __init__(self, config: EngineConfig, metrics: ServerMetrics, lora_requests: tuple[LoRARequest, ...],
                 data_parallel_size: int):
        """Starts the engines side by side (each builds its model and captures its graphs at once)
        and waits for all; the first to fail cancels the others' starts (rather than waiting out
        their models and graphs), stops those that started, and raises its error."""
        devices = engine_devices(config, data_parallel_size)
        cancelled = threading.Event()
        failure = None
        with ThreadPoolExecutor(data_parallel_size) as pool:
            starting = [pool.submit(AsyncEngine, config, metrics.engine(i), lora_requests, devices[i], cancelled)
                        for i in range(data_parallel_size)]
            for done in as_completed(starting):
                if done.exception() is not None:
                    failure = starting.index(done), done.exception()
                    cancelled.set()
                    break
        if failure is not None:
            for f in starting:
                if f.exception() is None:
                    f.result().shutdown()
            index, error = failure
            raise RuntimeError(f"data-parallel engine {index} failed to start: {error}") from error
        self.engines: list[AsyncEngine] = [f.result() for f in starting]
        # Requests are checked once, against the smallest pool (GPUs of less free memory hold fewer blocks).
        self.limits = min((e.limits for e in self.engines), key=lambda limits: limits.num_blocks)
        self.turns = itertools.count()
        self.affinity = PrefixAffinity(data_parallel_size, self.limits.block_size, self.limits.num_blocks)

    def start(self) -> None:
        for engine in self.engines:
            engine.start()

    def shutdown(self) -> None:
        for engine in self.engines:
            engine.shutdown()

    @property
    def is_alive(self) -> bool:
        return all(engine.is_alive for engine in self.engines)

    @property
    def asleep(self) -> bool:
        return any(engine.asleep for engine in self.engines)

    def next_engine(self, prompt_token_ids: list[int] = ()) -> AsyncEngine:
        """The engine a request whose (first) prompt is prompt_token_ids goes to: of those within
        AFFINITY_SLACK requests in flight of the least loaded, the one that was sent the most
        leading blocks of it, then the least loaded, then the next in turn. A server whose engines
        are not all running takes no requests, as one whose single engine has stopped (its
        /health answers 503 too)."""
        if not self.is_alive:
            raise RuntimeError("a data-parallel engine process is not running")
        first = next(self.turns) % len(self.engines)
        in_turn = list(range(first, len(self.engines))) + list(range(first))
        loads = [len(engine.streams) for engine in self.engines]
        chain = self.affinity.chain(prompt_token_ids)
        near_least = [i for i in in_turn if loads[i] <= min(loads) + AFFINITY_SLACK]
        chosen = max(near_least, key=lambda i: (self.affinity.matched_blocks(i, chain), -loads[i]))
        self.affinity.record(chosen, chain)
        return self.engines[chosen]

    def abort(self, request_id: str) -> None:
        for engine in self.engines:
            if request_id in engine.streams:
                engine.abort(request_id)

    async def call(self, name: str, *args):
        """AsyncEngine.call on every engine; the first error any raised, else their results
        combined (COMBINED_CALLS; otherwise engine 0's)."""
        results = await asyncio.gather(*(engine.call(name, *args) for engine in self.engines), return_exceptions=True)
        if errors := [r for r in results if isinstance(r, BaseException)]:
            raise errors[0]
        return COMBINED_CALLS[name](results) if name in COMBINED_CALLS else results[0]

    async def check_lora(self, lora_request: LoRARequest) -> None:
        await self.call("check_lora", lora_request)

    async def sleep(self, level: int) -> None:
        """Every engine asleep, or, as when one engine refuses, none: an engine that refuses (a
        request still running on it) wakes those that slept, and its error is raised."""
        results = await asyncio.gather(*(engine.sleep(level) for engine in self.engines), return_exceptions=True)
        if errors := [r for r in results if isinstance(r, BaseException)]:
            await asyncio.gather(*(engine.wake_up(None) for engine in self.engines if engine.asleep))
            raise errors[0]

    async def wake_up(self, tags: list[str] | None) -> None:
        await asyncio.gather(*(engine.wake_up(tags) for engine in self.engines))
