"""Embeddings on the GPU (runner="pooling", LLM.embed), end to end: agreement with transformers'
Qwen3Model, and the speed of embedding the benchmark's 256 prompts (--cpu-dry-run checks the script
on CPU with a tiny model).

The checkpoint is gpu_correctness.py's (Qwen3-0.6B's shape, N(0, 0.06) weights) laid out as
Qwen3-Embedding's (no lm_head, no "model." prefix). The reference is transformers' fp32 Qwen3Model
(eager attention); each run's error is the largest |ours - reference| over every value of every
normalised embedding. Each run is judged against a control that says how far its precision alone
moves transformers' own: a bf16 run against transformers in bf16; the fp32 run (whose attention
dots take Triton's default, TF32) against transformers in fp32 with TF32 products. A run passes at
most 1.5x its control's error, plus 1e-4. The runs:
  1. fp32, LAST, prompts in chunks of at most 512 tokens.
  2. bf16 (the engine's default), LAST.
  3. bf16, MEAN, chunks of 512 tokens in a pool small enough to preempt.
  4. bf16, LAST, prompts sharing a 640-token prefix, embedded twice: the second time the prefix
     cache serves the prefix (hits are required).
  5. a cross-encoder (Qwen3-Reranker's conversion, two classifier tokens by id), bf16, chunks of
     512: LLM.score of a query against 14 documents, each score (the second token's probability)
     against transformers' Qwen3ForCausalLM's, in fp32 (control: in bf16).
Then the benchmark's 256 prompts (142,827 tokens; bench.make_workload) are embedded in bf16, three
times after a warm-up, with the prefix cache off (else every run after the first finds all but each
prompt's last block in it), and the fastest run is appended to benchmarks/results.jsonl (workload
"embed"), with the matrix products' FLOPs a second it reached; so is transformers' Qwen3Model doing
the same (bf16, SDPA attention, batches of 32 prompts sorted by length, right-padded, each
prompt's last real token pooled), the peer. Every run must end with all KV blocks free."""
import argparse
import gc
import json
import os
import random
import sys
import time
from datetime import datetime, timezone

