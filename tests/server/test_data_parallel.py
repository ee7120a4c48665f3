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

from mini_engine import LLM, SamplingParams, serve
from mini_engine.server.data_parallel import DataParallelEngines, engine_devices
from mini_engine.server.engine_process import spawn_environment
from tests.server.conftest import MODEL_NAME, NUM_KV_BLOCKS, engine_processes, launched_server

PROMPTS = [[5, 6, 7, i] for i in range(3, 11)]


@pytest.fixture(scope="module")
def cpu_llm(tiny_model):
    """The offline engine where the data-parallel server's engines run (the CPU, on any machine)."""
    return LLM(tiny_model, device="cpu", num_kv_blocks=NUM_KV_BLOCKS)


@pytest.fixture(scope="module")
def dp_server(tiny_model, tmp_path_factory):
    with launched_server(tiny_model, tmp_path_factory.mktemp("dp-server-log"), options=("--data-parallel-size", "2", "--device", "cpu"),
                         env={"VLLM_SERVER_DEV_MODE": "1"}) as handle:
        yield handle


def per_engine(server, name: str) -> dict[str, float]:
    """A metric's value for each engine, summed over its other labels."""
    values: dict[str, float] = {}
    for line in httpx.get(server.base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f"mini_engine:{name}{{"):
            engine = line.split('engine="')[1].split('"')[0]
            values[engine] = values.get(engine, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


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
    assert {engine: after[engine] - before.get(engine, 0.0) for engine in after} == {"0": 96.0, "1": 96.0}
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


def test_calls_between_steps_reach_every_engine(dp_server):
    assert httpx.post(dp_server.base_url + "/reset_prefix_cache", timeout=30).json() == {"reset": True}
    assert httpx.get(dp_server.base_url + "/is_sleeping", timeout=30).json() == {"is_sleeping": False}


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


def test_a_request_goes_to_the_engine_with_fewest_in_flight_ties_in_turn():
    engines = DataParallelEngines.__new__(DataParallelEngines)
    engines.engines = [types.SimpleNamespace(streams={}, name=i, is_alive=True) for i in range(3)]
    engines.turns = iter(range(100))
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
