"""Tensor parallelism on two GPUs, end to end (run on a machine with two; --cpu-dry-run checks the
script on CPU processes joined by gloo, with a tiny model).

Qwen3-0.6B's shape with N(0, 0.06) weights (as gpu_correctness.py), transformers fp32 the reference.
Every greedy token is judged teacher-forced: given the same prefix, the fp32 reference's logit of
the token chosen must be within the margin of its largest (a random model's top two are often
closer than bf16's rounding, so exact agreement is reported, not required). The runs:
  1. fp32, split over two ranks, CUDA graphs: 13 prompts (a batch padded to the captured 16), margin 1e-3.
  2. the same on one GPU: the control, judged the same way; its tokens against run 1's.
  3. split, a pool small enough to preempt, graphs; and 4. the same without graphs (enforce_eager):
     tokens identical to 3's (graphs replay what the eager path computes, collectives included).
  5. bf16, split (the benchmark's dtype), margin 0.25 as gpu_correctness.py's; 6. bf16 on one GPU.
Every run must end with all KV blocks free."""
import argparse
import gc
import json
import os
import random
import sys
import tempfile

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="folder for a JSON of the results")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--cpu-dry-run", action="store_true")
    args = ap.parse_args()
    if not args.cpu_dry_run and torch.cuda.device_count() < 2:
        sys.exit("tensor_parallel_check.py needs two GPUs (or --cpu-dry-run)")
    from transformers import Qwen3ForCausalLM as HFQwen3

    from mini_engine import LLM, SamplingParams
    from mini_engine.model.random_checkpoint import QWEN3_0_6B, write_random_checkpoint

    dev = "cpu" if args.cpu_dry_run else "cuda"
    config = QWEN3_0_6B
    if args.cpu_dry_run:
        config = QWEN3_0_6B | dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    path = write_random_checkpoint(os.path.join(tempfile.gettempdir(), f"qwen3-std006-{config['hidden_size']}"),
                                   config, std=0.06, seed=1, device=dev)
    rng = random.Random(0)
    prompts = [[rng.randrange(config["vocab_size"]) for _ in range(n)]
               for n in (5, 17, 64, 200, 333, 1000, 31, 128, 2, 45, 700, 90, 12)]
    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    hf32 = HFQwen3.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").to(dev).eval()

    @torch.inference_mode()
    def worst_margin(outputs: list[list[int]]) -> float:
        worst = 0.0
        for p, gen in zip(prompts, outputs):
            logits = hf32(torch.tensor([p + gen[:-1]], device=dev)).logits[0, len(p) - 1:].float()
            chosen = logits.gather(-1, torch.tensor(gen, device=dev)[:, None]).squeeze(-1)
            worst = max(worst, (logits.max(-1).values - chosen).max().item())
        return worst

    def run(tp: int, **options) -> tuple[list[list[int]], dict]:
        llm = LLM(path, tensor_parallel_size=tp, max_num_seqs=64, **({"gpu_memory_utilization": 0.5} if dev == "cuda"
                                                                       else {"device": "cpu"}) | options)
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        engine = llm.engine
        info = dict(preemptions=engine.num_preemptions,
                    leaked_blocks=engine.block_manager.num_blocks - engine.num_free_blocks,
                    cuda_graphs=engine.runner.graph_runner is not None)
        llm.shutdown()
        del llm, engine
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()
        return outputs, info

    small_pool = 20 if args.cpu_dry_run else 40     # blocks of 64: fewer than the 13 prompts need at once
    runs = {
        "fp32 tp2 graphs": (2, dict(dtype="float32"), 1e-3),
        "fp32 tp1 graphs (control)": (1, dict(dtype="float32"), 1e-3),
        "fp32 tp2 graphs small pool": (2, dict(dtype="float32", num_kv_blocks=small_pool), 1e-3),
        "fp32 tp2 eager small pool": (2, dict(dtype="float32", num_kv_blocks=small_pool, enforce_eager=True), 1e-3),
        "bf16 tp2 graphs": (2, {}, 0.25),
        "bf16 tp1 graphs (control)": (1, {}, 0.25),
    }
    if args.cpu_dry_run:
        runs = {name: (tp, options | {"block_size": 64}, margin) for name, (tp, options, margin) in runs.items()}
    results, tokens, failures = {}, {}, []
    for name, (tp, options, margin) in runs.items():
        tokens[name], info = run(tp, **options)
        info["worst_margin"] = worst_margin(tokens[name])
        info["margin_limit"] = margin
        results[name] = info
        print(name, info, flush=True)
        if info["worst_margin"] > margin:
            failures.append(f"{name}: a greedy token {info['worst_margin']:.4g} under the fp32 argmax (limit {margin})")
        if info["leaked_blocks"]:
            failures.append(f"{name}: {info['leaked_blocks']} KV blocks leaked")

    def same(a: str, b: str) -> int:
        return sum(x == y for x, y in zip(tokens[a], tokens[b]))
    results["identical outputs, tp2 vs tp1, fp32"] = same("fp32 tp2 graphs", "fp32 tp1 graphs (control)")
    results["identical outputs, tp2 vs tp1, bf16"] = same("bf16 tp2 graphs", "bf16 tp1 graphs (control)")
    results["identical outputs, graphs vs eager, small pool"] = same("fp32 tp2 graphs small pool",
                                                                     "fp32 tp2 eager small pool")
    if results["identical outputs, graphs vs eager, small pool"] != len(prompts):
        failures.append("split over two ranks, CUDA graphs changed the outputs of the eager path")
    if results["fp32 tp2 graphs small pool"]["preemptions"] == 0:
        failures.append("the small pool preempted nothing")
    if not all(results[name]["cuda_graphs"] for name in runs if "graphs" in name) and not args.cpu_dry_run:
        failures.append("a run meant to use CUDA graphs did not")
    print(json.dumps({k: v for k, v in results.items() if not isinstance(v, dict)}, indent=1))
    for failure in failures:
        print("FAILED:", failure)
    print("ALL PASSED" if not failures else f"{len(failures)} FAILED")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "tensor_parallel_check.json"), "w") as f:
            json.dump({"results": results, "failures": failures, "num_prompts": len(prompts)}, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
