"""bench.py under watch: what the GPU did during the timed run.

    PYTHONPATH=. python benchmarks/run_watch.py [bench.py's options]

A thread reads NVML every 10 ms: the SM clock, power, temperature and the clock-event reasons
(0x4 is the software power cap), summed up over the timed `generate` call alone. The machines'
spread is mostly that cap (benchmarks/NOTES.md, entry 42). A Triton kernel compiled inside the
timed run is benchmarks/host_stalls.py's to find: it logs every compile against the run.

NVML is read through ctypes from the driver's libnvidia-ml.so.1: the GPU machine has no pynvml
and no network to install it, and torch's own power and clock queries go through pynvml."""
import ctypes
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NVML_CLOCK_SM, NVML_TEMPERATURE_GPU = 1, 0
POWER_CAP = 0x4


class Nvml:
    def __init__(self, index: int = 0):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        if self.lib.nvmlInit_v2() != 0:
            raise RuntimeError("nvmlInit failed")
        self.handle = ctypes.c_void_p()
        self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self.handle))

    def sample(self) -> tuple[float, int, float, int, int]:
        """(time, SM MHz, watts, degrees C, clock-event reasons)."""
        clock, power, temp, reasons = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint(), ctypes.c_ulonglong()
        self.lib.nvmlDeviceGetClockInfo(self.handle, NVML_CLOCK_SM, ctypes.byref(clock))
        self.lib.nvmlDeviceGetPowerUsage(self.handle, ctypes.byref(power))           # milliwatts
        self.lib.nvmlDeviceGetTemperature(self.handle, NVML_TEMPERATURE_GPU, ctypes.byref(temp))
        self.lib.nvmlDeviceGetCurrentClocksThrottleReasons(self.handle, ctypes.byref(reasons))
        return time.time(), clock.value, power.value / 1000, temp.value, reasons.value


def summary(samples: list[tuple]) -> str:
    clocks = sorted(s[1] for s in samples)
    watts = sorted(s[2] for s in samples)
    capped = sum(1 for s in samples if s[4] & POWER_CAP)
    return (f"SM MHz min {clocks[0]} median {clocks[len(clocks) // 2]}; power W median {watts[len(watts) // 2]:.0f} "
            f"max {watts[-1]:.0f}; {samples[0][3]}->{samples[-1][3]} C; power-capped in {capped} of "
            f"{len(samples)} samples")


def main() -> int:
    import bench
    import mini_engine

    calls = []
    generate = mini_engine.LLM.generate

    def timed_generate(self, prompts, *args, **kwargs):
        start = time.time()
        out = generate(self, prompts, *args, **kwargs)
        calls.append((len(prompts), start, time.time()))
        return out

    mini_engine.LLM.generate = timed_generate
    nvml, samples, stop = Nvml(), [], threading.Event()

    def watch():
        while not stop.is_set():
            samples.append(nvml.sample())
            time.sleep(0.01)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    rc = bench.main(sys.argv[1:])
    stop.set()
    thread.join()
    _, start, end = calls[-1]           # bench.py's warm-up calls generate first, the timed run last
    run = [s for s in samples if start <= s[0] <= end]
    print(f"timed run {end - start:.3f} s: {summary(run)}")
    for s in run[::max(1, len(run) // 25)]:
        print(f"  +{s[0] - start:6.3f} s  SM {s[1]:5d} MHz  {s[2]:6.1f} W  {s[3]} C  reasons {s[4]:#x}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
