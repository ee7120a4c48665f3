"""`python -m mini_engine.serve --data-parallel-size 2` (vLLM's -dp): two engine processes behind
one server. Greedy outputs are the offline engine's whichever engine runs them; requests spread
evenly; /metrics has a series per engine; calls reach every engine; an engine that dies makes the
server unhealthy rather than half-served. The GPU mapping and the routing, on their own."""
import asyncio
import contextlib
import os
import signal
import time
import types

import httpx
import pytest
import torch

from bench_serving import metric_per_engine
from mini_engine import LLM, SamplingParams, serve
from mini_engine.server.data_parallel import AFFINITY_SLACK, DataParallelEngines, PrefixAffinity, engine_devices
from mini_engine.server.engine_process import spawn_environment
from tests.server.conftest import MODEL_NAME, NUM_KV_BLOCKS, engine_processes, launched_server

PROMPTS = [[5, 6, 7, i] for i in range(3, 11)]


@pytest.fixture(scope="module")
def cpu_llm(tiny_model):
    """The offline engine where the data-parallel server's engines run (the CPU, on any machine)."""
    return LLM(tiny_model, device="cpu", num_kv_blocks=NUM_KV_BLOCKS)


@pytest.fixture(scope="module")
def dp_server(tiny_model, tmp_path_factory):
    traces = tmp_path_factory.mktemp("dp-traces")
    with launched_server(tiny_model, tmp_path_factory.mktemp("dp-server-log"), options=("--data-parallel-size", "2", "--device", "cpu"),
                         env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_TORCH_PROFILER_DIR": str(traces)}) as handle:
        handle.traces = traces
        yield handle


def per_engine(server, name: str) -> dict[str, float]:
    return metric_per_engine(server.base_url, name)


def complete(server, prompt: list[int], max_tokens: int = 12) -> list[int]:
    answer = httpx.post(server.base_url + "/v1/completions", timeout=60, json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0,
        "return_tokens_as_token_ids": True})
    assert answer.status_code == 200, answer.text
    return [int(t.split(":")[1]) for t in answer.json()["choices"][0]["logprobs"]["tokens"]]


def test_greedy_outputs_are_the_offline_engines_and_requests_alternate(dp_server, cpu_llm):
    expected = [out.outputs[0].token_ids for out in
                cpu_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)]
    before = per_engine(dp_server, "request_success_total")
    got = [complete(dp_server, prompt) for prompt in PROMPTS]       # one at a time: each engine idle
    assert got == expected
    after = per_engine(dp_server, "request_success_total")
    served = {engine: after[engine] - before.get(engine, 0.0) for engine in after}
    assert served == {"0": len(PROMPTS) / 2, "1": len(PROMPTS) / 2}, served
    dp_server.check_idle_and_alive()


def test_concurrent_requests_spread_over_both_engines_and_match(dp_server, cpu_llm):
    expected = [out.outputs[0].token_ids for out in
                cpu_llm.generate(PROMPTS * 2, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)]
    before = per_engine(dp_server, "generation_tokens_total")

    async def all_at_once():
        async with httpx.AsyncClient(timeout=60) as client:
            answers = await asyncio.gather(*(client.post(dp_server.base_url + "/v1/completions", json={
                "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 0,
                "return_tokens_as_token_ids": True}) for prompt in PROMPTS * 2))
        return [[int(t.split(":")[1]) for t in a.json()["choices"][0]["logprobs"]["tokens"]] for a in answers]

    assert asyncio.run(all_at_once()) == expected
    after = per_engine(dp_server, "generation_tokens_total")
    generated = {engine: after[engine] - before.get(engine, 0.0) for engine in after}
    # Even (96 each) unless a request ends before the last arrives, which then finds its engine idler.
    assert sum(generated.values()) == 16 * 12 and min(generated.values()) >= 4 * 12, generated
    assert per_engine(dp_server, "kv_cache_blocks_total") == {"0": 1024.0, "1": 1024.0}
    dp_server.check_idle_and_alive()


