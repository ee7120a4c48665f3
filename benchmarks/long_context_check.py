"""A YaRN context past Qwen3's own 40,960 positions, on the GPU: one prompt of --tokens random ids
(72,000 by default) through Qwen3-0.6B's shape with Qwen's YaRN (factor 4 over 32,768, as
`hf_overrides` gives it), max_model_len 131,072.

The kernel path (Triton attention and rotary/KV write, CUDA graphs for decode) against the
PyTorch reference path (kernels="none", no graphs, one sequence, the prompt in 4,096-token
chunks), both bf16:
the first sampled token's top-20 log-probabilities, and the greedy tokens after it; then the
kernel path without graphs, whose tokens must equal the graphs'. Every run must give back all
its KV blocks. The control is the same pair of paths over the prompt's first 2,000 tokens, inside
the original context, where benchmarks/gpu_correctness.py has judged both against transformers:
bf16's rounding moves the two paths apart there too, and a kernel that read the cache or the
rotary table wrong past some position would move them far further apart at 72,000 than at 2,000.
(A first limit of 0.1 on the log-probabilities, set with no control, was failed at 0.187 by
paths whose greedy tokens agreed for 12 of 16: benchmarks/NOTES.md, entry 51.) Both paths read
the same rotary table, so this checks the kernels at long positions, not YaRN's numbers, which
tests/model/test_yarn.py checks against transformers.

    PYTHONPATH=. python benchmarks/long_context_check.py [--tokens 72000] [--out DIR]
"""
import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time

import torch

YARN = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
CONTROL_TOKENS = 2000
CONTROL_FACTOR = 3       # the long context's top-20 log-probability difference may be 3x the control's


def run(path: str, prompt: list[int], new_tokens: int, **engine_kwargs) -> dict:
    from mini_engine import LLM, SamplingParams
    llm = LLM(path, max_model_len=131072, hf_overrides=YARN, **engine_kwargs)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=20)
    start = time.perf_counter()
    completion = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    seconds = time.perf_counter() - start
    engine = llm.engine
    result = {"tokens": completion.token_ids, "top": dict(completion.logprobs[0].top), "seconds": seconds,
              "blocks_free": engine.num_free_blocks == engine.block_manager.num_blocks}
    del llm, engine
    gc.collect()
    torch.cuda.empty_cache()
    return result


def compare(kernels: dict, reference: dict, new_tokens: int) -> tuple[float, int, int]:
    """The largest difference of the top-20 log-probabilities both have, how many they share, and
    for how many tokens the greedy outputs agree."""
    common = kernels["top"].keys() & reference["top"].keys()
    worst = max((abs(kernels["top"][t] - reference["top"][t]) for t in common), default=float("inf"))
    same = 0
    while same < new_tokens and kernels["tokens"][same] == reference["tokens"][same]:
        same += 1
    return worst, len(common), same


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=72000)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--out", default=None, help="folder for a JSON of the results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("long_context_check.py needs CUDA")
    from mini_engine.model.random_checkpoint import QWEN3_0_6B, write_random_checkpoint
    # std 0.06, as gpu_correctness.py's: at 0.02 a random model's next-token distribution is flat.
    path = write_random_checkpoint(tempfile.mkdtemp(prefix="qwen3-yarn-"), QWEN3_0_6B, device="cuda", std=0.06)
    prompt = random.Random(0).choices(range(151_000), k=args.tokens)
    runs = {"kernels, graphs": run(path, prompt, args.new_tokens),
            "kernels, no graphs": run(path, prompt, args.new_tokens, enforce_eager=True),
            # One sequence at a time: the eager decode gathers every row's max_model_len context.
            # Less of the GPU for the pool: a chunk's fp32 scores at a 72k context (~19 GB, and
            # its softmax as much) are more than the warm-up's short prefill rows measured.
            "reference": run(path, prompt, args.new_tokens, kernels="none", enforce_eager=True,
                             max_num_batched_tokens=4096, max_num_seqs=1, gpu_memory_utilization=0.4),
            "control: kernels, graphs": run(path, prompt[:CONTROL_TOKENS], args.new_tokens),
            "control: reference": run(path, prompt[:CONTROL_TOKENS], args.new_tokens, kernels="none",
                                      enforce_eager=True, max_num_seqs=1, gpu_memory_utilization=0.4)}
    worst, shared, same = compare(runs["kernels, graphs"], runs["reference"], args.new_tokens)
    control_worst, control_shared, control_same = compare(runs["control: kernels, graphs"],
                                                          runs["control: reference"], args.new_tokens)
    limit = CONTROL_FACTOR * control_worst
    graphs = runs["kernels, graphs"]
    checks = {
        "top-20 tokens shared with the reference (control's)": (f"{shared} ({control_shared})",
                                                                 shared >= control_shared - 2),
        "largest top-20 log-probability difference (limit)": (f"{worst:.4f} ({limit:.4f})", worst <= limit),
        "greedy tokens equal to the reference's, from the first (control's)": (f"{same} ({control_same})", same >= 1),
        "graphs' tokens equal no graphs'": (graphs["tokens"] == runs["kernels, no graphs"]["tokens"], None),
        "KV blocks all free after each run": (all(r["blocks_free"] for r in runs.values()), None),
    }
    print(f"prompt {args.tokens:,} tokens, positions to {args.tokens + args.new_tokens - 1:,}, YaRN {YARN}")
    for name, r in runs.items():
        print(f"  {name}: {r['seconds']:.2f} s, tokens {r['tokens']}")
    failed = []
    for name, (value, ok) in checks.items():
        ok = bool(value) if ok is None else ok
        print(f"{name:70s} {'PASS' if ok else 'FAIL'}  {value}")
        failed += [] if ok else [name]
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "long_context_check.json"), "w") as f:
            json.dump({"tokens": args.tokens, "runs": {k: {**v, "top": {str(t): lp for t, lp in v["top"].items()}}
                                                        for k, v in runs.items()},
                       "checks": {k: v[0] for k, v in checks.items()}, "failed": failed}, f, indent=1)
    print("ALL PASSED" if not failed else f"FAILED: {failed}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
