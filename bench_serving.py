"""The online benchmark: bench.py's workload (nano-vllm's 256 random-token requests), sent to a
running OpenAI-compatible server by concurrent streaming clients, all at once or as a Poisson
stream at --request-rate. Reports throughput, time to first token (TTFT) and time per output
token (TPOT, per request: (last token - first token) / (output tokens - 1)), mean, p50 and p99,
and appends one JSON line to benchmarks/results.jsonl.

    python -m mini_engine.serve --model ~/models/Qwen3-0.6B --max-model-len 2048 &
    python bench_serving.py --port 8000 --request-rate 8
    python bench_serving.py --launch --model ~/models/Qwen3-0.6B --request-rate inf

--launch starts the server itself on this machine (same engine options as bench.py's defaults,
plus --server-args), waits for /health, runs, and stops it. Without a GPU the default workload is
bench.py's CPU smoke workload on its tiny random model.

--clients N sends the requests from N processes (4 by default for the full workload): one Python
process reading 256 streams' events used 93% of a core and held the saturated run at 5.08 s where
four took 4.79-4.82 s (benchmarks/NOTES.md, entry 66). The report gives the load generator's CPU
time, so that a run it limits says so.
"""
import argparse
import asyncio
import json
import math
import multiprocessing
import os
import queue
import random
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone

import httpx

from bench import MAX_MODEL_LEN, REPO, WORKLOADS, git_commit, make_workload, tiny_checkpoint


@dataclass
class RequestResult:
    ok: bool
    num_prompt_tokens: int
    max_tokens: int
    num_output_tokens: int = 0
    ttft: float = 0.0               # seconds from sending to the first token
    latency: float = 0.0            # seconds from sending to the last token
    error: str = ""
    client: int = 0                 # the load-generator process that sent it (--clients)

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.num_output_tokens - 1) if self.num_output_tokens > 1 else None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", help="--launch: the checkpoint to serve (default: bench.py's); otherwise the "
                                   "model name to ask for (default: the server's first model)")
    p.add_argument("--launch", action="store_true", help="start the server in a subprocess, run, stop it")
    p.add_argument("--server-args", default="", help='--launch: extra serve options, e.g. "--enforce-eager"')
    p.add_argument("--max-num-seqs", type=int, default=256, help="--launch: the engine's batch limit")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson arrivals "
                   "(inf: all at once)")
    p.add_argument("--num-seqs", type=int, help="send only the first N requests of the workload")
    p.add_argument("--workload", choices=["auto", "full", "cpu-smoke"], default="auto",
                   help="auto: full on a GPU, cpu-smoke without one")
    p.add_argument("--temperature", type=float, default=0.6, help="nano-vllm's bench samples at 0.6")
    p.add_argument("--seed", type=int, default=0, help="the Poisson arrivals' seed")
    p.add_argument("--clients", type=int, help="load-generator processes, each sending every N-th request (at "
                   "the rate / N); default 4 for the full workload, where one process parsing 256 streams was "
                   "the limit (benchmarks/NOTES.md, entry 66), 1 for the CPU smoke workload")
    p.add_argument("--label", default="", help="free-text note saved in the JSON line")
    p.add_argument("--results", default=os.path.join(REPO, "benchmarks", "results.jsonl"))
    p.add_argument("--cache-dir", help="where bench.py keeps its random checkpoints")
    return p.parse_args(argv)


# ---- the client ----

async def sse_lines(response: httpx.Response):
    """The stream's lines as server-sent events split them: at CR LF, LF or CR alone. (httpx's
    aiter_lines also splits at U+0085, U+2028 and the other line breaks of str.splitlines, which a
    JSON string may hold unescaped, as this server's and vLLM's chunks do: it cut a chunk of
    generated text in two.)"""
    rest = b""
    async for data in response.aiter_bytes():
        *lines, rest = re.split(rb"\r\n|\r|\n", rest + data)
        for line in lines:
            yield line.decode()
    if rest:
        yield rest.decode()


