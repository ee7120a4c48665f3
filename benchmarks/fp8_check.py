"""fp8 weights on the GPU (run on the H200; exits early without CUDA): the engine over an FP8
checkpoint (Qwen3-0.6B's shape, N(0, 0.06) weights as gpu_correctness.py's, quantized as
Qwen3-*-FP8 is: mini_engine.model.random_checkpoint.write_fp8_layout) against transformers.

transformers' own fp8 kernels come from the `kernels` hub package, which this machine cannot
fetch, so the reference is transformers' Qwen3ForCausalLM with the checkpoint dequantized by
transformers' own code and each fp8 projection's input quantized as the engine quantizes it
(fp8_oracle): in fp32 the reference, in bf16 the control that says how far bf16 rounding alone
moves things.

1. The last prompt token's logits, the engine in bf16 on its Triton kernels and on its PyTorch
   path: relative error against the fp32 reference within 1.5x the control's.
2. Greedy tokens, teacher-forced: for each token the engine chose, the reference's largest logit
   minus the chosen one's, given the same prefix; the worst within --margin or 1.5x the control's.
3. CUDA graphs (requests of different lengths, so batches pad and shrink), eager steps, and a
   pool small enough to preempt, each judged as in 2; the graphs' run twice gives the same tokens.
4. quantization="fp8" over the bf16 checkpoint: its logits and greedy margins against the
   unquantized fp32 model, reported beside the FP8 checkpoint's (not judged: its oracle is
   tests/model/test_qwen3_fp8.py's, on CPU).
5. After every run, every KV block is free.
"""
import argparse
import gc
import json
import os
import random
import sys
import tempfile

import torch


def quantize_input(module, args):
    """A forward pre-hook: the projection's input quantized by row groups of 128 as the engine's."""
    from mini_engine.kernels.fp8_linear import dequantize_fp8_ref, quantize_fp8_ref
    x = args[0]
    q, scales = quantize_fp8_ref(x.reshape(-1, x.shape[-1]))
    return (dequantize_fp8_ref(q, scales, 1).to(x.dtype).reshape(x.shape),)


