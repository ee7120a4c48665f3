"""Speculative decoding by n-gram lookup on the GPU (speculative_config, mini_engine/speculative.py):
the same tokens as plain decoding, and what it does to a request's speed (--cpu-dry-run checks
the script on CPU with a tiny model). With --draft-model PATH (or "self": each checkpoint drafts for
itself, so every draft is right and the draft costs what the target does), the same checks and
timings with a draft model (runner/draft_model.py) in place of the n-gram lookup.

Correctness, on gpu_correctness.py's checkpoint (Qwen3-0.6B's shape, N(0, 0.06) weights, whose
greedy outputs vary), in bf16 with CUDA graphs, against the same engine without drafts:
  1. greedy, 8 prompts of 5-1,000 tokens, together (a graph of 8 rows with drafts, more without)
     and 3 of them (padded graphs); 2. seeded sampling (temperature 0.8, a seed a request);
  3. greedy in a pool small enough to preempt. Each must equal plain decoding token for token,
     or, where bf16's different batch shapes tip a near tie, every token of the speculative run must
     be within --margin logits of transformers fp32's argmax given the same prefix (teacher-forced),
     no worse than transformers' own bf16 greedy output (the control); a seeded output, where it
     first parts from plain decoding's, must part between tokens that lie within
     SAMPLED_CDF_GAP_LIMIT of each other in fp32's CDF (cdf_gap). Every run ends with all KV
     blocks free.
Speed: one request (and four), 512 greedy tokens after a 512-token prompt, plain decoding with and
without async scheduling, then with drafts, on two checkpoints: the std 0.06 one, whose outputs
rarely repeat (the drafts are mostly wrong: what a verifying step costs), and the benchmark's
std 0.02 one, whose greedy outputs repeat one token (the drafts are right: the most they give).
Each timing is the fastest of three runs, with the prefix cache off. With a draft model, a third
pair shows what drafting is for, a draft much cheaper than its target that the target agrees with:
the target is the std 0.02 checkpoint deepened --deep-target times (deepened_checkpoint: its layers
again, with their outputs zeroed, so each adds a layer's cost and nothing to the residual), and the
std 0.02 checkpoint drafts for it (random weights give no real pair of models that agree).
--tensor-parallel-size 2 --speed-only times the engines split over two GPUs, the draft whole on
rank 0's (--deep-only: the deepened pair alone)."""
import argparse
import dataclasses
import json
import os
import random
import sys
import time

import torch

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
# A wrong draw lands anywhere in [0, 1) of the CDF: two such draws are within 0.02 of each other
# with probability ~0.04, so eight sequences all within it by chance are ~1e-11.
SAMPLED_CDF_GAP_LIMIT = 0.02


def cdf_gap(logits: "torch.Tensor", a: int, b: int) -> float:
    """The probability mass, under softmax(logits) in fp64, between tokens a and b in the
    vocabulary's order (the columns before the later one, less those before the earlier one)."""
    p = torch.softmax(logits.double(), -1)
    low, high = sorted((a, b))
    return p[low:high].sum().item()


