"""What separates two replays of one CUDA graph, by what the host queues between them.

A synthetic decode-like graph (28 "layers" of four bf16 GEMMs at 256 rows and a few elementwise
kernels, ~256 kernels) is replayed 20 times back to back per mode, the host far ahead (a sleep
kernel first), under torch.profiler. Per mode: the median gap from one replay's last kernel to the
next replay's first, and the median gap between kernels inside a replay. The modes are the ways a
step's copies can sit between two graphs:

    plain         nothing between the replays
    h2d           the step's input copy (pinned -> device) on the graph's stream before each replay
    side_copy     that copy on a copy stream, issued while the previous replay runs, and an event wait
    eager_kernel  a small eager kernel before each replay
    d2h_side      after each replay the tokens' copy to the host on a stream of its own, and the
                  next replay waits for it (the engine before entry 41)
    h2d_d2h_side  both: the engine's step boundary before entry 41

    PYTHONPATH=. python benchmarks/graph_launch_probe.py
"""
import json
import os
import statistics
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

REPLAYS = 20


def build_graph(dev):
    torch.manual_seed(0)
    x = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16)
    layers = [[torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
               for n, k in ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072))] for _ in range(28)]
    static_in = torch.zeros(4096, dtype=torch.int64, device=dev)
    marker = torch.zeros(1, device=dev)

    def forward():
        h = x + static_in[:1].to(x.dtype)
        for wq, wo, wg, wd in layers:
            h = h + (h @ wq.t())[:, :2048] @ wo.t()
            g = h @ wg.t()
            h = h + (torch.nn.functional.silu(g[:, :3072]) * g[:, 3072:]) @ wd.t()
        marker.copy_(h[0, :1].float())

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    return graph, static_in, marker


def main():
    if not torch.cuda.is_available():
        sys.exit("graph_launch_probe.py needs CUDA")
    graph, static_in, marker = build_graph(torch.device("cuda"))
    pinned = [torch.zeros(4096, dtype=torch.int64).pin_memory() for _ in range(2)]
    staging = [torch.zeros_like(static_in) for _ in range(2)]
    copy_stream = torch.cuda.Stream()
    main_stream = torch.cuda.current_stream()

    def tokens_out(i):
        graph.replay()
        copy_stream.wait_stream(main_stream)
        with torch.cuda.stream(copy_stream):
            pinned[i % 2][:1].copy_(static_in[:1], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(copy_stream)
        main_stream.wait_event(copied)

    def side_copy(i):
        with torch.cuda.stream(copy_stream):
            staging[i % 2].copy_(pinned[i % 2], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(copy_stream)
        main_stream.wait_event(copied)
        graph.replay()

    modes = {
        "plain": lambda i: graph.replay(),
        "h2d": lambda i: (static_in.copy_(pinned[i % 2], non_blocking=True), graph.replay()),
        "side_copy": side_copy,
        "eager_kernel": lambda i: (marker.add_(1.0), graph.replay()),
        "d2h_side": tokens_out,
        "h2d_d2h_side": lambda i: (static_in.copy_(pinned[i % 2], non_blocking=True), tokens_out(i)),
    }
    for name, step in modes.items():
        for i in range(5):
            step(i)
        torch.cuda.synchronize()
        torch.cuda._sleep(20_000_000)           # the host gets far ahead of the device
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(REPLAYS):
                step(i)
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                events = json.load(f)["traceEvents"]
        kernels = sorted((e for e in events if e.get("cat") == "kernel" and "dur" in e
                          and "sleep" not in e["name"]), key=lambda e: e["ts"])
        gaps = sorted(b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(kernels, kernels[1:]))
        # The REPLAYS - 1 largest gaps are the boundaries (with eager_kernel, the larger half of each).
        inner, boundary = gaps[:-(REPLAYS - 1)], gaps[-(REPLAYS - 1):]
        span = (kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]) / REPLAYS
        print(f"{name:>14s}: {len(kernels)} kernels, {span:8.1f} us a replay; between replays median "
              f"{statistics.median(boundary):6.2f} us (min {min(boundary):.2f}, max {max(boundary):.2f}); "
              f"inside, median gap {statistics.median(inner):.3f} us, {sum(inner) / REPLAYS:.1f} us a replay")


if __name__ == "__main__":
    main()
