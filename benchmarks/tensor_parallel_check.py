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
  7. fp32, split, sampled rows (top-k 20, top-p 0.95, half of them unseeded): each token's reported
     log-probability within 0.01 of the reference's, teacher-forced.
Every run must end with all KV blocks free."""
import argparse
import gc
import json
import os
import random
import sys

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

    from benchmarks.gpu_correctness import std006_checkpoint
    from mini_engine import LLM, SamplingParams

    dev = "cpu" if args.cpu_dry_run else "cuda"
    path, config = std006_checkpoint(args.cpu_dry_run, dev)
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

    @torch.inference_mode()
    def worst_logprob_gap(outputs) -> float:
        """The largest gap between a sampled token's reported log-probability and the fp32
        reference's, teacher-forced: a rank that sampled otherwise than rank 0 computes its share
        of every later token from another token, and the gap grows to nats."""
        worst = 0.0
        for p, out in zip(prompts, outputs):
            gen = out.outputs[0].token_ids
            logits = hf32(torch.tensor([p + gen[:-1]], device=dev)).logits[0, len(p) - 1:].float()
            want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(gen, device=dev)[:, None]).squeeze(-1)
            got = torch.tensor([x.logprob for x in out.outputs[0].logprobs], device=dev)
            worst = max(worst, (want - got).abs().max().item())
        return worst

    def run(tp: int, params=greedy, **options) -> tuple[list, dict]:
        llm = LLM(path, tensor_parallel_size=tp, max_num_seqs=64, **({"gpu_memory_utilization": 0.5} if dev == "cuda"
                                                                       else {"device": "cpu"}) | options)
        outputs = llm.generate(prompts, params, use_tqdm=False)
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
        outputs, info = run(tp, **options)
        tokens[name] = [o.outputs[0].token_ids for o in outputs]
        info["worst_margin"] = worst_margin(tokens[name])
        info["margin_limit"] = margin
        results[name] = info
        print(name, info, flush=True)
        if info["worst_margin"] > margin:
            failures.append(f"{name}: a greedy token {info['worst_margin']:.4g} under the fp32 argmax (limit {margin})")
        if info["leaked_blocks"]:
            failures.append(f"{name}: {info['leaked_blocks']} KV blocks leaked")

    # Sampled rows (Qwen3's top-k 20, top-p 0.95, in the graphs' top-k sampler), half seeded, half
    # drawing the runner's per-step seeds: every rank must draw the same token.
    sampled = [SamplingParams(temperature=0.8, top_k=20, top_p=0.95, max_tokens=args.tokens, ignore_eos=True,
                              logprobs=0, seed=i if i % 2 else None) for i in range(len(prompts))]
    outputs, info = run(2, sampled, dtype="float32", **({"block_size": 64} if args.cpu_dry_run else {}))
    info["worst_logprob_gap"] = worst_logprob_gap(outputs)
    results["fp32 tp2 graphs sampled"] = info
    print("fp32 tp2 graphs sampled", info, flush=True)
    if info["worst_logprob_gap"] > 1e-2:
        failures.append(f"sampled rows: a token's log-probability {info['worst_logprob_gap']:.4g} from the "
                        "reference's, teacher-forced (limit 0.01): the ranks drew differently")
    if info["leaked_blocks"]:
        failures.append(f"sampled rows: {info['leaked_blocks']} KV blocks leaked")

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
