"""Prometheus metrics, named like vLLM's (vllm:* there, mini_engine:* here). Each server has
its own registry, so several can live in one process (tests). Written on the event loop, from
what the engine process reports after each step (server/async_engine.py)."""
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from mini_engine.server.engine_process import EngineStats

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# vLLM's for a whole request and its phases (a request may decode for minutes), and for a step's tokens.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def token_buckets(most: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... while at most `most` (vLLM's build_1_2_5_buckets)."""
    buckets, scale = [], 1
    while True:
        for bucket in (scale, 2 * scale, 5 * scale):
            if bucket > most:
                return tuple(buckets)
            buckets.append(bucket)
        scale *= 10


class ServerMetrics:
    def __init__(self, model_name: str, max_loras: int | None = None, num_engines: int = 1,
                 max_model_len: int = 40960):
        """max_loras: with enable_lora, the engine's (the lora_requests_info gauge's max_lora).
        num_engines: the engine processes behind the server (--data-parallel-size); each series
        carries its engine's index as vLLM's do, `engine="0"`, and engine(i) is what engine i's
        AsyncEngine writes. max_model_len bounds the request-length histograms' buckets."""
        self.registry = r = CollectorRegistry()
        names = ["model_name", "engine"]
        self.families: dict[str, Gauge | Counter | Histogram] = {}

        def gauge(name, doc):
            self.families[name] = Gauge(f"mini_engine:{name}", doc, names, registry=r)

        def counter(name, doc):
            self.families[name] = Counter(f"mini_engine:{name}", doc, names, registry=r)

        def histogram(name, doc, buckets=LATENCY_BUCKETS):
            self.families[name] = Histogram(f"mini_engine:{name}", doc, names, buckets=buckets, registry=r)

        gauge("num_requests_running", "Requests scheduled on the engine.")
        gauge("num_requests_waiting", "Requests waiting for admission.")
        gauge("kv_cache_blocks_used", "KV cache blocks held by requests.")
        gauge("kv_cache_blocks_total", "KV cache blocks in the pool.")
        gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use.")
        gauge("prefix_cache_hit_rate", "Tokens served by the prefix cache over tokens looked up, at each admission "
              "(a preempted request's included), since start.")
        counter("prompt_tokens", "Prompt tokens of requests the server accepted.")
        counter("generation_tokens", "Tokens generated.")
        counter("num_preemptions", "Preemptions since start.")
        counter("spec_decode_num_drafts", "Speculative decoding: steps in which a sequence had drafts verified.")
        counter("spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified.")
        counter("spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted.")
        self.families["spec_accepted_per_pos"] = Counter(
            "mini_engine:spec_decode_num_accepted_tokens_per_pos", "Speculative decoding: draft tokens accepted, by "
            "their position among a step's drafts (0 = the first).", [*names, "position"], registry=r)
        self.families["request_success"] = Counter(
            "mini_engine:request_success", "Finished requests, by finish reason.", [*names, "finished_reason"],
            registry=r)
        counter("prefix_cache_queries", "Prefix cache: prompt tokens looked up, at each admission.")
        counter("prefix_cache_hits", "Prefix cache: prompt tokens found, at each admission.")
        counter("external_prefix_cache_queries", "KV offloading's host tier: prompt tokens looked up there (those "
                "the KV pool did not hold), at each admission.")
        counter("external_prefix_cache_hits", "KV offloading's host tier: prompt tokens loaded from there, at each "
                "admission.")
        histogram("time_to_first_token_seconds", "Arrival to first generated token.")
        histogram("time_per_output_token_seconds", "Per request: (last token - first token) / (output tokens - 1).")
        histogram("e2e_request_latency_seconds", "Arrival to last token.", REQUEST_LATENCY_BUCKETS)
        # vLLM's request-phase histograms, from its first admission to the engine (queue: arrival to
        # it; prefill: it to the first token; decode: first token to last; inference: it to the
        # last), the token times the engine's (EngineStats.time), as vLLM's engine-core timestamps.
        for name, doc in (("queue", "Arrival to first admission by the scheduler."),
                          ("prefill", "First admission to first generated token."),
                          ("decode", "First generated token to last."),
                          ("inference", "First admission to last generated token.")):
            histogram(f"request_{name}_time_seconds", doc, REQUEST_LATENCY_BUCKETS)
        lengths = token_buckets(max_model_len)
        histogram("request_prompt_tokens", "Prompt tokens of each finished request the engine ran.", lengths)
        histogram("request_generation_tokens", "Generated tokens of each finished request the engine ran.", lengths)
        histogram("request_params_max_tokens", "The max_tokens of each finished request the engine ran.", lengths)
        histogram("iteration_tokens_total", "Tokens each engine step generated, and the prompts of requests that got "
                  "their first token in it.", ITERATION_TOKEN_BUCKETS)
        # vLLM's lora_requests_info, with its labels and no others (routers such as the Gateway API
        # Inference Extension read them): the adapters running and waiting, by name, comma-separated,
        # and max_lora; the value, when an engine last reported them. One series, the current one:
        # vLLM keeps every combination it has seen, each at its last time (readers take the latest).
        # With several engines, the adapters of all of them, each once.
        self.max_loras = max_loras
        self.lora_info = self.lora_labels = None
        if max_loras is not None:
            self.lora_info = Gauge("mini_engine:lora_requests_info", "Running stats on lora requests.",
                                   ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=r)
        self.engines = [EngineMetrics(self, model_name, str(i)) for i in range(num_engines)]

    def engine(self, index: int) -> "EngineMetrics":
        return self.engines[index]

    def update_lora_info(self) -> None:
        reported = [e.last_stats for e in self.engines if e.last_stats is not None]
        running, waiting = ({name: None for stats in reported for name in getattr(stats, kind)}
                            for kind in ("running_lora_adapters", "waiting_lora_adapters"))
        labels = (str(self.max_loras), ",".join(waiting), ",".join(running))
        if self.lora_labels is not None and labels != self.lora_labels:
            self.lora_info.remove(*self.lora_labels)
        self.lora_labels = labels
        self.lora_info.labels(*labels).set_to_current_time()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineMetrics:
    """One engine's series of the server's metrics: what its AsyncEngine writes."""

    def __init__(self, server: ServerMetrics, model_name: str, engine: str):
        self.server = server
        families = server.families
        labels = {"model_name": model_name, "engine": engine}
        for attribute, name in (
                ("num_requests_running", "num_requests_running"), ("num_requests_waiting", "num_requests_waiting"),
                ("kv_blocks_used", "kv_cache_blocks_used"), ("kv_blocks_total", "kv_cache_blocks_total"),
                ("kv_usage", "kv_cache_usage_perc"), ("prefix_hit_rate", "prefix_cache_hit_rate"),
                ("prompt_tokens", "prompt_tokens"), ("generation_tokens", "generation_tokens"),
                ("num_preemptions", "num_preemptions"), ("spec_drafts", "spec_decode_num_drafts"),
                ("spec_draft_tokens", "spec_decode_num_draft_tokens"),
                ("spec_accepted_tokens", "spec_decode_num_accepted_tokens"),
                ("ttft", "time_to_first_token_seconds"), ("tpot", "time_per_output_token_seconds"),
                ("e2e", "e2e_request_latency_seconds"), ("prefix_queries", "prefix_cache_queries"),
                ("prefix_hits", "prefix_cache_hits"), ("external_queries", "external_prefix_cache_queries"),
                ("external_hits", "external_prefix_cache_hits"), ("queue_time", "request_queue_time_seconds"),
                ("prefill_time", "request_prefill_time_seconds"), ("decode_time", "request_decode_time_seconds"),
                ("inference_time", "request_inference_time_seconds"), ("request_prompt_tokens", "request_prompt_tokens"),
                ("request_generation_tokens", "request_generation_tokens"),
                ("request_max_tokens", "request_params_max_tokens"), ("step_tokens", "iteration_tokens_total")):
            setattr(self, attribute, families[name].labels(**labels))
        self.spec_accepted_at = lambda position: families["spec_accepted_per_pos"].labels(
            **labels, position=str(position))
        self.finished = lambda reason: families["request_success"].labels(**labels, finished_reason=reason).inc()
        self.counted: dict[str, int] = {}       # what each counter has counted of the engine's totals
        self.last_stats: EngineStats | None = None     # for lora_requests_info, which spans the engines

    def finished_request(self, stream) -> None:
        """A finished request's lengths and phases (stream: its RequestStream), if the engine ran it."""
        scheduled = stream.scheduled_time
        if scheduled is None:               # refused, or aborted while it waited
            return
        self.request_prompt_tokens.observe(stream.num_prompt_tokens)
        self.request_generation_tokens.observe(stream.num_output_tokens)
        if stream.max_tokens is not None:
            self.request_max_tokens.observe(stream.max_tokens)
        self.queue_time.observe(max(0.0, scheduled - stream.arrival_time))
        first, last = stream.first_token_step_time, stream.last_token_step_time
        if first is None:                   # ended before its first token
            return
        self.prefill_time.observe(max(0.0, first - scheduled))
        self.decode_time.observe(last - first)
        self.inference_time.observe(max(0.0, last - scheduled))

    def update_engine_state(self, stats: EngineStats) -> None:
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_blocks_used.set(stats.kv_blocks_used)
        self.kv_blocks_total.set(stats.kv_blocks_total)
        self.kv_usage.set(stats.kv_blocks_used / stats.kv_blocks_total)
        queried = stats.prefix_cache_queried_tokens
        self.prefix_hit_rate.set(stats.prefix_cache_hit_tokens / queried if queried else 0.0)
        if stats.step_tokens:
            self.step_tokens.observe(stats.step_tokens)
        for name, counter in (("num_preemptions", self.num_preemptions), ("spec_num_drafts", self.spec_drafts),
                              ("prefix_cache_queried_tokens", self.prefix_queries),
                              ("prefix_cache_hit_tokens", self.prefix_hits),
                              ("external_prefix_cache_queried_tokens", self.external_queries),
                              ("external_prefix_cache_hit_tokens", self.external_hits),
                              ("spec_num_draft_tokens", self.spec_draft_tokens),
                              ("spec_num_accepted_tokens", self.spec_accepted_tokens)):
            # The engine reports totals since start. Counters, as vLLM's, for rate() and increase():
            # each goes up by what it has not counted yet.
            total = getattr(stats, name)
            counter.inc(total - self.counted.get(name, 0))
            self.counted[name] = total
        for position, total in enumerate(stats.spec_accepted_per_position):
            name = f"spec_accepted_at_{position}"
            self.spec_accepted_at(position).inc(total - self.counted.get(name, 0))
            self.counted[name] = total
        if self.server.lora_info is not None:
            self.last_stats = stats
            self.server.update_lora_info()
