import sys, runpy
sys.path.insert(0, __file__.rsplit("/", 1)[0])
import loop_probe  # noqa: F401
if __name__ == "__main__":
    sys.argv[0] = "bench.py"
    runpy.run_path("bench.py", run_name="__main__")