def test_streams_left_early_free_their_engines_blocks(dp_server):
    with httpx.Client(base_url=dp_server.base_url, timeout=60) as client, contextlib.ExitStack() as streams:
        for i in range(8):
            stream = streams.enter_context(client.stream("POST", "/v1/completions", json={
                "prompt": [5, 6, i], "max_tokens": 480, "ignore_eos": True, "stream": True}))
            assert next(stream.iter_lines()).startswith("data: ")
    dp_server.check_idle_and_alive()


def test_an_abort_goes_to_the_engine_that_runs_the_request():
    engines = DataParallelEngines.__new__(DataParallelEngines)
    aborted = []
    engines.engines = [types.SimpleNamespace(streams={f"r{i}": None}, abort=lambda rid, i=i: aborted.append((i, rid)))
                       for i in range(3)]
    engines.abort("r1")
    engines.abort("gone")       # finished already: nothing to abort
    assert aborted == [(1, "r1")]


def test_a_pause_holds_every_engine_until_resume(dp_server, cpu_llm):
    """vLLM's /pause and /resume reach both engines: requests sent while paused wait, whichever
    engine they go to, and then give the offline engine's tokens."""
    import concurrent.futures
    url = dp_server.base_url
    assert httpx.post(url + "/pause", params={"mode": "wait"}, timeout=30).json() == {"is_paused": True}
    assert httpx.get(url + "/is_paused", timeout=30).json() == {"is_paused": True}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(complete, dp_server, prompt, 4) for prompt in PROMPTS[:2]]
        done, _ = concurrent.futures.wait(waiting, timeout=0.5)
        assert not done, "a request ran while paused"
        assert httpx.post(url + "/resume", timeout=30).json() == {"is_paused": False}
        got = [future.result(timeout=60) for future in waiting]
    expected = [out.outputs[0].token_ids for out in
                cpu_llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)]
    assert got == expected and httpx.get(url + "/is_paused", timeout=30).json() == {"is_paused": False}


def test_calls_between_steps_reach_every_engine(dp_server):
    assert httpx.post(dp_server.base_url + "/reset_prefix_cache", timeout=30).json() == {"reset": True}
    assert httpx.get(dp_server.base_url + "/is_sleeping", timeout=30).json() == {"is_sleeping": False}
    assert httpx.post(dp_server.base_url + "/start_profile", timeout=30).json() == {"profiling": True}
    complete(dp_server, [5, 6, 7], max_tokens=2)
    stopped = httpx.post(dp_server.base_url + "/stop_profile", timeout=120).json()
    assert stopped["trace"] == stopped["traces"][0] and len(set(stopped["traces"])) == 2     # one an engine
    assert all(os.path.isfile(path) and os.path.dirname(path) == str(dp_server.traces) for path in stopped["traces"])


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the engine processes through /proc")
def test_an_engine_that_dies_makes_the_server_unhealthy(tiny_model, tmp_path):
    with launched_server(tiny_model, tmp_path, options=("--data-parallel-size", "2", "--device", "cpu")) as server:
        engines = engine_processes(server.process.pid)
        assert len(engines) == 2
        os.kill(engines[1], signal.SIGKILL)
        for _ in range(100):
            if httpx.get(server.base_url + "/health", timeout=10).status_code == 503:
                break
            time.sleep(0.1)
        assert httpx.get(server.base_url + "/health", timeout=10).status_code == 503
        answer = httpx.post(server.base_url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 4}, timeout=30)
        assert answer.status_code >= 500 and "not running" in answer.json()["error"]["message"]
        assert server.process.poll() is None


# ---- the parts on their own ----

