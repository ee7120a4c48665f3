from benchmarks.step_boundary import boundaries


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
