"""Prometheus metrics, named like vLLM's (vllm:* there, mini_engine:* here). Each server has
its own registry, so several can live in one process (tests). Written on the event loop, from
what the engine process reports after each step (server/async_engine.py)."""
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from mini_engine.server.engine_process import EngineStats

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self, model_name: str, max_loras: int | None = None):
        """max_loras: with enable_lora, the engine's (the lora_requests_info gauge's max_lora)."""
        self.registry = r = CollectorRegistry()
        labels = {"model_name": model_name}

        def gauge(name, doc):
            return Gauge(f"mini_engine:{name}", doc, list(labels), registry=r).labels(**labels)

        def counter(name, doc):
            return Counter(f"mini_engine:{name}", doc, list(labels), registry=r).labels(**labels)

        def histogram(name, doc):
            return Histogram(f"mini_engine:{name}", doc, list(labels), buckets=LATENCY_BUCKETS,
                             registry=r).labels(**labels)

        self.num_requests_running = gauge("num_requests_running", "Requests scheduled on the engine.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting for admission.")
        self.kv_blocks_used = gauge("kv_cache_blocks_used", "KV cache blocks held by requests.")
        self.kv_blocks_total = gauge("kv_cache_blocks_total", "KV cache blocks in the pool.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use.")
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate", "Tokens served by the prefix cache over tokens "
                                     "looked up, at each admission (a preempted request's included), since start.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests the server accepted.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.num_preemptions = counter("num_preemptions", "Preemptions since start.")
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculative decoding: steps in which a sequence "
                                   "had drafts verified.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens "
                                            "accepted.")
        per_position = Counter("mini_engine:spec_decode_num_accepted_tokens_per_pos", "Speculative decoding: "
                               "draft tokens accepted, by their position among a step's drafts (0 = the first).",
                               ["model_name", "position"], registry=r)
        self.spec_accepted_at = lambda position: per_position.labels(model_name=model_name, position=str(position))
        self.counted: dict[str, int] = {}       # what each counter has counted of the engine's totals
        finished = Counter("mini_engine:request_success", "Finished requests, by finish reason.",
                           ["model_name", "finished_reason"], registry=r)
        self.finished = lambda reason: finished.labels(model_name=model_name, finished_reason=reason).inc()
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first generated token.")
        self.tpot = histogram("time_per_output_token_seconds", "Per request: (last token - first token) "
                              "/ (output tokens - 1).")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.")
        # vLLM's lora_requests_info, with its labels and no others (routers such as the Gateway API
        # Inference Extension read them): the adapters running and waiting, by name, comma-separated,
        # and max_lora; the value, when the engine last reported them. One series, the current one:
        # vLLM keeps every combination it has seen, each at its last time (readers take the latest).
        self.max_loras = max_loras
        self.lora_info = self.lora_labels = None
        if max_loras is not None:
            self.lora_info = Gauge("mini_engine:lora_requests_info", "Running stats on lora requests.",
                                   ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=r)

    def update_engine_state(self, stats: EngineStats) -> None:
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_blocks_used.set(stats.kv_blocks_used)
        self.kv_blocks_total.set(stats.kv_blocks_total)
        self.kv_usage.set(stats.kv_blocks_used / stats.kv_blocks_total)
        queried = stats.prefix_cache_queried_tokens
        self.prefix_hit_rate.set(stats.prefix_cache_hit_tokens / queried if queried else 0.0)
        for name, counter in (("num_preemptions", self.num_preemptions), ("spec_num_drafts", self.spec_drafts),
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
        if self.lora_info is not None:
            self.update_lora_info(stats)

    def update_lora_info(self, stats: EngineStats) -> None:
        labels = (str(self.max_loras), ",".join(stats.waiting_lora_adapters), ",".join(stats.running_lora_adapters))
        if self.lora_labels is not None and labels != self.lora_labels:
            self.lora_info.remove(*self.lora_labels)
        self.lora_labels = labels
        self.lora_info.labels(*labels).set_to_current_time()

    def render(self) -> bytes:
        return generate_latest(self.registry)
