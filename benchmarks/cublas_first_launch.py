"""Does a cuBLAS product at a new shape stop the host? Queues ~100 ms of device work
(torch.cuda._sleep), then times one product on the host: a first launch of a kernel that cuBLAS
has not loaded yet returns only once the queue has drained (host ~101 ms), a launch of a loaded
kernel returns at once (host ~0.2 ms). The row counts are those of the benchmark's prefill steps:
lm_head at the rows a step samples, the QKV projection at a step's tokens.

    python benchmarks/cublas_first_launch.py
"""
import sys
import time

import torch


def host_ms_behind_queue(fn) -> tuple[float, float]:
    """(host ms inside fn, ms the queued work took to drain after fn returned)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)          # ~100 ms of device time on the H200
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3


def main():
    if not torch.cuda.is_available():
        sys.exit("cublas_first_launch.py needs CUDA")
    lm_head = torch.randn(151936, 1024, device="cuda", dtype=torch.bfloat16)
    qkv = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    cases = [("lm_head", lm_head, m) for m in (32, 62, 91, 118, 119, 147, 148, 178, 209, 237, 119, 148, 256, 128)]
    cases += [("qkv", qkv, m) for m in (16384, 12823, 12823, 12000, 8000)]
    for name, weight, rows in cases:
        x = torch.randn(rows, weight.shape[1], device="cuda", dtype=torch.bfloat16)
        host, drain = host_ms_behind_queue(lambda: torch.nn.functional.linear(x, weight))
        print(f"{name:8s} rows {rows:6d}: host {host:7.2f} ms, queue drained {drain:6.2f} ms after")


if __name__ == "__main__":
    main()
