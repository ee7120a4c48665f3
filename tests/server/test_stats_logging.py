"""vLLM's log lines: the periodic stats line (--disable-log-stats turns it off; VLLM_LOG_STATS_INTERVAL
sets its period), read from the server's own metrics, with vLLM's prompt count (a request's prompt
in the interval of its first token), one line after the work stops and then quiet; and
--enable-log-requests' line for each request, cut to --max-log-len prompt token ids."""
import logging
import re
import time

import httpx
import pytest

from mini_engine.serve import parse_args, serving_options
from mini_engine.server.metrics import EngineMetrics, ServerMetrics
from mini_engine.server.stats_logger import StatsLogger, log_stats_interval
from tests.server.conftest import MODEL_NAME, launched_server

LINE = re.compile(r"Engine 000: Avg prompt throughput: ([0-9.]+) tokens/s, Avg generation throughput: ([0-9.]+) "
                  r"tokens/s, Running: (\d+) reqs, Waiting: (\d+) reqs, GPU KV cache usage: ([0-9.]+)%, "
                  r"Prefix cache hit rate: ([0-9.]+)%")


def test_the_line_says_what_the_metrics_say(caplog, monkeypatch):
    server = ServerMetrics("m")
    engine = EngineMetrics(server, "m", "0")
    stats = StatsLogger(server, "m")
    clock = iter([100.0, 102.0, 104.0, 106.0])
    monkeypatch.setattr("mini_engine.server.stats_logger.time.monotonic", lambda: next(clock))
    stats.last_time = 100.0
    next(clock)
    # An interval of 2 s: a step with 300 prompt tokens (its request's first token) and 1 generated,
    # then 9 steps of 4 generated tokens.
    engine.step_tokens.observe(301)
    for _ in range(9):
        engine.step_tokens.observe(4)
    engine.generation_tokens.inc(37)
    engine.num_requests_running.set(4)
    engine.kv_usage.set(0.25)
    engine.prefix_queries.inc(400)
    engine.prefix_hits.inc(100)
    with caplog.at_level(logging.INFO, logger="mini_engine.server"):
        stats.log()
        engine.num_requests_running.set(0)
        stats.log()         # nothing happened: the line that says so
        stats.log()         # still nothing: no line
    lines = [LINE.search(r.getMessage()) for r in caplog.records]
    assert len(lines) == 2 and all(lines)
    assert [float(x) for x in lines[0].groups()] == [150.0, 18.5, 4, 0, 25.0, 25.0]
    assert [float(x) for x in lines[1].groups()[:4]] == [0, 0, 0, 0]


def test_the_interval_and_the_flags(monkeypatch):
    assert log_stats_interval() == 10
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "0.5")
    assert log_stats_interval() == 0.5
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "never")
    with pytest.raises(ValueError, match="VLLM_LOG_STATS_INTERVAL"):
        log_stats_interval()
    options = serving_options(parse_args(["--disable-log-stats", "--enable-log-requests", "--max-log-len", "3"]))
    assert options.disable_log_stats and options.enable_log_requests and options.max_log_len == 3
    assert not serving_options(parse_args([])).disable_log_stats


def test_a_bad_interval_stops_the_server_before_the_model_loads(monkeypatch):
    from mini_engine.serve import build_served_app
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "never")
    with pytest.raises(ValueError, match="VLLM_LOG_STATS_INTERVAL"):
        build_served_app(parse_args(["--model", "/nonexistent"]))


def test_a_server_logs_its_requests_and_its_stats(tiny_model, tmp_path):
    with launched_server(tiny_model, tmp_path, options=("--log-level", "info", "--enable-log-requests",
                                                        "--max-log-len", "3"),
                         env={"VLLM_LOG_STATS_INTERVAL": "0.2"}) as server:
        r = httpx.post(server.base_url + "/v1/completions", timeout=60, json={
            "model": MODEL_NAME, "prompt": [7, 8, 9, 10, 11], "max_tokens": 8, "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200
        server.wait_idle()
        time.sleep(1.0)
        log = server.log_path.read_text()
        time.sleep(0.6)
        assert server.log_path.read_text().count("Avg prompt throughput") == log.count("Avg prompt throughput")
    assert re.search(r"Received request cmpl-\S+: params: SamplingParams\(.*max_tokens=8.*\), "
                     r"prompt_token_ids: \[7, 8, 9\] \.\.\.", log)
    lines = [LINE.search(line) for line in log.splitlines() if "Avg prompt throughput" in line]
    assert lines and all(lines)
    assert sum(float(m.group(2)) for m in lines) > 0        # the 8 tokens, at some rate
    assert float(lines[-1].group(3)) == 0 and float(lines[-1].group(2)) == 0      # the line after the work
