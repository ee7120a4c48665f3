import pytest

from benchmarks.step_boundary import boundaries, graph_gaps


def _kernel(name, ts, dur):
    return {"name": name, "cat": "kernel", "ts": ts, "dur": dur}


def test_boundaries_time_the_gap_between_decode_graphs_and_the_copies_in_it():
    """Two decode graphs (sampler's last kernel, then the next graph's first) with an input copy and
    a token copy between them; then a graph followed by an eager step, which is no boundary."""
    events = [
        _kernel("_take_prev_tokens_kernel", 0, 2), _kernel("_select_kernel", 100, 5),
        {"name": "Memcpy DtoH (Device -> Pinned)", "cat": "gpu_memcpy", "ts": 107, "dur": 1.5},
        {"name": "Memcpy HtoD (Pinned -> Device)", "cat": "gpu_memcpy", "ts": 110, "dur": 4},
        _kernel("_take_prev_tokens_kernel", 125, 2), _kernel("embedding_kernel", 128, 1),
        _kernel("_select_kernel", 200, 5), _kernel("embedding_kernel", 230, 3),
    ]
    rows = boundaries(list(reversed(events)))          # the trace's order does not matter
    assert rows == [{"idle": 20, "to_forward": 23, "d2h_start": 2, "d2h": 1.5, "h2d_start": 5, "h2d": 4}]


def test_graph_gaps_are_the_gaps_between_one_graphs_kernels():
    """A graph's kernels from its first (_take_prev_tokens_kernel) to its last (_select_kernel);
    the boundary after it, and a graph cut off by the trace's end, are not counted."""
    events = [
        _kernel("_take_prev_tokens_kernel", 0, 2), _kernel("gemm", 2.5, 10), _kernel("_select_kernel", 12, 5),
        _kernel("_take_prev_tokens_kernel", 40, 2), _kernel("gemm", 41.9, 10), _kernel("_select_kernel", 52, 5),
        _kernel("_take_prev_tokens_kernel", 80, 2), _kernel("gemm", 83, 10),
    ]
    gaps = graph_gaps(list(reversed(events)))
    assert len(gaps) == 2 and gaps[0] == [0.5, -0.5] and gaps[1] == pytest.approx([-0.1, 0.1])
