"""Qwen3-MoE on the GPU (run on the H200; exits early without CUDA): the engine against
transformers' Qwen3MoeForCausalLM, loading the same safetensors.

The checkpoint has Qwen3-30B-A3B's shape (2048 wide, 128 experts of 768 columns, 8 a token)
cut to --layers of its 48 layers, with N(0, 0.06) weights as gpu_correctness.py's (at 0.02 a
random model repeats one token). The reference is transformers in fp32; transformers' own bf16
run is the control that says how far bf16 rounding alone moves things.

1. The last prompt token's logits, the engine in bf16 on its Triton kernels (the grouped-GEMM
   experts: kernels/fused_moe.py) and on its PyTorch path, against transformers fp32: relative
   error, within 1.5x the control's.
2. Greedy tokens, teacher-forced: for each token the engine chose, fp32's largest logit minus the
   chosen token's, given the same prefix; the worst within --margin or 1.5x the control's worst.
3. CUDA graphs, eager steps on the same kernels, and a pool small enough to preempt, for 8
   requests of different lengths (batches that pad to a captured size and ones that hit one,
   requests finishing mid-batch): each judged teacher-forced as in 2, and the graphs' run again
   must give the same tokens (the engine is deterministic). Graphs and eager steps are not
   required to agree bit for bit: a graph's decode attention splits the context for
   max_model_len, an eager step for the batch's longest sequence, so their sums round
   differently, and a router with 128 experts often has a near tie that such a difference
   tips (benchmarks/NOTES.md, entry 55). Their agreeing prefixes are reported.
4. After every run, every KV block is free.
"""
import argparse
import gc
import json
import os
import random
import sys
import tempfile

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--margin", type=float, default=0.25)
    ap.add_argument("--out", help="folder for a JSON of the results")
    ap.add_argument("--cpu-dry-run", action="store_true", help="the script's logic on a tiny MoE on the CPU")
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.cpu_dry_run:
        sys.exit("moe_check.py needs CUDA (or --cpu-dry-run)")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    from transformers import AutoModelForCausalLM

    from benchmarks.gpu_correctness import common_prefix
    from mini_engine import LLM, SamplingParams
    from mini_engine.model.random_checkpoint import QWEN3_30B_A3B, write_random_checkpoint
    config = QWEN3_30B_A3B | {"num_hidden_layers": args.layers}
    if args.cpu_dry_run:
        config |= dict(vocab_size=2048, hidden_size=64, moe_intermediate_size=32, num_experts=16,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    path = write_random_checkpoint(os.path.join(tempfile.gettempdir(), f"qwen3-moe-std006-{args.layers}-"
                                                f"{config['hidden_size']}"), config, std=0.06, seed=1, device=dev)
    rng = random.Random(0)
    prompts = [[rng.randrange(config["vocab_size"]) for _ in range(n)] for n in (5, 17, 64, 200, 333, 31, 128, 90)]
    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    results, failures = {}, []

    hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").to(dev).eval()
    hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").to(dev).eval()
    with torch.inference_mode():
        control = [hf16.generate(torch.tensor([p], device=dev), max_new_tokens=args.tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
        ref_logits = [hf32(torch.tensor([p], device=dev)).logits[0, -1].float() for p in prompts]
        control_logits = [hf16(torch.tensor([p], device=dev)).logits[0, -1].float() for p in prompts]
    del hf16
    gc.collect()

    @torch.inference_mode()
    def worst_margin(outputs) -> float:
        """The largest fp32 gap between a chosen token's logit and the argmax's, given its prefix."""
        worst = 0.0
        for p, gen in zip(prompts, outputs):
            logits = hf32(torch.tensor([p + gen[:-1]], device=dev)).logits[0, len(p) - 1:].float()
            chosen = logits.gather(-1, torch.tensor(gen, device=dev)[:, None]).squeeze(-1)
            worst = max(worst, (logits.max(-1).values - chosen).max().item())
        return worst

    def rel_err(logits) -> float:
        return max(((g - r).norm() / r.norm()).item() for g, r in zip(logits, ref_logits))

    def run(label, **options):
        llm = LLM(path, max_num_seqs=64, **({"num_kv_blocks": 256} | options))
        # the graphs' runs: requests of different lengths, so that batches shrink mid-run
        outputs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=max(1, args.tokens - 2 * i),
                                                        ignore_eos=True)
                                         for i in range(len(prompts))] if "graphs" in label else greedy,
                               use_tqdm=False)
        engine = llm.engine
        if engine.num_free_blocks != engine.block_manager.num_blocks:
            failures.append(f"{label}: KV blocks leaked")
        logits = []
        with torch.inference_mode():
            from mini_engine.runner.batch import BatchRow
            runner = engine.runner
            for p in prompts:
                blocks = list(range(-(-len(p) // runner.block_size)))
                t, meta = runner.prepare_inputs([BatchRow(p, 0, blocks, True, greedy)])
                hidden = runner.model(t.input_ids, t.positions, meta)
                logits.append(runner.model.compute_logits(hidden[t.logits_indices]).float()[0])
        info = dict(preemptions=engine.num_preemptions, kernels=sorted(engine.runner.kernels),
                    cuda_graphs=engine.runner.use_cuda_graphs)
        llm.shutdown()
        del llm, engine, runner
        gc.collect()
        torch.cuda.empty_cache() if dev == "cuda" else None
        return [o.outputs[0].token_ids for o in outputs], logits, info

    control_err = max(((c - r).norm() / r.norm()).item() for c, r in zip(control_logits, ref_logits))
    control_margin = worst_margin(control)
    results["control"] = dict(logits_rel_err=control_err, worst_margin=control_margin)
    limit_margin = max(args.margin, 1.5 * control_margin)
    for label, options in (("kernels", {}), ("pytorch", dict(kernels="none", enforce_eager=True))):
        tokens, logits, info = run(label, **options)
        err, margin = rel_err(logits), worst_margin(tokens)
        agree = sum(t == c for t, c in zip(tokens, control))
        results[label] = dict(logits_rel_err=err, worst_margin=margin, equal_to_control=agree, **info)
        if err > 1.5 * control_err:
            failures.append(f"{label}: logits rel err {err:.4g} > 1.5 x control {control_err:.4g}")
        if margin > limit_margin:
            failures.append(f"{label}: a greedy token {margin:.3f} below fp32's argmax (limit {limit_margin:.3f})")
    block_size = 64 if dev == "cuda" else 16          # the engine's default
    longest = -(-(max(map(len, prompts)) + args.tokens) // block_size)
    runs = {"graphs": {}, "graphs again": {}, "eager steps": dict(enforce_eager=True),
            "graphs, small pool": dict(num_kv_blocks=longest + 1)}
    tokens = {}
    for label, options in runs.items():
        tokens[label], _, info = run("graphs " + label, **options)
        margin = worst_margin(tokens[label])
        results[label] = dict(worst_margin=margin, agreeing_prefix_with_graphs=[
            common_prefix(a, b) for a, b in zip(tokens[label], tokens["graphs"])], **info)
        if margin > limit_margin:
            failures.append(f"{label}: a greedy token {margin:.3f} below fp32's argmax (limit {limit_margin:.3f})")
    if tokens["graphs again"] != tokens["graphs"]:
        failures.append("the same run with CUDA graphs twice gave different tokens")
    if dev == "cuda" and (not results["graphs"]["cuda_graphs"] or not results["graphs, small pool"]["preemptions"]):
        failures.append("graphs not used, or the small pool never preempted")
    print(json.dumps(results, indent=1))
    for failure in failures:
        print("FAILED:", failure)
    print("ALL PASSED" if not failures else f"{len(failures)} FAILED")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "moe_check.json"), "w") as f:
            json.dump(dict(results=results, failures=failures), f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
