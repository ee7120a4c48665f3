"""AWQ weights on the GPU (run on the H200; exits early without CUDA): the engine over an AWQ
checkpoint (Qwen3-0.6B's shape, N(0, 0.06) weights as gpu_correctness.py's, rounded to 4 bits in
groups of 128 as Qwen3-*-AWQ is laid out: mini_engine.model.random_checkpoint.write_awq_layout)
against transformers.

transformers reads AWQ checkpoints through autoawq or gptqmodel, which this machine does not have,
so the reference (awq_oracle) is transformers' Qwen3ForCausalLM over the checkpoint dequantized
by AutoAWQ's definition, written here apart from the engine's code: W^T = (q - z) * s. AWQ
quantizes no activation, so the model is continuous in its inputs, and the engine in fp32 on
its PyTorch path computes what the reference does.

1. The last prompt token's logits, the engine in bf16 on its Triton kernels and on its PyTorch
   path: relative error against the fp32 reference within 1.5x the control's (transformers' own
   bf16 run of the dequantized model).
2. Greedy tokens, teacher-forced against the reference; the worst within --margin or 1.5x the control's.
3. CUDA graphs (requests of different lengths, so batches pad and shrink), eager steps, and a
   pool small enough to preempt, each judged as in 2; the graphs' run twice gives the same tokens.
4. Every AWQ product of an eager bf16 run (the fused kernel at decode, the dequantize launch and
   cuBLAS at prefill) against awq_linear_ref on its own arguments.
5. After every run, every KV block is free.
"""
import os
import random
import sys
import tempfile

import torch

from benchmarks.engine_judge import dequantized_model, judge_arguments

# AutoAWQ's packing order: nibble i of a word holds column AUTOAWQ_ORDER[i] of its eight.
AUTOAWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_autoawq(words: torch.Tensor) -> torch.Tensor:
    """[R, C / 8] int32 -> [R, C] values 0..15, by AutoAWQ's order."""
    columns = torch.empty(words.shape[0], words.shape[1] * 8, dtype=torch.int64)
    for nibble, column in enumerate(AUTOAWQ_ORDER):
        columns[:, column::8] = (words.to(torch.int64) >> (4 * nibble)) & 0xF
    return columns


def awq_oracle(path: str, dtype: torch.dtype, device: str, attn_implementation: str = "eager"):
    """transformers over the AWQ checkpoint at `path`, each projection's weight dequantized
    (written once beside it, in fp32) as nn.Linear's [out, in]."""
    def dequantize(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in tensors.items():
            if name.endswith(".qweight"):
                module = name.removesuffix(".qweight")
                scales = tensors[f"{module}.scales"].float()
                group = t.shape[0] // scales.shape[0]
                zeros = unpack_autoawq(tensors[f"{module}.qzeros"]).repeat_interleave(group, 0)
                weight_t = (unpack_autoawq(t) - zeros) * scales.repeat_interleave(group, 0)
                out[f"{module}.weight"] = weight_t.t().contiguous()
            elif not name.endswith((".qzeros", ".scales")):
                out[name] = t
        return out
    return dequantized_model(path, dequantize, dtype, attn_implementation).to(device).eval()


def per_call_check(path: str, prompts: list[list[int]], tokens: int, **engine_options) -> dict:
    """engine_judge.per_product_check of every AWQ product (the fused kernel and the dequantize
    launch with cuBLAS) against awq_linear_ref; a wrong tile, group or split is wrong by O(1)."""
    from benchmarks.engine_judge import per_product_check
    from mini_engine.kernels.awq_linear import awq_linear, awq_linear_ref
    return per_product_check(path, prompts, tokens, "awq_product", awq_linear, awq_linear_ref, "awq_linear",
                             **engine_options)


def main():
    args, dev = judge_arguments("awq_check.py")
    from benchmarks.engine_judge import EngineJudge
    from mini_engine.model.random_checkpoint import QWEN3_0_6B, write_awq_layout, write_random_checkpoint
    config = QWEN3_0_6B
    if args.cpu_dry_run:
        config = QWEN3_0_6B | dict(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=128)
    tmp = tempfile.gettempdir()
    bf16 = write_random_checkpoint(os.path.join(tmp, f"qwen3-std006-awqsrc-{config['hidden_size']}"), config,
                                   std=0.06, seed=1, device=dev)
    path = os.path.join(tmp, f"qwen3-std006-awq-{config['hidden_size']}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        write_awq_layout(bf16, path)
    rng = random.Random(0)
    prompts = [[rng.randrange(config["vocab_size"]) for _ in range(n)] for n in (5, 17, 64, 200, 333, 31, 128, 90)]

    judge = EngineJudge(prompts, args.tokens, dev, {"awq": awq_oracle(path, torch.float32, dev)})
    control_model = awq_oracle(path, torch.bfloat16, dev, "sdpa")
    limit_margin = judge.judge_paths(path, control_model, args.margin)
    del control_model
    judge.judge_scheduler_runs(path, limit_margin)
    checked = judge.results["per-call check"] = per_call_check(path, prompts, 4)
    # bf16 products: a wrong tile or group is wrong by O(1); the sums' order moves the last bit
    if not checked["modules"] or checked["worst_rel_err"] > 0.02 or checked["most_rows"] < 256:
        judge.failures.append(f"per-call check: {checked}")
    tokens32, logits, info = judge.run(path, "fp32 pytorch", dtype="float32", enforce_eager=True, kernels="none")
    judge.results["fp32 pytorch"] = dict(logits_rel_err=judge.rel_err(logits),
                                         worst_margin=judge.worst_margin(tokens32), **info)
    return judge.report("awq_check", args.out)


if __name__ == "__main__":
    sys.exit(main())
