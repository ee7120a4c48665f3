"""Data parallelism for the server (vLLM's `--data-parallel-size`, `-dp`): N engine processes, each
holding the whole model (split over tensor_parallel_size GPUs of its own), behind one API process.

A small model serves more on a node of several GPUs as several copies than as one split copy: the
copies share nothing, so each GPU's decode steps stay as short as one engine's. The API side
sends each request to the engine with the fewest requests in flight (ties taken in turn), so that
a burst spreads evenly and a long request does not draw more onto its engine. Engine i sees GPUs
i*tp .. (i+1)*tp - 1 of this process's (CUDA_VISIBLE_DEVICES, which it gets set to those), so
each is the single-engine server's engine, unchanged. Calls between steps (sleep, wake_up, the
prefix cache's reset, adapters checked, profiles) go to every engine.
"""
import asyncio
import itertools
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from mini_engine.config import EngineConfig
from mini_engine.lora import LoRARequest
from mini_engine.server.async_engine import AsyncEngine
from mini_engine.server.metrics import ServerMetrics

# How the engines' answers to a call become the server's: the prefix cache is reset only if every
# engine's was; the server sleeps while any engine does; each engine writes a profile of its own.
COMBINED_CALLS = {"reset_prefix_cache": all, "is_sleeping": any, "stop_profile": list}


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
    if data_parallel_size == 1:
        return AsyncEngine(config, metrics.engine(0), lora_requests)
    return DataParallelEngines(config, metrics, lora_requests, data_parallel_size)


class DataParallelEngines:
    """What the server asks of its AsyncEngine, over several: next_engine() picks the one a request goes to."""

    def __init__(self, config: EngineConfig, metrics: ServerMetrics, lora_requests: tuple[LoRARequest, ...],
                 data_parallel_size: int):
        """Starts the engines side by side (each builds its model and captures its graphs at once)
        and waits for all; if one fails, stops the others and raises its error."""
        devices = engine_devices(config, data_parallel_size)
        with ThreadPoolExecutor(data_parallel_size) as pool:
            starting = [pool.submit(AsyncEngine, config, metrics.engine(i), lora_requests, devices[i])
                        for i in range(data_parallel_size)]
        failures = [(i, f.exception()) for i, f in enumerate(starting) if f.exception() is not None]
        if failures:
            for f in starting:
                if f.exception() is None:
                    f.result().shutdown()
            index, error = failures[0]
            raise RuntimeError(f"data-parallel engine {index} failed to start: {error}") from error
        self.engines: list[AsyncEngine] = [f.result() for f in starting]
        # Requests are checked once, against the smallest pool (GPUs of less free memory hold fewer blocks).
        self.limits = min((e.limits for e in self.engines), key=lambda limits: limits.num_blocks)
        self.turns = itertools.count()

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

    def next_engine(self) -> AsyncEngine:
        """The engine with the fewest requests in flight, ties taken in turn. A server whose engines
        are not all running takes no requests, as one whose single engine has stopped (its /health
        answers 503 too)."""
        if not self.is_alive:
            raise RuntimeError("a data-parallel engine process is not running")
        first = next(self.turns) % len(self.engines)
        in_turn = self.engines[first:] + self.engines[:first]
        return min(in_turn, key=lambda engine: len(engine.streams))

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
        await asyncio.gather(*(engine.sleep(level) for engine in self.engines))

    async def wake_up(self, tags: list[str] | None) -> None:
        await asyncio.gather(*(engine.wake_up(tags) for engine in self.engines))