def test_each_engine_sees_gpus_of_its_own(monkeypatch):
    monkeypatch.setattr("torch.cuda.device_count", lambda: 8)

    def config(device=None, tensor_parallel_size=1):
        return types.SimpleNamespace(device=device, tensor_parallel_size=tensor_parallel_size,
                                     resolved_device=lambda: types.SimpleNamespace(type="cuda"))

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert engine_devices(config(), 2) == ["0", "1"]
    assert engine_devices(config(tensor_parallel_size=2), 4) == ["0,1", "2,3", "4,5", "6,7"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert engine_devices(config(tensor_parallel_size=2), 2) == ["4,5", "6,7"]
    with pytest.raises(ValueError, match="needs 6 GPUs; this process sees 4"):
        engine_devices(config(tensor_parallel_size=2), 3)
    with pytest.raises(ValueError, match="give device 'cuda'"):
        engine_devices(config(device="cuda:1"), 2)
    cpu = types.SimpleNamespace(device="cpu", tensor_parallel_size=1,
                                resolved_device=lambda: types.SimpleNamespace(type="cpu"))
    assert engine_devices(cpu, 3) == [None, None, None]


def test_a_spawned_process_gets_its_devices_and_this_ones_environment_is_restored(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with spawn_environment({"CUDA_VISIBLE_DEVICES": "1"}):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with spawn_environment({"CUDA_VISIBLE_DEVICES": "1"}):
        pass
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def fake_engines(n: int, block_size: int = 4, capacity: int = 1000) -> DataParallelEngines:
    """DataParallelEngines over stand-ins that hold only what routing reads."""
    engines = DataParallelEngines.__new__(DataParallelEngines)
    engines.engines = [types.SimpleNamespace(streams={}, name=i, is_alive=True) for i in range(n)]
    engines.turns = iter(range(1000))
    engines.affinity = PrefixAffinity(n, block_size, capacity)
    return engines


def busy(engine, n: int) -> None:
    engine.streams = {f"{engine.name}-{i}": None for i in range(n)}


def test_a_request_goes_to_the_engine_with_fewest_in_flight_ties_in_turn():
    engines = fake_engines(3)
    assert [engines.next_engine().name for _ in range(4)] == [0, 1, 2, 0]
    engines.engines[0].streams = {"a": None, "b": None}
    engines.engines[2].streams = {"c": None}
    assert [engines.next_engine().name for _ in range(3)] == [1, 1, 1]
    engines.engines[2].is_alive = False
    with pytest.raises(RuntimeError, match="not running"):
        engines.next_engine()


def test_data_parallel_size_below_one_is_refused(capsys):
    with pytest.raises(SystemExit):
        serve.parse_args(["--data-parallel-size", "0"])
    assert "--data-parallel-size must be at least 1" in capsys.readouterr().err


def test_a_prompt_follows_its_start_to_the_engine_that_ran_it_unless_that_engine_is_far_busier():
    engines = fake_engines(2)
    conversation = list(range(100, 112))                  # three blocks of 4
    assert engines.next_engine(conversation).name == 0
    busy(engines.engines[0], AFFINITY_SLACK)              # as busy as it may be and still be chosen
    next_turn = conversation + [7, 8, 9, 10, 11]
    assert engines.next_engine(next_turn).name == 0
    assert engines.next_engine(list(range(500, 512))).name == 1       # a new prompt: the least loaded
    busy(engines.engines[0], AFFINITY_SLACK + 1)
    assert engines.next_engine(next_turn).name == 1      # too busy: the prefix goes elsewhere
    busy(engines.engines[0], 0)
    busy(engines.engines[1], 2)
    assert engines.next_engine(conversation + [1, 2]).name == 0      # both ran its blocks: the less loaded
    assert engines.next_engine(list(range(500, 512)) + [3]).name == 1     # only engine 1 ran its start


def test_prefix_affinity_chains_whole_blocks_and_forgets_the_oldest():
    affinity = PrefixAffinity(1, block_size=2, capacity=3)
    chain = affinity.chain([1, 2, 3, 4, 5])
    assert len(chain) == 2                                 # the partial block is not a prefix-cache block
    assert affinity.chain([3, 4])[0] != chain[1]           # a block is its content and everything before it
    affinity.record(0, chain)
    assert affinity.matched_blocks(0, chain) == 2 and affinity.matched_blocks(0, affinity.chain([1, 2, 9, 9])) == 1
    affinity.record(0, affinity.chain([7, 7, 8, 8]))
    assert affinity.matched_blocks(0, chain) == 0          # [1, 2] was the oldest of four: forgotten
    assert affinity.chain([1]) == [] and affinity.matched_blocks(0, []) == 0


def test_a_refused_sleep_leaves_every_engine_awake():
    """One engine refuses (a request still running): those that slept are woken, and the error is raised."""
    woken = []

    def engine(i: int, refuses: bool):
        state = types.SimpleNamespace(asleep=False)

        async def sleep(level):
            if refuses:
                raise RuntimeError("sleep while 1 requests are unfinished")
            state.asleep = True

        async def wake_up(tags):
            woken.append((i, tags))
            state.asleep = False

        state.sleep, state.wake_up = sleep, wake_up
        return state

    engines = DataParallelEngines.__new__(DataParallelEngines)
    engines.engines = [engine(0, refuses=False), engine(1, refuses=True), engine(2, refuses=False)]
    with pytest.raises(RuntimeError, match="unfinished"):
        asyncio.run(engines.sleep(1))
    assert woken == [(0, None), (2, None)] and not engines.asleep
    engines.engines[1] = engine(1, refuses=False)
    asyncio.run(engines.sleep(1))
    assert engines.asleep and all(e.asleep for e in engines.engines)


def test_a_conversations_next_turn_goes_where_its_start_is_cached(dp_server):
    """Served: a 64-token prompt, then a request on each engine, then the prompt grown: it goes back
    to the first engine, whose prefix cache serves its first four blocks."""
    conversation = list(range(100, 164))
    before = per_engine(dp_server, "request_success_total")
    complete(dp_server, conversation, max_tokens=4)
    first = next(e for e, n in per_engine(dp_server, "request_success_total").items() if n > before.get(e, 0.0))
    for prompt in ([7, 8, 9], [9, 8, 7]):
        complete(dp_server, prompt, max_tokens=4)
    hits_before = per_engine(dp_server, "prefix_cache_hit_rate")
    counts_before = per_engine(dp_server, "request_success_total")
    complete(dp_server, conversation + [11, 12, 13], max_tokens=4)
    counts = per_engine(dp_server, "request_success_total")
    assert {e: counts[e] - counts_before[e] for e in counts} == {first: 1.0, str(1 - int(first)): 0.0}
    assert per_engine(dp_server, "prefix_cache_hit_rate")[first] > hits_before[first]
    dp_server.check_idle_and_alive()


def test_an_engine_that_fails_to_start_cancels_the_others_starts(monkeypatch):
    """Engine 1 fails at once: engine 2, still building, is told to stop instead of being waited
    for, engine 0 (up already) is stopped, and engine 1's error is raised."""
    import threading
    from mini_engine.server import data_parallel
    stopped = []

    class StandInEngine:
        def __init__(self, config, index, lora_requests, visible_devices, cancelled: threading.Event):
            self.index = index
            if index == 1:
                raise RuntimeError("out of GPU memory")
            if index == 2:
                assert cancelled.wait(timeout=60), "the failure did not cancel this start"
                raise RuntimeError("start-up cancelled")

        def shutdown(self):
            stopped.append(self.index)
    monkeypatch.setattr(data_parallel, "AsyncEngine", StandInEngine)
    config = types.SimpleNamespace(resolved_device=lambda: torch.device("cpu"))
    metrics = types.SimpleNamespace(engine=lambda i: i)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="data-parallel engine 1 failed to start: out of GPU memory"):
        DataParallelEngines(config, metrics, (), 3)
    assert time.monotonic() - start < 30 and stopped == [0]
