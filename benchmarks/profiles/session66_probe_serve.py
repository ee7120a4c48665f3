import sys
sys.path.insert(0, __file__.rsplit("/", 1)[0])
import loop_probe  # noqa: F401  (patched here and in the spawned engine process, which imports this file)
if __name__ == "__main__":
    from mini_engine.serve import main
    main(sys.argv[1:])