async def send(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int,
               temperature: float) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult(False, len(prompt), max_tokens)
    start = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return result
            async for line in sse_lines(r):
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error")
                    return result
                if chunk["choices"]:
                    now = time.perf_counter()
                    if not result.ttft:
                        result.ttft = now - start
                    result.latency = now - start
                if chunk.get("usage"):
                    result.num_output_tokens = chunk["usage"]["completion_tokens"]
        result.ok = result.num_output_tokens > 0
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_workload(base_url: str, model: str, prompts, max_tokens, rate: float, temperature: float,
                       seed: int, warm_up: bool = True, wait_first: bool = False
                       ) -> tuple[list[RequestResult], float, float, float]:
    """The requests' results in order; the time (perf_counter: on Linux one clock for every process) of
    the first send and of the last reply; and this process's CPU seconds in between. wait_first:
    a Poisson gap before the first request too (every load generator but the first)."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=httpx.Timeout(None, connect=30)) as client:
        if warm_up:
            await asyncio.gather(*(send(client, model, [1, 2, 3, 4] * 8, 8, temperature) for _ in range(4)))
        if wait_first and rate != math.inf:
            await asyncio.sleep(rng.expovariate(rate))
        tasks = []
        start, cpu = time.perf_counter(), time.process_time()
        for prompt, n in zip(prompts, max_tokens):
            tasks.append(asyncio.create_task(send(client, model, prompt, n, temperature)))
            if rate != math.inf:
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, start, time.perf_counter(), time.process_time() - cpu


def client_main(index: int, clients: int, base_url: str, model: str, prompts, max_tokens, rate: float,
                temperature: float, seed: int, barrier, out) -> None:
    """One of --clients load generators: every clients-th request from index, at rate / clients (the
    clients' Poisson streams add up to one at rate), sent once every client is ready."""
    barrier.wait(timeout=300)
    results, start, end, cpu = asyncio.run(run_workload(
        base_url, model, prompts[index::clients], max_tokens[index::clients], rate / clients, temperature,
        seed + index, warm_up=False, wait_first=index > 0))
    for result in results:
        result.client = index
    out.put((index, results, start, end, cpu))


def run_clients(base_url: str, model: str, prompts, max_tokens, rate: float, temperature: float, seed: int,
                clients: int) -> tuple[list[RequestResult], float, float]:
    """The requests' results in order, the wall seconds from the first send to the last reply, and
    the load generators' CPU seconds, the requests sent by `clients` processes: one Python process
    parsing every stream's events can be the run's limit (benchmarks/NOTES.md, entry 66)."""
    if clients == 1:
        results, start, end, cpu = asyncio.run(run_workload(base_url, model, prompts, max_tokens, rate, temperature,
                                                            seed))
        return results, end - start, cpu
    asyncio.run(run_workload(base_url, model, [], [], rate, temperature, seed))        # the warm-up alone
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(clients), ctx.Queue()
    processes = [ctx.Process(target=client_main, args=(i, clients, base_url, model, prompts, max_tokens, rate,
                                                       temperature, seed, barrier, out), daemon=True)
                 for i in range(clients)]
    for process in processes:
        process.start()
    parts = []
    try:
        while len(parts) < clients:
            try:
                parts.append(out.get(timeout=1.0))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in processes):
                    raise RuntimeError("a load-generator process failed (its traceback is above)") from None
    finally:
        for process in processes:
            if len(parts) < clients:
                process.kill()
            process.join()
    results: list[RequestResult] = [None] * len(prompts)
    for index, part, _, _, _ in parts:
        results[index::clients] = part
    wall = max(end for *_, end, _ in parts) - min(start for _, _, start, _, _ in parts)
    return results, wall, sum(cpu for *_, cpu in parts)


# ---- the server ----

def launch_server(opts, model: str) -> tuple[subprocess.Popen, str]:
    log = tempfile.NamedTemporaryFile("w", prefix="mini_engine-serve-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "mini_engine.serve", "--model", model, "--host", opts.host, "--port",
           str(opts.port), "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(opts.max_num_seqs),
           "--log-level", "warning", *shlex.split(opts.server_args)]
    print("launching:", shlex.join(cmd), f"(log: {log.name})", flush=True)
    return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT), log.name


def wait_healthy(base_url: str, process: subprocess.Popen | None, log_path: str | None, timeout: float = 900):
    deadline = time.monotonic() + timeout
    while True:
        if process is not None and process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}; its log:\n{open(log_path).read()[-4000:]}")
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"the server at {base_url} was not healthy after {timeout:.0f} s")
        time.sleep(0.5)


