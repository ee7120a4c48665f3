"""load_weights and sleep mode on one GPU, with the CUDA graphs and the Triton kernels (run on a GPU;
--cpu-dry-run checks the script on CPU with a tiny model). tests/engine/test_weight_updates.py is
the same on CPU, without graphs.

Qwen3-0.6B's shape cut to --layers of its 28, two random bf16 checkpoints A and B:
  1. a fresh engine on B: its greedy tokens (the control) and its parameters;
  2. an engine on A (enable_sleep_mode): A's tokens, then load_weights with B's tensors on the GPU in
     bf16, as a trainer holds them: B's tokens, B's parameters bit for bit;
  3. sleep(level=1): the device memory it frees (mem_get_info) against the weights' and the KV pool's
     bytes; wake_up(): the same tokens (the graphs captured again), B's parameters;
  4. sleep(level=2), wake_up(tags=["weights"]), A's tensors one a call (TRL's way, norms after their
     projections), wake_up(tags=["kv_cache"]): A's tokens and parameters;
  5. an engine on B with B itself as its draft model (speculative_config, 4 tokens): its tokens and
     acceptance; sleep(level=1) frees both models' weights and both KV pools; wake_up() brings back
     the same tokens (both runners' graphs captured again) at the same acceptance.
Prints one JSON line (and writes it under --out)."""
import argparse
import json
import os
import random
import sys
import tempfile
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="folder for a JSON of the results")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--cpu-dry-run", action="store_true")
    args = ap.parse_args()
    if not args.cpu_dry_run and not torch.cuda.is_available():
        sys.exit("weight_update_check.py needs a GPU (or --cpu-dry-run)")
    from safetensors.torch import load_file

    from mini_engine import LLM, SamplingParams
    from mini_engine.layers.linear import NormedPackedLinear
    from mini_engine.model.random_checkpoint import QWEN3_0_6B, write_random_checkpoint

    dev = "cpu" if args.cpu_dry_run else "cuda"
    config = QWEN3_0_6B | {"num_hidden_layers": args.layers}
    if args.cpu_dry_run:
        config |= dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16)
    folder = tempfile.mkdtemp()
    a, b = (write_random_checkpoint(os.path.join(folder, name), config, std=0.06, seed=seed, device=dev)
            for seed, name in ((0, "a"), (1, "b")))
    rng = random.Random(0)
    prompts = [[rng.randrange(config["vocab_size"]) for _ in range(n)] for n in (5, 17, 64, 200, 333, 31, 128, 2)]
    prompts.append(prompts[4][:300] + [7, 8, 9])          # shares 300 tokens with one before it
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    options = dict(device=dev, num_kv_blocks=512, enable_sleep_mode=True)

    def tokens(llm) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    def state(llm) -> dict[str, torch.Tensor]:
        model = llm.engine.runner.model
        out = {n: p.detach().view(torch.uint8).cpu() for n, p in model.named_parameters()}
        return out | {f"{n}.g": m.folded_norm_weight.view(torch.uint8).cpu() for n, m in model.named_modules()
                      if isinstance(m, NormedPackedLinear) and m.folded_norm_weight is not None}

    def same(x: dict, y: dict) -> bool:
        return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)

    def free_bytes() -> int:
        if dev == "cpu":
            return 0
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0]

    def allocated() -> int:
        return torch.cuda.memory_allocated() if dev == "cuda" else 0

    result = {"layers": args.layers, "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu"}
    fresh_b = LLM(b, **options)
    expected_b, state_b = tokens(fresh_b), state(fresh_b)
    fresh_b.engine.runner.model.cpu()
    del fresh_b
    fresh_a = LLM(a, **options)
    expected_a, state_a = tokens(fresh_a), state(fresh_a)
    del fresh_a
    if dev == "cuda":
        torch.cuda.empty_cache()
    llm = LLM(a, **options)
    runner = llm.engine.runner
    result["cuda_graphs"] = runner.graph_runner is not None
    checks = {"A's tokens": tokens(llm) == expected_a}
    b_tensors = {name: t.to(dev) for name, t in load_file(os.path.join(b, "model.safetensors")).items()}
    start = time.perf_counter()
    llm.load_weights(b_tensors.items())
    result["load_weights_s"] = time.perf_counter() - start
    checks["update to B: B's tokens"] = tokens(llm) == expected_b
    checks["update to B: B's parameters"] = same(state(llm), state_b)

    weight_bytes = sum(s.nbytes() for s in {p.untyped_storage().data_ptr(): p.untyped_storage()
                                            for p in runner.model.parameters()}.values())
    kv_bytes = runner.kv_cache.untyped_storage().nbytes()
    before, before_allocated = free_bytes(), allocated()
    start = time.perf_counter()
    llm.sleep(level=1)
    result["sleep_1_s"] = time.perf_counter() - start
    result["freed_GiB"] = (free_bytes() - before) / 2**30
    result["allocated_freed_GiB"] = (before_allocated - allocated()) / 2**30
    result["weights_and_kv_GiB"] = (weight_bytes + kv_bytes) / 2**30
    start = time.perf_counter()
    llm.wake_up()
    result["wake_up_s"] = time.perf_counter() - start
    result["graph_capture_s"] = runner.cuda_graph_capture_s
    checks["sleep 1 / wake: B's tokens"] = tokens(llm) == expected_b
    checks["sleep 1 / wake: B's parameters"] = same(state(llm), state_b)
    if dev == "cuda":
        checks["sleep 1 freed at least the weights and the KV pool"] = (result["freed_GiB"]
                                                                        >= result["weights_and_kv_GiB"])

    before, before_allocated = free_bytes(), allocated()
    llm.sleep(level=2)
    result["freed_level_2_GiB"] = (free_bytes() - before) / 2**30
    result["allocated_freed_level_2_GiB"] = (before_allocated - allocated()) / 2**30
    llm.wake_up(tags=["weights"])
    start = time.perf_counter()
    for name, tensor in load_file(os.path.join(a, "model.safetensors")).items():
        llm.load_weights([(name, tensor.to(dev))])
    result["load_weights_one_a_call_s"] = time.perf_counter() - start
    llm.wake_up(tags=["kv_cache"])
    checks["sleep 2 / A one tensor a call: A's tokens"] = tokens(llm) == expected_a
    checks["sleep 2 / A one tensor a call: A's parameters"] = same(state(llm), state_a)
    llm.shutdown()
    del llm, runner
    if dev == "cuda":
        torch.cuda.empty_cache()

    drafted = LLM(b, speculative_config={"model": b, "num_speculative_tokens": 4}, **options)
    draft_runner = drafted.engine.draft.runner

    def acceptance() -> float:
        rate = drafted.engine.spec_decode_stats.acceptance_rate
        drafted.engine.spec_decode_stats = type(drafted.engine.spec_decode_stats)()
        return round(rate, 3)
    with_draft = tokens(drafted)
    result["draft_acceptance"] = acceptance()
    both_bytes = sum(s.nbytes() for r in (drafted.engine.runner, draft_runner)
                     for s in {p.untyped_storage().data_ptr(): p.untyped_storage()
                               for p in r.model.parameters()}.values())
    both_bytes += sum(r.kv_cache.untyped_storage().nbytes() for r in (drafted.engine.runner, draft_runner))
    result["draft_cuda_graphs"] = draft_runner.graph_runner is not None
    before, before_allocated = free_bytes(), allocated()
    before_reserved = torch.cuda.memory_reserved() if dev == "cuda" else 0
    drafted.sleep(level=1)
    result["draft_freed_GiB"] = (free_bytes() - before) / 2**30
    result["draft_allocated_freed_GiB"] = (before_allocated - allocated()) / 2**30
    result["draft_reserved_freed_GiB"] = (before_reserved - (torch.cuda.memory_reserved() if dev == "cuda" else 0)) / 2**30
    result["draft_weights_and_kv_GiB"] = both_bytes / 2**30
    drafted.wake_up()
    checks["with a draft model, sleep 1 / wake: the same tokens"] = tokens(drafted) == with_draft
    result["draft_acceptance_after_wake"] = acceptance()
    checks["with a draft model, sleep 1 / wake: the same acceptance"] = (
        result["draft_acceptance_after_wake"] == result["draft_acceptance"] > 0.5)
    if dev == "cuda":
        checks["with a draft model, sleep 1 freed both models' weights and KV pools"] = (
            result["draft_freed_GiB"] >= result["draft_weights_and_kv_GiB"])
        checks["with a draft model, sleep 1 gave the allocator both models' weights and KV pools"] = (
            result["draft_allocated_freed_GiB"] >= result["draft_weights_and_kv_GiB"])
    drafted.shutdown()
    result["checks"] = checks
    result["passed"] = all(checks.values())
    line = json.dumps(result)
    print(line)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "weight_update_check.json"), "w") as f:
            f.write(line + "\n")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
