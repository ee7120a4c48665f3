"""The server under --data-parallel-size on a machine of several GPUs: each engine on a GPU of its
own, and greedy outputs as one engine gives them.

`python benchmarks/data_parallel_check.py --data-parallel-size 2` launches the server (bench.py's
checkpoint) with one engine, then with N, and sends each the workload's first --num-seqs prompts
one at a time, greedily: a request alone in its engine is the same computation on either, so the
tokens must be equal. With N engines it also reads each GPU's memory in use (nvidia-smi), which
must have grown on N GPUs, and each engine's finished requests from /metrics, which must be
shared. Prints PASS or FAIL lines; exits 1 on a failure."""
import argparse
import os
import subprocess
import sys
import types

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import make_workload  # noqa: E402
from bench_serving import launch_server, metric_per_engine, wait_healthy  # noqa: E402


def gpu_memory_used_mib() -> list[int]:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return [int(line) for line in out.split()]


def served_tokens(model: str, data_parallel_size: int, prompts, max_tokens: int, port: int):
    opts = types.SimpleNamespace(host="127.0.0.1", port=port, max_num_seqs=256,
                                 server_args=f"--data-parallel-size {data_parallel_size}")
    idle = gpu_memory_used_mib()
    process, log_path = launch_server(opts, model)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url, process, log_path)
        grown = [after - before for before, after in zip(idle, gpu_memory_used_mib())]
        tokens = []
        for prompt in prompts:
            answer = httpx.post(base_url + "/v1/completions", timeout=120, json={
                "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": 0,
                "return_tokens_as_token_ids": True})
            answer.raise_for_status()
            tokens.append([int(t.split(":")[1]) for t in answer.json()["choices"][0]["logprobs"]["tokens"]])
        return tokens, grown, metric_per_engine(base_url, "request_success_total")
    finally:
        process.terminate()
        process.wait(timeout=60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-parallel-size", type=int, default=2)
    parser.add_argument("--num-seqs", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    from mini_engine.model.random_checkpoint import default_checkpoint
    model = default_checkpoint(device="cuda")
    prompts = make_workload(args.num_seqs)[0]
    one, grown_one, _ = served_tokens(model, 1, prompts, args.max_tokens, args.port)
    many, grown_many, per_engine = served_tokens(model, args.data_parallel_size, prompts, args.max_tokens, args.port)
    print(f"GPU memory grown by the server (MiB), 1 engine: {grown_one}; {args.data_parallel_size} engines: {grown_many}")
    print(f"requests finished by each engine: {per_engine}")
    failures = []
    if one != many:
        differ = [i for i, (a, b) in enumerate(zip(one, many)) if a != b]
        failures.append(f"greedy outputs differ for requests {differ}")
    if sum(grown > 1024 for grown in grown_many) != args.data_parallel_size:
        failures.append(f"expected {args.data_parallel_size} GPUs in use, memory grew on {grown_many}")
    if sorted(per_engine.values()) != [args.num_seqs / args.data_parallel_size] * args.data_parallel_size:
        failures.append(f"requests not shared evenly: {per_engine}")
    for failure in failures:
        print("FAIL:", failure)
    if not failures:
        print(f"PASS: {args.num_seqs} greedy requests of {args.max_tokens} tokens equal with 1 and "
              f"{args.data_parallel_size} engines, each engine on its own GPU, requests shared evenly")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
