"""vLLM's periodic stats line in the server's log (its LoggingStatLogger; off with
--disable-log-stats): every VLLM_LOG_STATS_INTERVAL seconds (10 by default), for each engine that
has had work since the last line,

    Engine 000: Avg prompt throughput: 1234.5 tokens/s, Avg generation throughput: 5678.9 tokens/s,
    Running: 12 reqs, Waiting: 0 reqs, GPU KV cache usage: 3.2%, Prefix cache hit rate: 45.6%

read from the server's own metrics (metrics.py), so it says what /metrics says. Prompt tokens are
counted as vLLM counts them: a request's whole prompt, in the interval its first token came (a
pooling request's, in that of its output)."""
import asyncio
import logging
import os
import time

from mini_engine.server.metrics import ServerMetrics

logger = logging.getLogger("mini_engine.server")


def log_stats_interval() -> float:
    """vLLM's VLLM_LOG_STATS_INTERVAL, in seconds."""
    value = os.environ.get("VLLM_LOG_STATS_INTERVAL", "10")
    try:
        interval = float(value)
    except ValueError:
        raise ValueError(f"VLLM_LOG_STATS_INTERVAL must be a number of seconds, got {value!r}") from None
    if not interval > 0:
        raise ValueError(f"VLLM_LOG_STATS_INTERVAL must be above 0, got {value!r}")
    return interval


class StatsLogger:
    def __init__(self, metrics: ServerMetrics, model_name: str, num_engines: int = 1):
        self.metrics = metrics
        self.labels = [{"model_name": model_name, "engine": str(i)} for i in range(num_engines)]
        self.last = [self.counts(labels) for labels in self.labels]
        self.last_time = time.monotonic()
        self.was_idle = [True] * num_engines

    def value(self, name: str, labels: dict) -> float:
        return self.metrics.registry.get_sample_value(f"mini_engine:{name}", labels) or 0.0

    def counts(self, labels: dict) -> tuple[float, float]:
        """(tokens of prompts and generated tokens, generated tokens) so far: iteration_tokens_total
        counts both, vLLM's way."""
        return self.value("iteration_tokens_total_sum", labels), self.value("generation_tokens_total", labels)

    def log(self) -> None:
        now = time.monotonic()
        elapsed, self.last_time = max(now - self.last_time, 1e-9), now
        for i, labels in enumerate(self.labels):
            (both, generated), (last_both, last_generated) = self.counts(labels), self.last[i]
            self.last[i] = both, generated
            prompt_rate = (both - generated - (last_both - last_generated)) / elapsed
            generation_rate = (generated - last_generated) / elapsed
            running, waiting = self.value("num_requests_running", labels), self.value("num_requests_waiting", labels)
            idle = prompt_rate == 0 and generation_rate == 0 and running == 0 and waiting == 0
            if idle and self.was_idle[i]:
                continue            # one line after the work stops, then quiet, as vLLM's
            self.was_idle[i] = idle
            queries, hits = self.value("prefix_cache_queries_total", labels), self.value("prefix_cache_hits_total", labels)
            line = ("Engine %03d: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                    "Running: %d reqs, Waiting: %d reqs, GPU KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%")
            args = [i, prompt_rate, generation_rate, running, waiting,
                    100 * self.value("kv_cache_usage_perc", labels), 100 * hits / queries if queries else 0.0]
            # With a host tier that has been asked (kv_offloading_size), vLLM's connector's rate too.
            external = self.value("external_prefix_cache_queries_total", labels)
            if external:
                line += ", External prefix cache hit rate: %.1f%%"
                args.append(100 * self.value("external_prefix_cache_hits_total", labels) / external)
            logger.info(line, *args)

    async def run(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            self.log()