def fp8_oracle(path: str, dtype: torch.dtype, device: str, attn_implementation: str = "eager"):
    """transformers over the FP8 checkpoint at `path`, dequantized by transformers' own code
    (written once beside it), with its fp8 projections' inputs quantized (quantize_input)."""
    import transformers
    from safetensors.torch import load_file, save_file
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
    folder = path.rstrip("/") + "-dequantized"
    tensors = load_file(os.path.join(path, "model.safetensors"))
    fp8 = {name.removesuffix("_scale_inv") for name in tensors if name.endswith("weight_scale_inv")}
    if not os.path.isfile(os.path.join(folder, "config.json")):
        os.makedirs(folder, exist_ok=True)
        save_file({name: _dequantize_fp8_weight(t, tensors[name + "_scale_inv"], [128, 128], torch.float32)
                   if name in fp8 else t for name, t in tensors.items() if not name.endswith("_scale_inv")},
                  os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        config.pop("quantization_config")
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype,
                                                              attn_implementation=attn_implementation)
    for name, module in model.named_modules():
        if f"{name}.weight" in fp8:
            module.register_forward_pre_hook(quantize_input)
    return model.to(device).eval()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--margin", type=float, default=0.25)
    ap.add_argument("--out", help="folder for a JSON of the results")
    ap.add_argument("--cpu-dry-run", action="store_true", help="the script's logic on a tiny model on the CPU")
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.cpu_dry_run:
        sys.exit("fp8_check.py needs CUDA (or --cpu-dry-run)")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    from transformers import AutoModelForCausalLM

    from benchmarks.gpu_correctness import common_prefix
    from mini_engine import LLM, SamplingParams
    from mini_engine.model.random_checkpoint import QWEN3_0_6B, write_fp8_layout, write_random_checkpoint
    config = QWEN3_0_6B
    if args.cpu_dry_run:        # every projection whole 128 x 128 blocks
        config = QWEN3_0_6B | dict(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=128)
    tmp = tempfile.gettempdir()
    bf16 = write_random_checkpoint(os.path.join(tmp, f"qwen3-std006-fp8src-{config['hidden_size']}"), config,
                                   std=0.06, seed=1, device=dev)
    path = os.path.join(tmp, f"qwen3-std006-fp8-{config['hidden_size']}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        write_fp8_layout(bf16, path)
    rng = random.Random(0)
    prompts = [[rng.randrange(config["vocab_size"]) for _ in range(n)] for n in (5, 17, 64, 200, 333, 31, 128, 90)]
    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    results, failures = {}, []

    def generate(model, prompt):
        out = model.generate(torch.tensor([prompt], device=dev), max_new_tokens=args.tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    references = {"fp8": fp8_oracle(path, torch.float32, dev),
                  "unquantized": AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.float32,
                                                                      attn_implementation="eager").to(dev).eval()}
    control_model = fp8_oracle(path, torch.bfloat16, dev, "sdpa")
    with torch.inference_mode():
        control = [generate(control_model, p) for p in prompts]
        ref_logits = {name: [m(torch.tensor([p], device=dev)).logits[0, -1].float() for p in prompts]
                      for name, m in references.items()}
        control_logits = [control_model(torch.tensor([p], device=dev)).logits[0, -1].float() for p in prompts]
    del control_model
    gc.collect()

    @torch.inference_mode()
    def worst_margin(outputs, reference="fp8") -> float:
        """The largest fp32 gap between a chosen token's logit and the argmax's, given its prefix."""
        worst = 0.0
        for p, gen in zip(prompts, outputs):
            logits = references[reference](torch.tensor([p + gen[:-1]], device=dev)).logits[0, len(p) - 1:].float()
            chosen = logits.gather(-1, torch.tensor(gen, device=dev)[:, None]).squeeze(-1)
            worst = max(worst, (logits.max(-1).values - chosen).max().item())
        return worst

    def rel_err(logits, reference="fp8") -> float:
        return max(((g - r).norm() / r.norm()).item() for g, r in zip(logits, ref_logits[reference]))

    def run(label, model=path, **options):
        llm = LLM(model, max_num_seqs=64, **({"num_kv_blocks": 256} | options))
        params = greedy
        if "graphs" in label:       # requests of different lengths, so that batches shrink mid-run
            params = [SamplingParams(temperature=0, max_tokens=max(1, args.tokens - 2 * i), ignore_eos=True)
                      for i in range(len(prompts))]
        outputs = llm.generate(prompts, params, use_tqdm=False)
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
        info = dict(preemptions=engine.num_preemptions, kernels=sorted(runner.kernels),
                    cuda_graphs=runner.use_cuda_graphs, quantization=engine.config.quantization)
        llm.shutdown()
        del llm, engine, runner
        gc.collect()
        torch.cuda.empty_cache() if dev == "cuda" else None
        return [o.outputs[0].token_ids for o in outputs], logits, info

    control_err = max(((c - r).norm() / r.norm()).item() for c, r in zip(control_logits, ref_logits["fp8"]))
    control_margin = worst_margin(control)
    results["control"] = dict(logits_rel_err=control_err, worst_margin=control_margin)
    limit_margin = max(args.margin, 1.5 * control_margin)
    for label, options in (("kernels", {}), ("pytorch", dict(kernels="none", enforce_eager=True))):
        tokens, logits, info = run(label, **options)
        err, margin = rel_err(logits), worst_margin(tokens)
        results[label] = dict(logits_rel_err=err, worst_margin=margin,
                              equal_to_control=sum(t == c for t, c in zip(tokens, control)), **info)
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
    # quantization="fp8" over the bf16 checkpoint, and the bf16 engine, against the unquantized fp32 model
    for label, options in (("online fp8", dict(quantization="fp8")), ("bf16 engine", {})):
        online, logits, info = run(label, model=bf16, **options)
        results[label] = dict(logits_rel_err_vs_unquantized=rel_err(logits, "unquantized"),
                              worst_margin_vs_unquantized=worst_margin(online, "unquantized"), **info)
    results["fp8 checkpoint vs unquantized"] = dict(worst_margin=worst_margin(tokens["graphs"], "unquantized"))
    print(json.dumps(results, indent=1))
    for failure in failures:
        print("FAILED:", failure)
    print("ALL PASSED" if not failures else f"{len(failures)} FAILED")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fp8_check.json"), "w") as f:
            json.dump(dict(results=results, failures=failures), f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