def deepened_checkpoint(source: str, folder: str, factor: int) -> str:
    """source's model with factor times its layers: after its own, copies of them whose attention
    and MLP outputs are zero (o_proj and down_proj), so that each adds nothing to the residual and
    costs what a layer costs. Its greedy outputs are source's (up to bf16's batch shapes)."""
    from safetensors.torch import load_file, save_file
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    layers = config["num_hidden_layers"]
    weights = {}
    for name in sorted(os.listdir(source)):
        if name.endswith(".safetensors"):
            weights |= load_file(os.path.join(source, name))
    for layer in range(layers, factor * layers):
        prefix, like = f"model.layers.{layer}.", f"model.layers.{layer % layers}."
        for name, tensor in list(weights.items()):
            if name.startswith(like):
                zero = name.endswith(("o_proj.weight", "down_proj.weight"))
                weights[prefix + name[len(like):]] = torch.zeros_like(tensor) if zero else tensor.clone()
    os.makedirs(folder, exist_ok=True)
    save_file(weights, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config | {"num_hidden_layers": factor * layers}, f)
    return folder


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="folder for a JSON of the results")
    ap.add_argument("--tokens", type=int, default=128, help="greedy tokens a request in the correctness runs")
    ap.add_argument("--margin", type=float, default=0.25)
    ap.add_argument("--cpu-dry-run", action="store_true")
    ap.add_argument("--speed-only", action="store_true", help="skip the correctness runs")
    ap.add_argument("--draft-model", default=None, help="a draft model's folder, or 'self', in place of ngram")
    ap.add_argument("--deep-target", type=int, default=4,
                    help="with a draft model: the deepened target's layers, as a multiple of the draft's")
    ap.add_argument("--deep-only", action="store_true", help="with a draft model: time the deepened target only")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="split the engines over this many GPUs (the draft runs whole on rank 0's); "
                         "with --speed-only only: the correctness runs compare with transformers on one GPU")
    args = ap.parse_args()
    if not args.cpu_dry_run and not torch.cuda.is_available():
        sys.exit("spec_decode_check.py needs a GPU (or --cpu-dry-run)")
    from transformers import Qwen3ForCausalLM

    from benchmarks.gpu_correctness import common_prefix, free_gpu, std006_checkpoint
    from mini_engine import LLM, SamplingParams
    from mini_engine.model.random_checkpoint import default_checkpoint
    from mini_engine.speculative import SpecDecodeStats

    dev = "cpu" if args.cpu_dry_run else "cuda"
    path, config = std006_checkpoint(args.cpu_dry_run, dev)
    rng = random.Random(0)
    vocab = config["vocab_size"]
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (5, 17, 64, 200, 333, 1000)]
    # Two that repeat a pattern, so that the proposer finds drafts in the prompt itself.
    prompts += [[rng.randrange(vocab) for _ in range(n)] * r for n, r in ((8, 4), (32, 8))]
    results, failures = {}, []
    # Pools of a given size (512 blocks of 64: 32k tokens, 3.8 GB), not sized from free memory: the
    # engines made one after another here are not all freed (LLMEngine freezes the heap it starts with).
    engine_kwargs = dict(device=dev, max_num_seqs=64, max_model_len=2048, num_kv_blocks=512,
                         tensor_parallel_size=args.tensor_parallel_size)
    if args.tensor_parallel_size > 1 and not args.speed_only:
        sys.exit("--tensor-parallel-size needs --speed-only")

    def engine(model, **kw):
        llm = LLM(model, **(engine_kwargs | kw))
        if dev == "cuda":       # as if the pool were uninitialised: a stale slot read shows as NaN
            llm.engine.runner.kv_cache.fill_(float("nan"))
            if llm.engine.draft is not None:
                llm.engine.draft.runner.kv_cache.fill_(float("nan"))
        return llm

    def speculative(model, draft=None) -> dict:
        if args.draft_model is None:
            return NGRAM
        return {"method": "draft_model", "num_speculative_tokens": NGRAM["num_speculative_tokens"],
                "model": draft or (model if args.draft_model == "self" else args.draft_model)}

    def generate(llm, batch, params):
        outs = llm.generate(batch, params, use_tqdm=False)
        e = llm.engine
        if e.num_free_blocks != e.block_manager.num_blocks:
            failures.append(f"{e.block_manager.num_blocks - e.num_free_blocks} KV blocks leaked")
        return [o.outputs[0].token_ids for o in outs]

    def check(label: str, path: str) -> None:
        """The correctness runs on one checkpoint, each judged against plain decoding."""
        # transformers fp32, the teacher-forced judge's reference, and its bf16 greedy run, the control.
        hf32 = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").to(dev).eval()
        with torch.inference_mode():
            hf16 = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").to(dev).eval()
            control = [hf16.generate(torch.tensor([p], device=dev), max_new_tokens=args.tokens, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
        del hf16
        free_gpu()

        @torch.inference_mode()
        def fp32_logits(prompt, gen):
            return hf32(torch.tensor([prompt + gen[:-1]], device=dev)).logits[0, len(prompt) - 1:].float()

        def worst_margin(batch, outputs) -> float:
            """The largest fp32 max logit minus the logit of the token chosen, given the same prefix."""
            worst = 0.0
            for p, gen in zip(batch, outputs):
                logits = fp32_logits(p, gen)
                chosen = logits.gather(-1, torch.tensor(gen, device=dev)[:, None]).squeeze(-1)
                worst = max(worst, (logits.max(-1).values - chosen).max().item())
            return worst

        control_margin = worst_margin(prompts, control)
        limit = max(args.margin, 1.5 * control_margin)
        results[f"{label}: transformers bf16 greedy (control)"] = dict(worst_margin=round(control_margin, 4))

        def judge(name, batch, got, want, greedy=True, stats=None, temperature=None):
            agree = [common_prefix(g, w) for g, w in zip(got, want)]
            same = all(g == w for g, w in zip(got, want))
            entry = dict(identical=same, agree=agree)
            if not same and greedy:
                entry["worst_margin"], entry["limit"] = round(worst_margin(batch, got), 4), round(limit, 4)
                # Where the two first part: the fp32 logits of plain decoding's token and ours.
                entry["fp32_gap_at_first_difference"] = [
                    round((logits[d, w[d]] - logits[d, g[d]]).item(), 4)
                    for p, g, w, d in zip(batch, got, want, agree) if d < len(w)
                    for logits in [fp32_logits(p, w)]]
            if not same and not greedy:
                # The sampler draws by inverse CDF, one uniform a token, over the vocabulary's order:
                # where the probabilities are near flat (151,936 columns), bf16's other batch shapes
                # move a column's edge past the uniform often. A draw from the wrong stream, or of the
                # wrong row, picks a token anywhere instead. So where the two first part, the fp32
                # probability mass between the two tokens' places in that order must be small.
                entry["fp32_cdf_gap_at_first_difference"] = [
                    round(cdf_gap(fp32_logits(p, w)[d] / temperature, w[d], g[d]), 6)
                    for p, g, w, d in zip(batch, got, want, agree) if d < min(len(w), len(g))]
                entry["limit"] = SAMPLED_CDF_GAP_LIMIT
            entry["ok"] = same or (entry["worst_margin"] <= limit if greedy
                                   else max(entry["fp32_cdf_gap_at_first_difference"]) <= SAMPLED_CDF_GAP_LIMIT)
            if stats is not None:
                entry["drafts"] = dataclasses.asdict(stats)
            results[f"{label}: {name}"] = entry
            if not entry["ok"]:
                failures.append(f"{label}: {name}: {entry}")

        plain, spec = engine(path), engine(path, speculative_config=speculative(path))
        greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        for name, batch in (("8 prompts", prompts), ("3 prompts", prompts[1:4])):
            spec.engine.spec_decode_stats = SpecDecodeStats()
            judge(f"greedy, {name}", batch, generate(spec, batch, greedy), generate(plain, batch, greedy),
                  stats=spec.engine.spec_decode_stats)
        seeded = [SamplingParams(temperature=0.8, seed=i, max_tokens=args.tokens, ignore_eos=True)
                  for i in range(len(prompts))]
        spec.engine.spec_decode_stats = SpecDecodeStats()
        judge("seeded sampling, 8 prompts", prompts, generate(spec, prompts, seeded), generate(plain, prompts, seeded),
              greedy=False, stats=spec.engine.spec_decode_stats, temperature=seeded[0].temperature)
        del spec
        free_gpu()
        # Drafts once three requests are left: asynchronous steps without them first (and graphs of
        # more rows), then synchronous ones with them.
        later = engine(path, speculative_config=speculative(path) | {"disable_by_batch_size": 3})
        staggered = [SamplingParams(temperature=0, max_tokens=args.tokens // 4 * (1 + i % 4), ignore_eos=True)
                     for i in range(len(prompts))]
        judge("greedy, drafts below 3 requests", prompts, generate(later, prompts, staggered),
              generate(plain, prompts, staggered), stats=later.engine.spec_decode_stats)
        del later
        free_gpu()
        # Every prompt's blocks and four more: all are admitted, and their outputs outgrow the pool.
        block_size = 16 if args.cpu_dry_run else 64
        num_blocks = sum(-(-len(p) // block_size) for p in prompts) + 4
        small = engine(path, speculative_config=speculative(path), num_kv_blocks=num_blocks, block_size=block_size)
        judge("greedy, a pool that preempts", prompts, generate(small, prompts, greedy),
              generate(plain, prompts, greedy), stats=small.engine.spec_decode_stats)
        results[f"{label}: greedy, a pool that preempts"]["preemptions"] = small.engine.num_preemptions
        if small.engine.num_preemptions == 0:
            failures.append(f"{label}: the small pool did not preempt")
        del small, plain, hf32
        free_gpu()

    # (A dry run has one tiny checkpoint: it is checked once.)
    bench_checkpoint = path if args.cpu_dry_run else default_checkpoint(device=dev)
    if not args.speed_only:
        check("std 0.06", path)
    if not args.cpu_dry_run and not args.speed_only:
        check("std 0.02 (bench.py's)", bench_checkpoint)

    # Speed: one request and four, 512 greedy tokens after a 512-token prompt.
    speed, drafting = {}, "ngram" if args.draft_model is None else "draft model"
    pairs = [] if args.deep_only else [("std 0.06", path, None), ("std 0.02 (bench.py's)", bench_checkpoint, None)]
    if args.draft_model is not None:
        deep = deepened_checkpoint(bench_checkpoint, bench_checkpoint.rstrip("/") + f"-deepened-{args.deep_target}",
                                   args.deep_target)
        pairs.append((f"std 0.02 deepened {args.deep_target}x, std 0.02 drafting", deep, bench_checkpoint))
    params = SamplingParams(temperature=0, max_tokens=512, ignore_eos=True)
    for label, model, draft in pairs:
        batches = {num: [[rng.randrange(vocab) for _ in range(512)] for _ in range(num)] for num in (1, 4)}
        rows, plain_outs = {num: {} for num in batches}, {}
        # One engine at a time: a process holds one tensor-parallel engine.
        for options, kinds in (({}, (("plain", True), ("plain, synchronous", False))),
                               ({"speculative_config": speculative(model, draft)}, ((drafting, True),))):
            llm = engine(model, enable_prefix_caching=False, **options)
            if llm.engine.draft is not None and llm.engine.draft.runner.cuda_graph_pool_bytes is not None:
                # Not set aside when the target's pool was sized (DraftModel.reserved_bytes): what it takes.
                results[f"{label}: draft's CUDA graph pool MiB"] = dict(
                    mib=round(llm.engine.draft.runner.cuda_graph_pool_bytes / 2**20, 1))
            for num, batch in batches.items():
                row = rows[num]
                for kind, asynchronous in kinds:
                    llm.engine.config.async_scheduling = asynchronous
                    generate(llm, batch, params)       # warm-up
                    llm.engine.spec_decode_stats = SpecDecodeStats()
                    if llm.engine.draft is not None:
                        llm.engine.draft.ahead_counts.clear()
                    walls = []
                    for _ in range(3):
                        start = time.perf_counter()
                        outs = generate(llm, batch, params)
                        walls.append(time.perf_counter() - start)
                    tokens = sum(len(o) for o in outs)
                    row[kind] = dict(wall_s=round(min(walls), 4), out_tok_s=round(tokens / min(walls), 1),
                                     ms_per_token_a_request=round(1000 * min(walls) / (tokens / num), 4))
                    if kind == drafting:
                        s = llm.engine.spec_decode_stats
                        row[kind] |= dict(acceptance_rate=round(s.acceptance_rate, 3),
                                          mean_acceptance_length=round(s.mean_acceptance_length, 3),
                                          accepted_per_position=s.accepted_per_position)
                        if llm.engine.draft is not None:    # what launch_ahead started, and what was used
                            row[kind]["ahead"] = dict(llm.engine.draft.ahead_counts)
                        row["outputs equal"] = outs == plain_outs[num]
                    elif asynchronous:
                        plain_outs[num] = outs
            llm.shutdown()            # (the other ranks' processes, under tensor parallelism)
            del llm
            free_gpu()
        for num, row in rows.items():
            row["speedup vs plain"] = round(row["plain"]["wall_s"] / row[drafting]["wall_s"], 3)
            speed[f"{label}, {num} request{'s' if num > 1 else ''}"] = row
    results["speed"] = speed
    for name, r in results.items():
        if name == "speed":
            for case, row in r.items():
                print(f"speed: {case:32s} {json.dumps(row)}")
        else:
            print(f"{name:40s} {'PASS' if r.get('ok', True) else 'FAIL'}  {r}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "spec_decode_check.json"), "w") as f:
            json.dump(dict(results=results, failures=failures), f, indent=1)
    print("FAILURES:" if failures else "ALL PASSED", *failures, sep="\n  ")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