def metric_per_engine(base_url: str, name: str) -> dict[str, float]:
    """A metric's value for each of the server's engines (its `engine` label; several with
    --data-parallel-size), summed over its other labels."""
    values: dict[str, float] = {}
    for line in httpx.get(base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f"mini_engine:{name}{{"):
            engine = line.split('engine="')[1].split('"')[0]
            values[engine] = values.get(engine, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def server_metric(base_url: str, name: str) -> float | None:
    """A metric's value summed over the server's engines."""
    values = metric_per_engine(base_url, name)
    return sum(values.values()) if values else None


def kv_blocks_used_when_idle(base_url: str, timeout: float = 10) -> float | None:
    """The engine process sends its gauges just after the last tokens: poll a moment."""
    deadline = time.monotonic() + timeout
    while (used := server_metric(base_url, "kv_cache_blocks_used")) and time.monotonic() < deadline:
        time.sleep(0.1)
    return used


# ---- the report ----

def stats(values: list[float], scale: float = 1.0) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    v = sorted(x * scale for x in values)

    def pct(q):         # linear interpolation, as numpy's default
        i = (len(v) - 1) * q
        lo, hi = math.floor(i), math.ceil(i)
        return v[lo] + (v[hi] - v[lo]) * (i - lo)
    return {"mean": sum(v) / len(v), "p50": pct(0.5), "p99": pct(0.99)}


def device_info() -> tuple[str, str | None]:
    try:
        import torch
    except ImportError:
        return "unknown", None
    return (torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"), torch.__version__


def main(argv=None) -> int:
    opts = parse_args(argv)
    base_url = f"http://{opts.host}:{opts.port}"
    device, torch_version = device_info()
    workload = opts.workload if opts.workload != "auto" else ("cpu-smoke" if device == "cpu" else "full")
    prompts, max_tokens = make_workload(opts.num_seqs, **WORKLOADS[workload])
    if opts.clients is None:
        opts.clients = 4 if workload == "full" else 1
    if opts.clients < 1:
        sys.exit(f"--clients must be at least 1, got {opts.clients}")
    opts.clients = min(opts.clients, max(1, len(prompts)))      # none idle
    input_tokens, output_tokens = sum(map(len, prompts)), sum(max_tokens)

    process = log_path = None
    model = opts.model
    if opts.launch:
        if model is None:
            if workload == "cpu-smoke":
                model = tiny_checkpoint(opts.cache_dir)
            else:
                from mini_engine.model.random_checkpoint import default_checkpoint
                model = default_checkpoint(opts.cache_dir, device="cuda" if device != "cpu" else "cpu")
        process, log_path = launch_server(opts, os.path.expanduser(model))
    try:
        wait_healthy(base_url, process, log_path)
        served = httpx.get(base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
        name = served if opts.launch or opts.model is None else opts.model
        rate = "inf" if opts.request_rate == math.inf else f"{opts.request_rate:g}/s"
        print(f"{workload} workload: {len(prompts)} requests, {input_tokens:,} input and {output_tokens:,} "
              f"output tokens, request rate {rate}, to {base_url} ({name})", flush=True)
        results, wall, client_cpu = run_clients(base_url, name, prompts, max_tokens, opts.request_rate,
                                                opts.temperature, opts.seed, opts.clients)
        kv_blocks_used = kv_blocks_used_when_idle(base_url)
    finally:
        if process is not None:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()

    ok = [r for r in results if r.ok]
    generated = sum(r.num_output_tokens for r in ok)
    ttft, tpot, e2e = stats([r.ttft for r in ok], 1e3), stats([r.tpot for r in ok if r.tpot], 1e3), \
        stats([r.latency for r in ok])
    exact = len(ok) == len(results) and all(r.num_output_tokens == r.max_tokens for r in results)
    commit, dirty = git_commit()
    record = {
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"), "engine": "mini-serve",
        "label": opts.label, "workload": workload, "cpu_smoke": workload == "cpu-smoke",
        "git_commit": commit, "git_dirty": dirty, "device": device, "torch": torch_version,
        "model": model or name, "num_seqs": len(prompts), "request_rate": opts.request_rate
        if opts.request_rate != math.inf else "inf", "input_tokens": input_tokens, "output_tokens": generated,
        "wall_s": wall, "output_tok_s": generated / wall, "total_tok_s": (input_tokens + generated) / wall,
        "request_s": len(ok) / wall, "ttft_ms": ttft, "tpot_ms": tpot, "e2e_s": e2e,
        "client_cpu_s": client_cpu,
        "checks": {"exact_max_tokens": exact, "failed_requests": len(results) - len(ok),
                   "kv_blocks_free": kv_blocks_used == 0 if kv_blocks_used is not None else None},
        "config": {k: v for k, v in vars(opts).items() if k not in ("results", "cache_dir")}
        | {"request_rate": rate, "launched": opts.launch},
    }
    os.makedirs(os.path.dirname(os.path.abspath(opts.results)), exist_ok=True)
    with open(opts.results, "a") as f:
        f.write(json.dumps(record, default=str) + "\n")

    print(f"\n{'':<22}{'mean':>10}{'p50':>10}{'p99':>10}")
    for label, s in (("TTFT (ms)", ttft), ("TPOT (ms)", tpot), ("E2E latency (s)", e2e)):
        print(f"{label:<22}" + "".join(f"{s[k]:>10.2f}" if s[k] is not None else f"{'-':>10}"
                                      for k in ("mean", "p50", "p99")))
    print(f"{'requests':<22}{len(ok):>10} ok, {len(results) - len(ok)} failed, {record['request_s']:.2f} req/s")
    print(f"{'throughput':<22}{record['output_tok_s']:>10,.0f} output tok/s, {record['total_tok_s']:,.0f} total tok/s,"
          f" wall {wall:.2f} s")
    busy = client_cpu / (wall * opts.clients)
    print(f"{'load generator':<22}{client_cpu:>10.2f} CPU s in the run, {busy:.0%} of its {opts.clients} "
          f"process{'es' if opts.clients > 1 else ''}" + (": it may be the limit, try more --clients" if busy > 0.8 else ""))
    print(f"logged to {opts.results}" + (" (CPU smoke workload: not the benchmark)" if record["cpu_smoke"] else ""))
    failures = [r.error for r in results if not r.ok]
    if failures:
        print(f"FAILED: {len(failures)} requests, first: {failures[0]}", file=sys.stderr)
    if not exact and not failures:
        print("FAILED: some requests did not get exactly their max_tokens", file=sys.stderr)
    if kv_blocks_used:
        print(f"FAILED: {kv_blocks_used:.0f} KV blocks still in use after the run", file=sys.stderr)
    return 0 if exact and not kv_blocks_used else 1


if __name__ == "__main__":
    sys.exit(main())
