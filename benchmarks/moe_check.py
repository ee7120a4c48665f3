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
import gc
import os
import random
import sys
import tempfile

import torch

from benchmarks.engine_judge import judge_arguments


def main():
    args, dev = judge_arguments("moe_check.py", lambda ap: ap.add_argument("--layers", type=int, default=4))
    from transformers import AutoModelForCausalLM

    from benchmarks.engine_judge import EngineJudge
    from mini_engine.model.random_checkpoint import QWEN3_30B_A3B, write_random_checkpoint
    config = QWEN3_30B_A3B | {"num_hidden_layers": args.layers}
    if args.cpu_dry_run:
        config |= dict(vocab_size=2048, hidden_size=64, moe_intermediate_size=32, num_experts=16,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    path = write_random_checkpoint(os.path.join(tempfile.gettempdir(), f"qwen3-moe-std006-{args.layers}-"
                                                f"{config['hidden_size']}"), config, std=0.06, seed=1, device=dev)
    rng = random.Random(0)
    prompts = [[rng.randrange(config["vocab_size"]) for _ in range(n)] for n in (5, 17, 64, 200, 333, 31, 128, 90)]

    hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").to(dev).eval()
    judge = EngineJudge(prompts, args.tokens, dev, {"fp32": hf32})
    hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").to(dev).eval()
    limit_margin = judge.judge_paths(path, hf16, args.margin)
    del hf16
    gc.collect()
    judge.judge_scheduler_runs(path, limit_margin)
    return judge.report("moe_check", args.out)


if __name__ == "__main__":
    sys.exit(main())
