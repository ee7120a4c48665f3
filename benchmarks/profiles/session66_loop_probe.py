"""Per-step host timings of the engine's loop, offline (LLM.generate) and in the server's engine
process (EngineLoop: step, process, send). Patches at import; the spawned engine process imports
the parent's main module, so a main script that imports this is patched in both processes."""
import atexit
import json
import os
import time

DIR = os.environ.get("LOOP_PROBE_DIR", "/tmp")
rows = []          # [start, step_s, wait_s, n_outputs, process_s, send_s]
state = {"wait": 0.0}


def dump():
    if rows:
        with open(os.path.join(DIR, f"loop_{os.getpid()}.json"), "w") as f:
            json.dump(rows, f)


def install():
    import mini_engine.engine.engine as E
    import mini_engine.runner.batch as B
    result0, step0 = B.StepHandle.result, E.LLMEngine.step

    def result(self):
        t = time.perf_counter()
        try:
            return result0(self)
        finally:
            state["wait"] += time.perf_counter() - t

    def step(self):
        state["wait"] = 0.0
        t = time.perf_counter()
        out = step0(self)
        rows.append([t, time.perf_counter() - t, state["wait"], len(out), 0.0, 0.0])
        if len(rows) % 500 == 0:
            dump()
        return out
    B.StepHandle.result, E.LLMEngine.step = result, step
    try:
        import mini_engine.server.engine_process as P
    except ImportError:
        return
    process0, send0 = P.EngineLoop.process, P.EngineLoop.send

    def process(self, outputs):
        t = time.perf_counter()
        try:
            return process0(self, outputs)
        finally:
            if rows:
                rows[-1][4] += time.perf_counter() - t

    def send(self, deltas):
        t = time.perf_counter()
        try:
            return send0(self, deltas)
        finally:
            if rows:
                rows[-1][5] += time.perf_counter() - t
    P.EngineLoop.process, P.EngineLoop.send = process, send


install()
atexit.register(dump)
