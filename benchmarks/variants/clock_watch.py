# PYTHONPATH=. python ab_s42/clock_watch.py [bench args]   (H200)
"""bench.py with NVML (through ctypes) sampling the GPU every 10 ms from a thread: SM clock, power,
temperature and the clock-event (throttle) reasons, summarised over the timed run alone."""
import ctypes, os, sys, threading, time
import mini_engine

calls = []
orig_generate = mini_engine.LLM.generate


def generate(self, prompts, *args, **kwargs):
    t0 = time.time()
    out = orig_generate(self, prompts, *args, **kwargs)
    calls.append((len(prompts), t0, time.time()))
    return out


mini_engine.LLM.generate = generate
nvml = ctypes.CDLL("libnvidia-ml.so.1")
assert nvml.nvmlInit_v2() == 0
handle = ctypes.c_void_p()
assert nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle)) == 0
samples, stop = [], threading.Event()


def sample():
    clock, mem, power, temp, reasons = (ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint(),
                                        ctypes.c_ulonglong())
    while not stop.is_set():
        nvml.nvmlDeviceGetClockInfo(handle, 1, ctypes.byref(clock))         # NVML_CLOCK_SM
        nvml.nvmlDeviceGetClockInfo(handle, 2, ctypes.byref(mem))           # NVML_CLOCK_MEM
        nvml.nvmlDeviceGetPowerUsage(handle, ctypes.byref(power))           # mW
        nvml.nvmlDeviceGetTemperature(handle, 0, ctypes.byref(temp))
        nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle, ctypes.byref(reasons))
        samples.append((time.time(), clock.value, mem.value, power.value / 1000, temp.value, reasons.value))
        time.sleep(0.01)


thread = threading.Thread(target=sample, daemon=True)
thread.start()
import bench
rc = bench.main(sys.argv[1:])
stop.set(); thread.join()
n, t0, t1 = max(calls, key=lambda c: c[0])
run = [s for s in samples if t0 <= s[0] <= t1]
before = [s for s in samples if t0 - 3 <= s[0] < t0]
print(f"timed run {t1 - t0:.3f} s, {len(run)} samples in it ({len(samples)} in all)")
for label, part in (("3 s before", before), ("timed run", run)):
    if part:
        sm = sorted(s[1] for s in part); pw = sorted(s[3] for s in part)
        reasons = {}
        for s in part:
            reasons[hex(s[5])] = reasons.get(hex(s[5]), 0) + 1
        print(f"{label}: SM MHz min {sm[0]} median {sm[len(sm)//2]} max {sm[-1]}; mem MHz {part[0][2]}; "
              f"power W median {pw[len(pw)//2]:.0f} max {pw[-1]:.0f}; temp C {part[0][4]}->{part[-1][4]}; "
              f"reasons {reasons}")
for s in run[::max(1, len(run) // 25)]:
    print(f"  +{s[0] - t0:6.3f} s  SM {s[1]:5d} MHz  {s[3]:6.1f} W  {s[4]} C  {hex(s[5])}")

cache = os.environ.get("TRITON_CACHE_DIR")
if cache and os.path.isdir(cache):
    late = []
    for entry in os.scandir(cache):
        if t0 <= entry.stat().st_mtime <= t1:
            names = [f for f in os.listdir(entry.path) if f.endswith(".json") and not f.startswith("__grp")]
            late.append(",".join(names))
    print(f"Triton cache entries written during the timed run: {len(late)} {late[:10]}")
sys.exit(rc)
