"""What moe_check.py and fp8_check.py share: the engine's runs over one checkpoint, each judged
against a transformers model in fp32 by teacher forcing (for each token the engine chose, the
reference's largest logit minus the chosen one's, given the same prefix), and the report."""
import argparse
import gc
import inspect
import json
import os
import sys

import torch


def judge_arguments(script: str, extra=None) -> tuple[argparse.Namespace, str]:
    """A check script's options (--tokens, --margin, --out, --cpu-dry-run, and what extra(parser)
    adds) and its device: CUDA, or the CPU for a dry run, with the Triton kernels through the
    interpreter (whose switch is read when triton is first imported). Exits without either."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--margin", type=float, default=0.25)
    ap.add_argument("--out", help="folder for a JSON of the results")
    ap.add_argument("--cpu-dry-run", action="store_true", help="the script's logic on a tiny model on the CPU")
    if extra is not None:
        extra(ap)
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.cpu_dry_run:
        sys.exit(f"{script} needs CUDA (or --cpu-dry-run)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    return args, device


def dequantized_model(path: str, dequantize, dtype: torch.dtype, attn_implementation: str):
    """transformers over a quantized checkpoint's weights, unquantized: dequantize(its tensors) ->
    the tensors of an unquantized checkpoint, written once beside it (path + "-dequantized", its
    config.json without quantization_config) and loaded in dtype; on the CPU, not yet eval()."""
    import transformers
    from safetensors.torch import load_file, save_file

    from mini_engine.model.random_checkpoint import written_once

    def write(folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        tensors = dequantize(load_file(os.path.join(path, "model.safetensors")))
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        config.pop("quantization_config")
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f)
    folder = written_once(path.rstrip("/") + "-dequantized", write)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype,
                                                             attn_implementation=attn_implementation)


def per_product_check(path: str, prompts: list[list[int]], tokens: int, product_attr: str, kernel, reference,
                      kernel_name: str, module_type: type | None = None, **engine_options) -> dict:
    """The engine on its Triton kernels (eager, bf16 on a GPU; on CPU the interpreter's, only
    `kernel_name`), each call of `kernel` that a module of module_type (a Linear, unless given)
    makes through its `product_attr` checked against `reference` on the same arguments (the real
    shapes and activations of prefill and decode steps; a residual the product adds into is cloned
    for the reference): the worst error of a call relative to its largest output, the modules
    checked of all the model's modules of that type, the fewest and most rows a call saw, and the
    output lengths."""
    from mini_engine import LLM, SamplingParams
    from mini_engine.layers.linear import Linear
    module_type = module_type or Linear
    options = dict(max_num_seqs=64, num_kv_blocks=256, enforce_eager=True,
                   kernels="auto" if torch.cuda.is_available() else kernel_name) | engine_options
    llm = LLM(path, **options)
    rows, worst = [], 0.0
    signature = inspect.signature(reference)

    def checked(*args, **kwargs):
        nonlocal worst
        given = signature.bind(*args, **kwargs).arguments
        if given.get("residual") is not None:
            given = given | {"residual": given["residual"].clone()}
        expected = reference(**given).float()
        out = kernel(*args, **kwargs)
        rows.append(args[0].shape[0])
        worst = max(worst, ((out.float() - expected).abs().max() / expected.abs().max().clamp(min=1e-6)).item())
        return out
    candidates = [module for module in llm.engine.runner.model.modules() if isinstance(module, module_type)]
    triton = [module for module in candidates if getattr(module, product_attr) is kernel]
    for module in triton:
        setattr(module, product_attr, checked)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    return dict(worst_rel_err=worst, modules=len(triton), of_modules=len(candidates),
                fewest_rows=min(rows, default=0), most_rows=max(rows, default=0),
                output_lengths=sorted({len(o.outputs[0].token_ids) for o in outputs}))


class EngineJudge:
    def __init__(self, prompts: list[list[int]], tokens: int, device: str, references: dict):
        """references: name -> a transformers model in fp32 on `device`; the first is the default."""
        from mini_engine import SamplingParams
        self.prompts, self.tokens, self.device, self.references = prompts, tokens, device, references
        self.greedy = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        self.results: dict = {}
        self.failures: list[str] = []
        with torch.inference_mode():
            self.ref_logits = {name: [m(self.tensor(p)).logits[0, -1].float() for p in prompts]
                               for name, m in references.items()}

    def tensor(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor([ids], device=self.device)

    @torch.inference_mode()
    def margins(self, outputs: list[list[int]], reference: str | None = None) -> torch.Tensor:
        """Each chosen token's fp32 gap below the argmax's logit, given its prefix: every token of every output."""
        model = self.references[reference or next(iter(self.references))]
        gaps = []
        for p, gen in zip(self.prompts, outputs):
            logits = model(self.tensor(p + gen[:-1])).logits[0, len(p) - 1:].float()
            chosen = logits.gather(-1, torch.tensor(gen, device=self.device)[:, None]).squeeze(-1)
            gaps.append(logits.max(-1).values - chosen)
        return torch.cat(gaps)

    def worst_margin(self, outputs: list[list[int]], reference: str | None = None) -> float:
        """The largest fp32 gap between a chosen token's logit and the argmax's, given its prefix."""
        return self.margins(outputs, reference).max().item()

    @staticmethod
    def margin_spread(gaps: torch.Tensor) -> dict:
        """Reported beside the worst gap, which one near tie sets where a model's outputs are
        discontinuous in its inputs (quantized activations; a router's near ties): the mean, the
        90th percentile and the share of tokens that were not fp32's argmax, which a fault that
        moves every token moves too."""
        return dict(mean_margin=round(gaps.mean().item(), 4), p90_margin=round(gaps.quantile(0.9).item(), 4),
                    not_fp32_argmax=round((gaps > 0).float().mean().item(), 4), tokens=gaps.numel())

    def rel_err(self, logits: list[torch.Tensor], reference: str | None = None) -> float:
        """The worst relative error of the prompts' last-token logits against the reference's."""
        ref = self.ref_logits[reference or next(iter(self.references))]
        return max(((g - r).norm() / r.norm()).item() for g, r in zip(logits, ref))

    @torch.inference_mode()
    def generate(self, model) -> list[list[int]]:
        """A transformers model's greedy tokens for the prompts (the control)."""
        return [model.generate(self.tensor(p), max_new_tokens=self.tokens, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist() for p in self.prompts]

    def run(self, path: str, label: str, **options) -> tuple[list[list[int]], list[torch.Tensor], dict]:
        """The engine's greedy tokens (with "graphs" in the label, requests of different lengths, so
        that batches shrink mid-run), its last-token logits for each prompt alone, and what it ran on."""
        from mini_engine import LLM, SamplingParams
        from mini_engine.runner.batch import BatchRow
        llm = LLM(path, max_num_seqs=64, **({"num_kv_blocks": 256} | options))
        params = self.greedy
        if "graphs" in label:
            params = [SamplingParams(temperature=0, max_tokens=max(1, self.tokens - 2 * i), ignore_eos=True)
                      for i in range(len(self.prompts))]
        outputs = llm.generate(self.prompts, params, use_tqdm=False)
        engine, runner = llm.engine, llm.engine.runner
        if engine.num_free_blocks != engine.block_manager.num_blocks:
            self.failures.append(f"{label}: KV blocks leaked")
        logits = []
        with torch.inference_mode():
            for p in self.prompts:
                blocks = list(range(-(-len(p) // runner.block_size)))
                t, meta = runner.prepare_inputs([BatchRow(p, 0, blocks, True, self.greedy)])
                hidden = runner.model(t.input_ids, t.positions, meta)
                logits.append(runner.model.compute_logits(hidden[t.logits_indices]).float()[0])
        info = dict(preemptions=engine.num_preemptions, kernels=sorted(runner.kernels),
                    cuda_graphs=runner.use_cuda_graphs, quantization=engine.config.quantization)
        llm.shutdown()
        del llm, engine, runner
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()
        return [o.outputs[0].token_ids for o in outputs], logits, info

    def judge_paths(self, path: str, control_model, margin: float) -> float:
        """transformers' own bf16 run (control_model) says how far bf16 rounding alone moves things.
        The engine on its Triton kernels and on its PyTorch path must then keep its last-token
        logits within 1.5x the control's relative error, and its worst greedy token within
        `margin` or 1.5x the control's worst, the limit returned for the runs after."""
        control = self.generate(control_model)
        with torch.inference_mode():
            control_err = self.rel_err([control_model(self.tensor(p)).logits[0, -1].float() for p in self.prompts])
        gaps = self.margins(control)
        control_margin = gaps.max().item()
        self.results["control"] = dict(logits_rel_err=control_err, worst_margin=control_margin, **self.margin_spread(gaps))
        limit = max(margin, 1.5 * control_margin)
        for label, options in (("kernels", {}), ("pytorch", dict(kernels="none", enforce_eager=True))):
            tokens, logits, info = self.run(path, label, **options)
            gaps = self.margins(tokens)
            err, worst = self.rel_err(logits), gaps.max().item()
            self.results[label] = dict(logits_rel_err=err, worst_margin=worst, **self.margin_spread(gaps),
                                       equal_to_control=sum(t == c for t, c in zip(tokens, control)), **info)
            if err > 1.5 * control_err:
                self.failures.append(f"{label}: logits rel err {err:.4g} > 1.5 x control {control_err:.4g}")
            self.check_margin(label, worst, limit)
        return limit

    def judge_scheduler_runs(self, path: str, limit_margin: float) -> dict[str, list[list[int]]]:
        """CUDA graphs (twice: the same tokens), eager steps, and a pool small enough to preempt,
        each judged by its worst greedy token; returns each run's tokens."""
        from benchmarks.gpu_correctness import common_prefix
        block_size = 64 if self.device == "cuda" else 16          # the engine's default
        longest = -(-(max(map(len, self.prompts)) + self.tokens) // block_size)
        runs = {"graphs": {}, "graphs again": {}, "eager steps": dict(enforce_eager=True),
                "graphs, small pool": dict(num_kv_blocks=longest + 1)}
        tokens = {}
        for label, options in runs.items():
            tokens[label], _, info = self.run(path, "graphs " + label, **options)
            gaps = self.margins(tokens[label])
            margin = gaps.max().item()
            self.results[label] = dict(worst_margin=margin, **self.margin_spread(gaps), agreeing_prefix_with_graphs=[
                common_prefix(a, b) for a, b in zip(tokens[label], tokens["graphs"])], **info)
            self.check_margin(label, margin, limit_margin)
        if tokens["graphs again"] != tokens["graphs"]:
            self.failures.append("the same run with CUDA graphs twice gave different tokens")
        if self.device == "cuda" and (not self.results["graphs"]["cuda_graphs"]
                                      or not self.results["graphs, small pool"]["preemptions"]):
            self.failures.append("graphs not used, or the small pool never preempted")
        return tokens

    def check_margin(self, label: str, margin: float, limit: float) -> None:
        if margin > limit:
            self.failures.append(f"{label}: a greedy token {margin:.3f} below fp32's argmax (limit {limit:.3f})")

    def report(self, name: str, out: str | None) -> int:
        print(json.dumps(self.results, indent=1))
        for failure in self.failures:
            print("FAILED:", failure)
        print("ALL PASSED" if not self.failures else f"{len(self.failures)} FAILED")
        if out:
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, f"{name}.json"), "w") as f:
                json.dump(dict(results=self.results, failures=self.failures), f, indent=1)
        return 1 if self.failures else 0
