"""bench.py --profile's per-step times: each call's duration goes to the step whose results it
returned, which with async scheduling is the step launched one call earlier."""
from types import SimpleNamespace

import pytest

from benchmarks.step_profile import StepProfiler


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeEngine:
    """Each step() launches a batch of `batches[i]` rows (none once they run out) and takes
    `durations[i]` seconds of the fake clock, as a real call takes the host's work plus the wait
    for the results it returns."""

    def __init__(self, batches: list[int], durations: list[float], clock: FakeClock, async_scheduling: bool):
        self.batches, self.durations, self.clock, self.calls = batches, durations, clock, 0
        self.config = SimpleNamespace(async_scheduling=async_scheduling)
        self.runner = SimpleNamespace(device=SimpleNamespace(type="cpu"), prepare_inputs=lambda rows, *a: None,
                                      launch=lambda rows: None)
        self.scheduler = SimpleNamespace(running=[], waiting=[])
        self.last_step_prefill_tokens = self.last_step_decode_tokens = 0

    def step(self):
        i = self.calls
        self.calls += 1
        if i < len(self.batches):
            rows = [None] * self.batches[i]
            self.runner.prepare_inputs(rows)
            self.runner.launch(rows)
            self.last_step_decode_tokens = len(rows)
        self.clock.now += self.durations[i]
        return []


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_each_call_is_billed_to_the_step_whose_results_it_returned(async_scheduling):
    clock = FakeClock()
    batches = [4, 3, 2]
    durations = [0.010, 0.020, 0.030, 0.040]      # the fourth call launches nothing (async: returns step 2)
    engine = FakeEngine(batches, durations, clock, async_scheduling)
    profiler = StepProfiler(engine, clock=clock)
    for _ in range(len(durations) if async_scheduling else len(batches)):
        engine.step()
    walls = [r.wall_ms for r in profiler.records]
    if async_scheduling:
        # Call 0 returns nothing, call 1 step 0's tokens: step 0 pays both (the host's start-up
        # before its results); steps 1 and 2 pay the calls that returned them.
        assert walls == pytest.approx([30.0, 30.0, 40.0])
        assert [r.start_s for r in profiler.records] == pytest.approx([0.0, 0.030, 0.060])
    else:
        assert walls == pytest.approx([10.0, 20.0, 30.0])
    assert [r.num_seqs for r in profiler.records] == batches
    assert sum(walls) == pytest.approx(1e3 * clock.now)      # the run's whole wall time, once


def test_waiting_counts_the_requests_not_yet_running_nor_finished():
    """generate adds requests only as the scheduler can take them, so the engine's queue is not
    what waits: given the run's requests, a step's waiting count is those neither running nor
    finished."""
    clock = FakeClock()
    engine = FakeEngine([4, 3, 2], [0.01] * 4, clock, async_scheduling=True)
    running = iter([4, 3, 2, 0])
    finished = iter([0, 0, 1, 2])
    step = engine.step

    def step_with_state():
        out = step()
        engine.scheduler.running = [None] * next(running)
        return [SimpleNamespace(finished=True)] * next(finished)
    engine.step = step_with_state
    profiler = StepProfiler(engine, clock=clock, num_requests=10)
    for _ in range(4):
        engine.step()
    assert [r.waiting for r in profiler.records] == [6, 7, 7]
    assert [r.running for r in profiler.records] == [4, 3, 2]
