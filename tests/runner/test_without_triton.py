"""Triton is an optional dependency (pyproject's `triton` extra): without it the engine runs on the
PyTorch reference paths. The child process below hides triton from the import system, so the
check holds on a machine where triton is installed too (CI installs it)."""
import json
import subprocess
import sys
import textwrap

from mini_engine import LLM, SamplingParams

CHILD = textwrap.dedent("""
    import json, sys

    class NoTriton:
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ImportError("hidden by the test")
    sys.meta_path.insert(0, NoTriton())

    from mini_engine import LLM, SamplingParams
    from mini_engine.kernels.triton_utils import HAS_TRITON
    assert not HAS_TRITON
    llm = LLM(sys.argv[1], device="cpu", max_model_len=128, max_num_seqs=4, num_kv_blocks=64, block_size=4)
    out = llm.generate([[5, 6, 7, 8, 9], [3, 4]], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    print(json.dumps([o.outputs[0].token_ids for o in out]))
""")


def test_the_engine_runs_without_triton(tiny_checkpoint):
    child = subprocess.run([sys.executable, "-c", CHILD, tiny_checkpoint], capture_output=True, text=True)
    assert child.returncode == 0, child.stderr[-2000:]
    llm = LLM(tiny_checkpoint, device="cpu", max_model_len=128, max_num_seqs=4, num_kv_blocks=64, block_size=4,
              kernels="none")
    out = llm.generate([[5, 6, 7, 8, 9], [3, 4]], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert json.loads(child.stdout.strip().splitlines()[-1]) == [o.outputs[0].token_ids for o in out]
