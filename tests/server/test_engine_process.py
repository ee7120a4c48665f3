"""The engine runs in a process of its own (server/engine_process.py): if it dies, the requests in
flight end with an error, new ones are refused with 503, and /health says so."""
import os
import signal

import httpx

from tests.server.conftest import MODEL_NAME, launched_server


def child_pids(pid: int) -> list[int]:
    kids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids += [int(k) for k in f.read().split()]
    return kids


def engine_pid(server_pid: int) -> int:
    """The spawned engine process (the other child is multiprocessing's resource tracker)."""
    for pid in child_pids(server_pid):
        with open(f"/proc/{pid}/cmdline") as f:
            if "spawn_main" in f.read():
                return pid
    raise AssertionError("no engine process under the server")


def test_a_dead_engine_fails_requests_in_flight_and_refuses_new_ones(tiny_model, tmp_path):
    with launched_server(tiny_model, tmp_path) as server:
        body = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line:
                    continue
                events.append(line)
                if len(events) == 2:                     # tokens are flowing: kill the engine
                    os.kill(engine_pid(server.process.pid), signal.SIGKILL)
        errors = [e for e in events if '"error"' in e]
        assert len(errors) == 1 and "the engine process exited" in errors[0], events[-3:]
        assert events[-1] == "data: [DONE]"
        assert len(events) < 400
        health = httpx.get(server.base_url + "/health", timeout=10)
        assert health.status_code == 503 and "engine process" in health.text
        refused = httpx.post(server.base_url + "/v1/completions", timeout=10,
                             json={"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 2})
        assert refused.status_code == 503 and "engine process" in refused.json()["error"]["message"]
        assert server.process.poll() is None             # the API server itself stays up


def test_the_engine_process_logs_at_the_servers_level(tiny_model, tmp_path):
    """engine_main sets the level it is given (the server's --log-level), not a fixed one; here
    run in this process, on a checkpoint whose weights file is garbage, so it stops after
    reporting that."""
    import logging
    import multiprocessing
    import shutil

    from mini_engine.config import EngineConfig
    from mini_engine.server.engine_process import engine_main

    shutil.copy(os.path.join(tiny_model, "config.json"), tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    root = logging.getLogger()
    before = root.level
    outputs = multiprocessing.Queue()
    try:
        for level in (logging.DEBUG, logging.ERROR):
            engine_main(EngineConfig(str(tmp_path), device="cpu"), multiprocessing.Queue(), outputs, level)
            assert root.level == level
            status, detail = outputs.get(timeout=10)
            assert status == "failed" and "safetensors" in detail
    finally:
        root.setLevel(before)


def test_a_priority_server_takes_each_requests_priority(tiny_model, tmp_path):
    """--scheduling-policy priority (vLLM's), one sequence at a time: behind a long request, an
    urgent one sent after a lax one finishes first; and the completions are LLM.generate's.
    The order is what the client sees, so the short requests take 64 steps each: a reply that one
    busy CPU delays by a few steps (CI's, once) cannot pass the next request's. The long request is
    not preempted (the counter), so it ran first."""
    import threading
    import time

    from mini_engine import LLM, SamplingParams
    from tests.server.conftest import NUM_KV_BLOCKS
    want = LLM(tiny_model, num_kv_blocks=NUM_KV_BLOCKS).generate(
        [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    finished = []

    def complete(name: str, priority: int, max_tokens: int):
        r = httpx.post(server.base_url + "/v1/completions", timeout=120, json={
            "model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "priority": priority})
        assert r.status_code == 200, r.text
        finished.append((name, r.json()["choices"][0]["text"]))

    def wait_until(condition):
        for _ in range(600):
            if condition(server.metrics()):
                return
            time.sleep(0.01)
        raise AssertionError("the server never got there")
    options = ("--scheduling-policy", "priority", "--max-num-seqs", "1")
    with launched_server(tiny_model, tmp_path, options=options) as server:
        threads = [threading.Thread(target=complete, args=args) for args in
                   [("long", 0, 500), ("lax", 7, 64), ("urgent", -3, 64)]]
        threads[0].start()
        wait_until(lambda m: m["mini_engine:num_requests_running"] == 1)
        threads[1].start()
        wait_until(lambda m: m["mini_engine:num_requests_waiting"] == 1)
        threads[2].start()
        wait_until(lambda m: m["mini_engine:num_requests_waiting"] == 2)
        assert server.metrics()["mini_engine:num_requests_running"] == 1, "the long request ended too soon"
        for thread in threads:
            thread.join(120)
        assert server.metrics()["mini_engine:num_preemptions_total"] == 0
    assert [name for name, _ in finished] == ["long", "urgent", "lax"]
    assert {text for name, text in finished if name != "long"} == {want[0].outputs[0].text}


def test_a_tensor_parallel_server_answers_and_its_ranks_end_with_it(tiny_model, tmp_path):
    """`-tp 2` (vLLM's flag): the engine process starts the second rank's process (it may, being no
    daemon), completions are the unsplit engine's, and stopping the server ends both processes."""
    import time

    from mini_engine import LLM, SamplingParams
    from tests.server.conftest import NUM_KV_BLOCKS
    want = LLM(tiny_model, num_kv_blocks=NUM_KV_BLOCKS, block_size=16).generate(
        [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    with launched_server(tiny_model, tmp_path, options=("-tp", "2")) as server:
        engine = engine_pid(server.process.pid)
        ranks = [pid for pid in child_pids(engine) if "spawn_main" in open(f"/proc/{pid}/cmdline").read()]
        assert len(ranks) == 1
        r = httpx.post(server.base_url + "/v1/completions", timeout=60, json={
            "model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want[0].outputs[0].text
    for _ in range(100):
        if not any(os.path.exists(f"/proc/{pid}") for pid in (engine, *ranks)):
            break
        time.sleep(0.1)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in (engine, *ranks)), "a rank outlived the server"


def test_a_cancelled_start_stops_its_engine_process(tiny_model):
    """Data parallelism cancels the other engines' starts when one fails: the wait ends within
    about a second and the half-built engine's process is gone."""
    import threading
    import time

    import pytest

    from mini_engine.config import EngineConfig
    from mini_engine.server.engine_process import start_engine_process
    def engine_children() -> set[int]:
        return {pid for pid in child_pids(os.getpid()) if "spawn_main" in open(f"/proc/{pid}/cmdline").read()}
    before = engine_children()
    cancelled = threading.Event()
    threading.Timer(0.5, cancelled.set).start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="start-up cancelled"):
        start_engine_process(EngineConfig(tiny_model, device="cpu", num_kv_blocks=64), cancelled=cancelled)
    assert time.monotonic() - start < 5
    assert engine_children() <= before
