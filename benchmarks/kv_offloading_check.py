"""KV offloading on the GPU (`kv_offloading_size`, vLLM's native backend): a prefix-reuse workload
whose documents the KV pool cannot hold at once, run in two rounds. Round 1 reads each of --docs
random documents of --doc-tokens tokens with a question of its own; round 2 asks each document a
second question. The pool (--pool-blocks of 64 tokens) holds a fraction of the documents, so
round 2 finds most of them evicted: without a host tier it computes them again, with one it loads
them back. Reported for both engines: each round's wall time, round 2's prefix hits on the device
and from the host tier, and how many of round 2's greedy tokens agree (bf16: a prefix loaded back
is bitwise the one computed in round 1, but round 1's batches differ with the pool's pressure,
so a near tie may break differently). Both must give back every KV block, and the host tier must
serve round 2's documents.

    PYTHONPATH=. python benchmarks/kv_offloading_check.py [--docs 32] [--doc-tokens 2048] [--out DIR]
"""
import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time

import torch


def run(path: str, docs: list[list[int]], questions: list[list[list[int]]], args, **engine_kwargs) -> dict:
    from mini_engine import LLM, SamplingParams
    llm = LLM(path, num_kv_blocks=args.pool_blocks, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
              **engine_kwargs)
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    bm = llm.engine.block_manager
    result = {}
    for i, round_questions in enumerate(questions, start=1):
        device_hits, host_hits = bm.prefix_cache_hit_tokens, bm.host_cache_hit_tokens
        start = time.perf_counter()
        outputs = llm.generate([doc + q for doc, q in zip(docs, round_questions)], params, use_tqdm=False)
        result[f"round{i}_s"] = round(time.perf_counter() - start, 3)
        result[f"round{i}_device_hit_tokens"] = bm.prefix_cache_hit_tokens - device_hits
        result[f"round{i}_host_hit_tokens"] = bm.host_cache_hit_tokens - host_hits
        result[f"round{i}_tokens"] = [o.outputs[0].token_ids for o in outputs]
    result["blocks_free"] = llm.engine.num_free_blocks == bm.num_blocks
    result["host_blocks"] = llm.engine.runner.num_host_kv_blocks
    del llm, bm
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=32)
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--pool-blocks", type=int, default=320, help="the KV pool, in blocks of 64 tokens")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--offload-gib", type=float, default=12.0)
    ap.add_argument("--out", default=None, help="folder for a JSON of the results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kv_offloading_check.py needs CUDA")
    from mini_engine.model.random_checkpoint import QWEN3_0_6B, write_random_checkpoint
    # std 0.06, as gpu_correctness.py's: at 0.02 a random model's next-token distribution is flat.
    path = write_random_checkpoint(tempfile.mkdtemp(prefix="qwen3-offload-"), QWEN3_0_6B, device="cuda", std=0.06)
    rng = random.Random(0)
    docs = [rng.choices(range(151_000), k=args.doc_tokens) for _ in range(args.docs)]
    questions = [[rng.choices(range(151_000), k=args.question_tokens) for _ in docs] for _ in range(2)]
    runs = {"no offloading": run(path, docs, questions, args),
            "offloading": run(path, docs, questions, args, kv_offloading_size=args.offload_gib)}
    plain, offloaded = runs["no offloading"]["round2_tokens"], runs["offloading"]["round2_tokens"]
    agree = sum(a == b for x, y in zip(plain, offloaded) for a, b in zip(x, y))
    report = {name: {k: v for k, v in r.items() if not k.endswith("_tokens") or "hit" in k} for name, r in runs.items()}
    report["round2_tokens_agreeing"] = f"{agree} of {sum(map(len, plain))}"
    report["round2_requests_identical"] = f"{sum(x == y for x, y in zip(plain, offloaded))} of {len(plain)}"
    print(json.dumps(report, indent=1))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "kv_offloading_check.json"), "w") as f:
            json.dump(report | {"args": vars(args)}, f, indent=1)
    failed = [name for name, r in runs.items() if not r["blocks_free"]]
    if runs["offloading"]["round2_host_hit_tokens"] < args.docs * args.doc_tokens // 2:
        failed.append("the host tier served less than half of round 2's documents")
    if failed:
        sys.exit(f"FAILED: {failed}")


if __name__ == "__main__":
    main()
