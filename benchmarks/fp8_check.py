"""fp8 weights on the GPU (run on the H200; exits early without CUDA): the engine over an FP8
checkpoint (Qwen3-0.6B's shape, N(0, 0.06) weights as gpu_correctness.py's, quantized as
Qwen3-*-FP8 is: mini_engine.model.random_checkpoint.write_fp8_layout) against transformers. With
--moe-layers N, Qwen3-30B-A3B's shape cut to N of its 48 layers instead, every expert quantized as
Qwen3-30B-A3B-FP8 is (its routers listed in modules_to_not_convert, as there).

transformers' own fp8 kernels come from the `kernels` hub package, which this machine cannot
fetch, so the reference is transformers' Qwen3ForCausalLM (Qwen3MoeForCausalLM) with the
checkpoint dequantized by transformers' own code and each fp8 projection's input quantized as the
engine quantizes it (fp8_oracle): in fp32 the reference, in bf16 the control that says how far
bf16 rounding alone moves things.

1. The last prompt token's logits, the engine in bf16 on its Triton kernels and on its PyTorch
   path: relative error against the fp32 reference within 1.5x the control's.
2. Greedy tokens, teacher-forced: for each token the engine chose, the reference's largest logit
   minus the chosen one's, given the same prefix; the worst within --margin or 1.5x the control's.
3. CUDA graphs (requests of different lengths, so batches pad and shrink), eager steps, and a
   pool small enough to preempt, each judged as in 2; the graphs' run twice gives the same tokens.
4. Every fp8 product of an eager bf16 run against its reference on its own arguments: the
   projections' (fp8_linear_ref) and, with --moe-layers, the experts' (fp8_fused_moe_ref).
5. quantization="fp8" over the bf16 checkpoint: its logits and greedy margins against the
   unquantized fp32 model, reported beside the FP8 checkpoint's (not judged: its oracle is
   tests/model/test_qwen3_fp8.py's, on CPU).
6. After every run, every KV block is free.
"""
import gc
import os
import random
import sys
import tempfile
import types

import torch

from benchmarks.engine_judge import dequantized_model, judge_arguments


def quantized(x: torch.Tensor) -> torch.Tensor:
    """x's values once quantized by row groups of 128 as the engine quantizes a product's input."""
    from mini_engine.kernels.fp8_linear import dequantize_fp8_ref, quantize_fp8_ref
    q, scales = quantize_fp8_ref(x.reshape(-1, x.shape[-1]))
    return dequantize_fp8_ref(q, scales, 1).to(x.dtype).reshape(x.shape)


def quantize_input(module, args):
    """A forward pre-hook: the projection's input quantized by row groups of 128 as the engine's."""
    return (quantized(args[0]),)


def quantized_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' Qwen3MoeExperts.forward (its eager loop over the experts hit, transformers 5),
    with each expert's two inputs quantized as the engine quantizes them: the hidden rows before
    gate/up, the SwiGLU rows before down. transformers 5 holds the experts fused, gate_up_proj
    [E, 2I, H] and down_proj [E, H, I], so no pre-hook reaches an expert's projection."""
    out = torch.zeros_like(hidden_states)
    for expert in top_k_index.unique().tolist():
        top_k_pos, token_idx = torch.where(top_k_index.t() == expert)       # transformers' order: by k, then token
        gate, up = torch.nn.functional.linear(quantized(hidden_states[token_idx]),
                                              self.gate_up_proj[expert]).chunk(2, dim=-1)
        down = torch.nn.functional.linear(quantized(self.act_fn(gate) * up), self.down_proj[expert])
        out.index_add_(0, token_idx, (down * top_k_weights[token_idx, top_k_pos, None]).to(out.dtype))
    return out


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: list[int], dtype: torch.dtype):
    """W = W_fp8 x scale, one scale a block: the definition, written here apart from the engine's
    code, for a transformers that lacks its own."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (weight.float() * scale).to(dtype)


def fp8_oracle(path: str, dtype: torch.dtype, device: str, attn_implementation: str = "eager"):
    """transformers over the FP8 checkpoint at `path`, dequantized by transformers' own code
    (written once beside it), with its fp8 projections' inputs quantized (quantize_input)."""
    from safetensors import safe_open
    try:
        from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
    except ImportError:     # transformers before 5.2x has no such function (5.17 on the H200's machine)
        _dequantize_fp8_weight = dequantize_blocks
    print(f"fp8_oracle: weights dequantized by {_dequantize_fp8_weight.__module__}.{_dequantize_fp8_weight.__name__}")
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        fp8 = {name.removesuffix("_scale_inv") for name in f.keys() if name.endswith("weight_scale_inv")}

    def dequantize(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: _dequantize_fp8_weight(t, tensors[name + "_scale_inv"], [128, 128], torch.float32)
                if name in fp8 else t for name, t in tensors.items() if not name.endswith("_scale_inv")}
    model = dequantized_model(path, dequantize, dtype, attn_implementation)
    for name, module in model.named_modules():
        if f"{name}.weight" in fp8:
            module.register_forward_pre_hook(quantize_input)
        elif f"{name}.0.gate_proj.weight" in fp8 and isinstance(getattr(module, "gate_up_proj", None), torch.Tensor):
            module.forward = types.MethodType(quantized_experts_forward, module)   # fused experts
    return model.to(device).eval()


def per_call_check(path: str, prompts: list[list[int]], tokens: int, **engine_options) -> dict:
    """engine_judge.per_product_check of every fp8 product against fp8_linear_ref. Within a call
    the kernel's 1/rms may differ from torch's in its last bit and re-round a normed group (~2% of
    a bf16 output, tests/kernels/test_fp8_linear.py); a wrong tile or split is wrong by O(1)."""
    from benchmarks.engine_judge import per_product_check
    from mini_engine.kernels.fp8_linear import fp8_linear, fp8_linear_ref
    return per_product_check(path, prompts, tokens, "fp8_product", fp8_linear, fp8_linear_ref, "fp8_linear",
                             **engine_options)