import torch
import torch.nn.functional as F


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="folder for a JSON of the results")
    ap.add_argument("--results", default=os.path.join(os.path.dirname(__file__), "results.jsonl"))
    ap.add_argument("--cpu-dry-run", action="store_true")
    args = ap.parse_args()
    if not args.cpu_dry_run and not torch.cuda.is_available():
        sys.exit("embedding_check.py needs a GPU (or --cpu-dry-run)")
    from transformers import Qwen3Model

    from bench import git_commit, make_workload
    from benchmarks.gpu_correctness import std006_checkpoint
    from mini_engine import LLM
    from mini_engine.model.random_checkpoint import write_embedding_layout

    dev = "cpu" if args.cpu_dry_run else "cuda"
    source, config = std006_checkpoint(args.cpu_dry_run, dev)
    path = write_embedding_layout(source, source + "-embedding")
    rng = random.Random(0)
    prompts = [[rng.randrange(config["vocab_size"]) for _ in range(n)]
               for n in (5, 17, 64, 200, 333, 1000, 31, 128, 2, 45, 700, 90, 12, 1500)]
    prefix = [rng.randrange(config["vocab_size"]) for _ in range(640)]
    shared = [prefix + [rng.randrange(config["vocab_size"]) for _ in range(n)] for n in (1, 7, 64, 300)]

    @torch.inference_mode()
    def reference(dtype: torch.dtype, pooling: str, batch: list[list[int]], tf32: bool = False) -> list[torch.Tensor]:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        model = Qwen3Model.from_pretrained(path, dtype=dtype, attn_implementation="eager").to(dev).eval()
        out = []
        for p in batch:
            hidden = model(torch.tensor([p], device=dev)).last_hidden_state[0].float()
            out.append(F.normalize(hidden[-1] if pooling == "LAST" else hidden.mean(0), dim=0).cpu())
        torch.backends.cuda.matmul.allow_tf32 = False
        del model
        free()
        return out

    def error(got: list, expected: list[torch.Tensor]) -> float:
        return max((torch.as_tensor(g, dtype=torch.float32) - e).abs().max().item() for g, e in zip(got, expected))

    def engine(**kwargs) -> "LLM":
        return LLM(path, device=dev, runner="pooling", max_model_len=2048, **kwargs)

    def embed(llm, batch, params=None) -> list[list[float]]:
        outputs = llm.embed(batch, params, use_tqdm=False)
        if llm.engine.num_free_blocks != llm.engine.block_manager.num_blocks:
            failures.append(f"KV blocks leaked ({llm.engine.num_free_blocks} of {llm.engine.block_manager.num_blocks})")
        return [o.outputs.embedding for o in outputs]

    results, failures = {}, []

    def judge(name: str, err: float, control: float, **extra) -> None:
        limit = 1.5 * control + 1e-4
        results[name] = dict(error=err, control=control, limit=limit, ok=err <= limit, **extra)
        if err > limit:
            failures.append(f"{name}: {err:.3g} > {limit:.3g} (control {control:.3g})")

    # Controls (and the reference), before any engine holds the GPU's memory for its KV pool.
    refs = {(pooling, tuple(map(len, batch))): reference(torch.float32, pooling, batch)
            for pooling, batch in (("LAST", prompts), ("MEAN", prompts), ("LAST", shared))}
    ref = lambda pooling, batch: refs[(pooling, tuple(map(len, batch)))]      # noqa: E731
    control_tf32 = error(reference(torch.float32, "LAST", prompts, tf32=True), ref("LAST", prompts))
    control_bf16 = {pooling: error(reference(torch.bfloat16, pooling, prompts), ref(pooling, prompts))
                    for pooling in ("LAST", "MEAN")}

    llm = engine(dtype="float32", max_num_batched_tokens=512)
    judge("1. fp32 LAST, chunks of 512", error(embed(llm, prompts), ref("LAST", prompts)), control_tf32)
    del llm
    free()
    llm = engine()
    judge("2. bf16 LAST", error(embed(llm, prompts), ref("LAST", prompts)), control_bf16["LAST"])
    embed(llm, shared)
    before = llm.engine.prefix_cache_hit_tokens
    err = error(embed(llm, shared), ref("LAST", shared))
    hits = llm.engine.prefix_cache_hit_tokens - before
    judge("4. bf16 LAST, shared prefix from the cache", err, control_bf16["LAST"], hit_tokens=hits)
    if hits == 0:
        failures.append("4: the prefix cache served nothing")
    del llm
    free()
    block = 64 if dev == "cuda" else 16
    llm = engine(max_num_batched_tokens=512, num_kv_blocks=-(-max(map(len, prompts)) // block) + 1,
                 pooler_config={"pooling_type": "MEAN"})
    err = error(embed(llm, prompts), ref("MEAN", prompts))
    judge("3. bf16 MEAN, chunks of 512, small pool", err, control_bf16["MEAN"],
          preemptions=llm.engine.num_preemptions)
    if llm.engine.num_preemptions == 0:
        failures.append("3: the small pool did not preempt")
    del llm
    free()
    classifier = (config["vocab_size"] // 3, config["vocab_size"] // 2)
    query = prompts[4]
    scorer = LLM(source, device=dev, runner="pooling", max_model_len=2048, max_num_batched_tokens=512,
                 pooler_config={"classifier_token_ids": classifier})
    got = [o.outputs.score for o in scorer.score(query, prompts, use_tqdm=False)]
    leaked = scorer.engine.num_free_blocks != scorer.engine.block_manager.num_blocks
    del scorer
    free()
    pair_refs = {dtype: pair_scores(source, dtype, [query + p for p in prompts], classifier, dev)
                 for dtype in (torch.float32, torch.bfloat16)}
    error_of = lambda scores: max(abs(a - b) for a, b in zip(scores, pair_refs[torch.float32]))   # noqa: E731
    judge("5. cross-encoder scores, bf16, chunks of 512", error_of(got), error_of(pair_refs[torch.bfloat16]))
    if leaked:
        failures.append("5: KV blocks leaked")

    # Speed: the benchmark's prompts, as one LLM.embed call.
    workload, _ = make_workload(8 if args.cpu_dry_run else None)
    workload = [[t % config["vocab_size"] for t in p] for p in workload]
    llm = engine(enable_prefix_caching=False)
    embed(llm, workload[:16])                       # warm-up: first launches, Triton's compiles
    walls = []
    for _ in range(3):
        sync()
        start = time.perf_counter()
        embed(llm, workload)
        sync()
        walls.append(time.perf_counter() - start)
    tokens = sum(map(len, workload))
    flops = forward_flops(config, list(map(len, workload)))
    commit, dirty = git_commit()
    import triton
    record = {"time": datetime.now(timezone.utc).isoformat(timespec="seconds"), "engine": "mini",
              "label": "embedding_check: LLM.embed of the benchmark's prompts, bf16, LAST", "workload": "embed",
              "cpu_smoke": args.cpu_dry_run, "git_commit": commit, "git_dirty": dirty,
              "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
              "triton": triton.__version__, "num_seqs": len(workload), "input_tokens": tokens, "output_tokens": 0,
              "wall_s": min(walls), "walls_s": walls, "input_tok_s": tokens / min(walls),
              "matmul_flops": flops, "achieved_TFLOPs": flops / min(walls) / 1e12,
              "checks": {"kv_blocks_free": llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks}}
    results["speed"] = dict(wall_s=walls, tokens=tokens, tok_s=tokens / min(walls), TFLOPs=flops / min(walls) / 1e12)
    print(f"embedded {len(workload)} prompts, {tokens:,} tokens: {min(walls):.3f} s, {tokens / min(walls):,.0f} tok/s, "
          f"{flops / min(walls) / 1e12:.0f} TFLOP/s of matrix products (runs: {', '.join(f'{w:.3f}' for w in walls)})")
    del llm
    free()
    hf_walls = hf_embedding_walls(path, workload, dev)
    peer = record | {"engine": "hf", "label": "embedding_check: transformers Qwen3Model bf16 sdpa, batches of 32",
                     "wall_s": min(hf_walls), "walls_s": hf_walls, "input_tok_s": tokens / min(hf_walls),
                     "achieved_TFLOPs": flops / min(hf_walls) / 1e12, "checks": {}}
    results["speed, transformers"] = dict(wall_s=hf_walls, tok_s=tokens / min(hf_walls))
    print(f"transformers: {min(hf_walls):.3f} s, {tokens / min(hf_walls):,.0f} tok/s "
          f"(runs: {', '.join(f'{w:.3f}' for w in hf_walls)})")
    if not args.cpu_dry_run:
        with open(args.results, "a") as f:
            f.write(json.dumps(record) + "\n" + json.dumps(peer) + "\n")
    for name, r in results.items():
        print(f"{name:45s} {'PASS' if r.get('ok', True) else 'FAIL'}  {r}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "embedding_check.json"), "w") as f:
            json.dump(dict(results=results, failures=failures, record=record), f, indent=1)
    print("FAILURES:" if failures else "ALL PASSED", *failures, sep="\n  ")
    return 1 if failures else 0


@torch.inference_mode()
def hf_embedding_walls(path: str, workload: list[list[int]], dev: str, batch: int = 32) -> list[float]:
    """transformers' Qwen3Model embedding the workload, as a Sentence Transformers user would run
    it: bf16, SDPA, batches of `batch` prompts sorted by length (less padding), right-padded, the
    last real token's state pooled and normalised. Two runs after a warm-up batch."""
    from transformers import Qwen3Model
    model = Qwen3Model.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").to(dev).eval()
    ordered = sorted(workload, key=len)
    batches = [ordered[i:i + batch] for i in range(0, len(ordered), batch)]

    def run(chunks):
        for chunk in chunks:
            width = max(map(len, chunk))
            ids = torch.tensor([p + [0] * (width - len(p)) for p in chunk], device=dev)
            mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in chunk], device=dev)
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            last = torch.tensor([len(p) - 1 for p in chunk], device=dev)
            F.normalize(hidden[torch.arange(len(chunk), device=dev), last].float(), dim=-1).cpu()
    run(batches[-1:])
    walls = []
    for _ in range(2):
        sync()
        start = time.perf_counter()
        run(batches)
        sync()
        walls.append(time.perf_counter() - start)
    del model
    free()
    return walls


@torch.inference_mode()
def pair_scores(path: str, dtype: torch.dtype, prompts: list[list[int]], classifier: tuple[int, int],
                dev: str) -> list[float]:
    """transformers' Qwen3ForCausalLM as a cross-encoder: the second classifier token's probability
    against the first's, at each prompt's last token."""
    from transformers import Qwen3ForCausalLM
    model = Qwen3ForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").to(dev).eval()
    scores = [model(torch.tensor([p], device=dev)).logits[0, -1, list(classifier)].float().softmax(-1)[1].item()
              for p in prompts]
    del model
    free()
    return scores


def forward_flops(config: dict, lengths: list[int]) -> float:
    """The matrix products' FLOPs of a forward pass over prompts of these lengths: the layers'
    projections (2 per weight a token) and causal attention's two products (each L^2/2 dots of
    head_dim a head), no lm_head (an embedding model has none)."""
    h, i, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    hq, hkv, layers = config["num_attention_heads"], config["num_key_value_heads"], config["num_hidden_layers"]
    weights = layers * (h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * i)
    attention = layers * hq * 2 * d * sum(n * n for n in lengths)       # 2 products x 2 FLOPs x L^2/2 dots
    return 2.0 * weights * sum(lengths) + attention


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


if __name__ == "__main__":
    sys.exit(main())