def per_expert_call_check(path: str, prompts: list[list[int]], tokens: int, **engine_options) -> dict:
    """engine_judge.per_product_check of every fp8 experts' call (kernels/fp8_fused_moe.py) against
    fp8_fused_moe_ref. Within a call the gate/up rows may round to bf16 otherwise than the
    reference's (sums in fp32 in another order), and a SwiGLU value then quantizes to a
    neighbouring e4m3 value: a few percent of a bf16 output (tests/kernels/test_fp8_fused_moe.py);
    a wrong scale, block or routing weight is wrong by O(1)."""
    from benchmarks.engine_judge import per_product_check
    from mini_engine.kernels.fp8_fused_moe import fp8_fused_moe, fp8_fused_moe_ref
    from mini_engine.layers.moe import FusedExperts
    return per_product_check(path, prompts, tokens, "fp8_impl", fp8_fused_moe, fp8_fused_moe_ref, "fused_moe",
                             FusedExperts, **engine_options)


def main():
    args, dev = judge_arguments("fp8_check.py", lambda ap: ap.add_argument(
        "--moe-layers", type=int, default=0, help="Qwen3-30B-A3B's shape cut to N layers (fp8 experts); "
                                                  "0: Qwen3-0.6B's"))
    from transformers import AutoModelForCausalLM

    from benchmarks.engine_judge import EngineJudge
    from mini_engine.model.random_checkpoint import (QWEN3_0_6B, QWEN3_30B_A3B, write_fp8_layout,
                                                     write_random_checkpoint)
    moe = args.moe_layers > 0
    config = QWEN3_30B_A3B | {"num_hidden_layers": args.moe_layers} if moe else QWEN3_0_6B
    if args.cpu_dry_run:        # every projection whole 128 x 128 blocks
        config = config | dict(vocab_size=2048, hidden_size=128, intermediate_size=256, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=128, num_hidden_layers=2)
        if moe:
            config |= dict(moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2)
    tmp = tempfile.gettempdir()
    name = f"{'moe' + str(args.moe_layers) + '-' if moe else ''}{config['hidden_size']}"
    bf16 = write_random_checkpoint(os.path.join(tmp, f"qwen3-std006-fp8src-{name}"), config, std=0.06, seed=1,
                                   device=dev)
    path = os.path.join(tmp, f"qwen3-std006-fp8-{name}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        # as Qwen3-30B-A3B-FP8's config.json: lm_head and every layer's router kept out of fp8
        routers = [f"model.layers.{i}.mlp.gate" for i in range(config["num_hidden_layers"])] if moe else []
        write_fp8_layout(bf16, path, modules_to_not_convert=["lm_head", *routers] if moe else None)
    rng = random.Random(0)
    prompts = [[rng.randrange(config["vocab_size"]) for _ in range(n)] for n in (5, 17, 64, 200, 333, 31, 128, 90)]

    unquantized = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.float32, attn_implementation="eager")
    judge = EngineJudge(prompts, args.tokens, dev, {"fp8": fp8_oracle(path, torch.float32, dev),
                                                    "unquantized": unquantized.to(dev).eval()})
    control_model = fp8_oracle(path, torch.bfloat16, dev, "sdpa")
    limit_margin = judge.judge_paths(path, control_model, args.margin)
    del control_model
    gc.collect()
    tokens = judge.judge_scheduler_runs(path, limit_margin)
    checked = judge.results["per-call check"] = per_call_check(path, prompts, 4)
    if not checked["modules"] or checked["worst_rel_err"] > 0.03:
        judge.failures.append(f"per-call check: {checked}")
    if moe:
        checked = judge.results["experts' per-call check"] = per_expert_call_check(path, prompts, 4)
        # a call's SwiGLU values an ulp apart may quantize to neighbouring e4m3 values (measured in
        # bf16 on the tiny dry-run model, where the interpreter truncates to bf16: 0.042)
        if checked["modules"] != checked["of_modules"] or not checked["modules"] or checked["worst_rel_err"] > 0.1:
            judge.failures.append(f"experts' per-call check: {checked}")
    # fp32 (reported, not judged): without bf16's rounding, how far the sums' order alone moves
    # the outputs once e4m3's rounding boundaries amplify it
    fp32_kernels = "fp8_linear,fused_moe" if moe else "fp8_linear"
    for label, options in (("fp32 pytorch", dict(kernels="none")), ("fp32 fp8 kernels", dict(kernels=fp32_kernels))):
        tokens32, logits, info = judge.run(path, label, dtype="float32", enforce_eager=True, **options)
        judge.results[label] = dict(logits_rel_err=judge.rel_err(logits), worst_margin=judge.worst_margin(tokens32),
                                    **info)
    # quantization="fp8" over the bf16 checkpoint, and the bf16 engine, against the unquantized fp32 model
    for label, options in (("online fp8", dict(quantization="fp8")), ("bf16 engine", {})):
        online, logits, info = judge.run(bf16, label, **options)
        judge.results[label] = dict(logits_rel_err_vs_unquantized=judge.rel_err(logits, "unquantized"),
                                    worst_margin_vs_unquantized=judge.worst_margin(online, "unquantized"), **info)
    judge.results["fp8 checkpoint vs unquantized"] = dict(worst_margin=judge.worst_margin(tokens["graphs"],
                                                                                           "unquantized"))
    return judge.report("fp8_moe_check" if moe else "fp8_check", args.out)


if __name__ == "__main__":
    sys.exit(main())
