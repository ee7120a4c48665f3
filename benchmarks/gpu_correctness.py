"""End-to-end checks that need the GPU (run on the H200; exits early without CUDA):

1. bf16 greedy outputs of mini_engine (eager path and kernel path) against transformers'
   Qwen3ForCausalLM on the GPU, loading the same safetensors, and their prefill logits. The
   reference is transformers in fp32; transformers' own bf16 run is the control that says how far
   bf16 rounding alone moves things. A random model's top two logits are often within bf16 noise,
   so token agreement is judged teacher-forced: every token we chose must be the fp32 model's
   argmax or within `--margin` of it, given the same prefix; exact agreement is reported too.
2. The kernel path against the eager path: logits close, token sequences equal for a stretch.
3. CUDA graphs against no graphs: identical outputs for batch sizes that hit a captured size
   exactly and ones that need padding, with sequences finishing mid-batch and a preemption.
4. An fp8 KV cache (kv_cache_dtype "fp8" and "fp8_e5m2") as in 1-3, against transformers fp32
   reading K and V rounded to fp8.

The checkpoint has Qwen3-0.6B's shape with N(0, 0.06) weights: at the benchmark's 0.02 a random
model repeats one token, which would make token agreement meaningless.
"""
import argparse
import dataclasses
import gc
import json
import os
import random
import sys
import tempfile

import torch


CONTROL = "transformers bf16 greedy vs fp32 (control)"


def free_gpu():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def std006_checkpoint(cpu_dry_run: bool, device: str) -> tuple[str, dict]:
    """Qwen3-0.6B's shape with N(0, 0.06) weights (a tiny one for a CPU dry run): its folder and config."""
    from mini_engine.model.random_checkpoint import QWEN3_0_6B, write_random_checkpoint
    config = QWEN3_0_6B
    if cpu_dry_run:
        config = QWEN3_0_6B | dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    path = write_random_checkpoint(os.path.join(tempfile.gettempdir(), f"qwen3-std006-{config['hidden_size']}"),
                                   config, std=0.06, seed=1, device=device)
    return path, config


def common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="folder for a JSON of the results")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--eager-only", action="store_true", help="only the eager path against transformers")
    ap.add_argument("--margin", type=float, default=0.25,
                    help="largest fp32 logit gap allowed between the token chosen and the argmax")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="run the script's logic on the CPU with a tiny model (checks the script, not the GPU)")
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.cpu_dry_run:
        sys.exit("gpu_correctness.py needs CUDA (or --cpu-dry-run)")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    from transformers import Qwen3ForCausalLM as HFQwen3
    from mini_engine import LLM, SamplingParams

    path, config = std006_checkpoint(args.cpu_dry_run, dev)
    rng = random.Random(0)
    vocab = config["vocab_size"]
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (5, 17, 64, 200, 333, 1000, 31, 128)]
    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    results, failures = {}, []

    # transformers on the GPU: fp32 (the reference) and bf16 (the control)
    hf32 = HFQwen3.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").to(dev).eval()
    hf16 = HFQwen3.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").to(dev).eval()
    with torch.inference_mode():
        hf_out = [hf16.generate(torch.tensor([p], device=dev), max_new_tokens=args.tokens, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
        ref_logits = [hf32(torch.tensor([p], device=dev)).logits[0, -1].float().cpu() for p in prompts]
        hf16_logits = [hf16(torch.tensor([p], device=dev)).logits[0, -1].float().cpu() for p in prompts]
    del hf16
    free_gpu()

    @torch.inference_mode()
    def margins(outputs, prompts_=prompts, penalties=None, reference=hf32):
        """For each generated token: fp32 max logit minus the fp32 logit of the token chosen,
        given the same prefix (0 where we chose the fp32 argmax); with `penalties` (SamplingParams),
        of the logits those penalties make of them, by the penalties' definitions."""
        out = []
        for p, gen in zip(prompts_, outputs):
            logits = reference(torch.tensor([p + gen[:-1]], device=dev)).logits[0, len(p) - 1:].float()
            if penalties is not None:
                logits = torch.stack([penalised(row, p + gen[:j], len(p), penalties) for j, row in enumerate(logits)])
            chosen = logits.gather(-1, torch.tensor(gen, device=dev)[:, None]).squeeze(-1)
            out.append((logits.max(-1).values - chosen).tolist())
        return out

    def penalised(logits, history, num_prompt, q):
        """OpenAI's presence and frequency penalties over the output, transformers' repetition
        penalty over prompt and output."""
        counts = torch.bincount(torch.tensor(history[num_prompt:], dtype=torch.long, device=dev),
                                minlength=logits.shape[0]).float()
        seen = torch.bincount(torch.tensor(history, dtype=torch.long, device=dev), minlength=logits.shape[0]) > 0
        repetition = torch.where(seen, q.repetition_penalty, 1.0)
        logits = torch.where(logits > 0, logits / repetition, logits * repetition)
        return logits - q.frequency_penalty * counts - q.presence_penalty * (counts > 0).float()

    def run(label, prompts_, params, **kw):
        llm = LLM(path, gpu_memory_utilization=0.5, **({"max_num_seqs": 64} | kw))
        # As if the pool were uninitialised memory: stale slots must never reach an output.
        llm.engine.runner.kv_cache.fill_(float("nan"))
        outs = llm.generate(prompts_, params, use_tqdm=False)
        engine = llm.engine
        leaked = engine.block_manager.num_blocks - engine.num_free_blocks
        info = dict(preemptions=engine.num_preemptions, leaked_blocks=leaked)
        if leaked:
            failures.append(f"{label}: {leaked} KV blocks leaked")
        # Last-prompt-token logits through the same engine, for a logits comparison.
        logits = []
        with torch.inference_mode():
            runner = engine.runner
            for p in prompts_[:4]:
                from mini_engine.runner.batch import BatchRow
                blocks = list(range((len(p) + runner.block_size - 1) // runner.block_size))
                # logits_indices, not the last row: a long prompt's step is padded with tokens of no sequence.
                t, meta = runner.prepare_inputs([BatchRow(p, 0, blocks, True, greedy)])
                hidden = runner.model(t.input_ids, t.positions, meta)
                logits.append(runner.model.compute_logits(hidden[t.logits_indices]).float().cpu()[0])
        del llm, engine
        free_gpu()
        return [o.outputs[0].token_ids for o in outs], logits, info

    eager, eager_logits, _ = run("eager", prompts, greedy, kernels="none", enforce_eager=True)

    def compare(name, got, ref, need):
        agree = [common_prefix(g, r) for g, r in zip(got, ref)]
        ok = min(agree) >= need
        results[name] = dict(agree=agree, required=need, ok=ok)
        if not ok:
            failures.append(f"{name}: agreeing prefix lengths {agree}, need >= {need}")

    def compare_logits(name, got, ref, limit):
        rel = [((g - r).norm() / r.norm()).item() for g, r in zip(got, ref)]
        results[name] = dict(rel_err=[round(x, 5) for x in rel], limit=limit, ok=max(rel) <= limit)
        if max(rel) > limit:
            failures.append(f"{name}: relative logits error {max(rel):.3g} > {limit:.3g}")

    def teacher_forced(name, outputs, prompts_=prompts, penalties=None, reference=hf32, control=CONTROL):
        # A repetition penalty r < 1 divides a seen token's logit, and its rounding error, by r.
        error_scale = 1.0 if penalties is None else max(1.0, 1.0 / penalties.repetition_penalty)
        m = sorted((x for row in margins(outputs, prompts_, penalties, reference) for x in row), reverse=True)
        worst, tokens = m[0], len(m)
        off_argmax = sum(x > 0 for x in m)
        if name == control:          # this is the control: transformers' own bf16, judged by nothing
            results[name] = dict(worst_margin=round(worst, 4), tokens_not_fp32_argmax=off_argmax, tokens=tokens)
            return
        control = results[control]
        # No worse than transformers' own bf16, give or take: its worst margin over its tokens
        # against ours over as many, i.e. our k-th worst where we have k times its tokens (the
        # worst of 1,536 tokens is, by chance alone, further out than the worst of 256).
        k = max(1, round(tokens / control["tokens"]))
        judged = m[k - 1]
        limit = max(args.margin, 1.5 * control["worst_margin"]) * error_scale
        results[name] = dict(worst_margin=round(worst, 4), judged_margin=round(judged, 4), judged_rank=k,
                             tokens_not_fp32_argmax=off_argmax, tokens=tokens, limit=round(limit, 4),
                             ok=judged <= limit)
        if judged > limit:
            failures.append(f"{name}: its {k}-th worst token was {judged:.3f} below the fp32 argmax "
                            f"(limit {limit:.3f}, for {tokens} tokens against the control's {control['tokens']})")

    # How far bf16 alone moves the logits: transformers' bf16 against its fp32. Ours may be up to
    # twice that (different but equally valid rounding order), never more.
    compare_logits("transformers bf16 logits vs fp32 (control)", hf16_logits, ref_logits, 1.0)
    bf16_noise = 2 * max(results["transformers bf16 logits vs fp32 (control)"]["rel_err"])
    teacher_forced(CONTROL, hf_out)
    compare_logits("eager logits vs transformers fp32", eager_logits, ref_logits[:4], bf16_noise)
    teacher_forced("eager greedy, teacher-forced vs fp32", eager)
    results["eager vs transformers bf16, exact prefix"] = dict(agree=[common_prefix(g, r) for g, r in zip(eager, hf_out)])
    if args.eager_only:
        return report(results, failures, args.out)
    kern, kern_logits, _ = run("kernels", prompts, greedy, kernels="auto", enforce_eager=True)
    graph, _, _ = run("graphs", prompts, greedy, kernels="auto")
    compare_logits("kernel logits vs transformers fp32", kern_logits, ref_logits[:4], bf16_noise)
    teacher_forced("kernels greedy, teacher-forced vs fp32", kern)
    results["kernels vs eager, exact prefix"] = dict(agree=[common_prefix(g, r) for g, r in zip(kern, eager)])
    compare_logits("kernel logits vs eager logits", kern_logits, eager_logits, bf16_noise)
    # Graphs replay the same kernels: the same tokens, exactly.
    compare("graphs vs kernels (no graphs)", graph, kern, args.tokens)

    # An fp8 KV cache (kv_cache_dtype "fp8", e4m3, and "fp8_e5m2"), judged as the model-dtype
    # cache is: against transformers fp32 whose attention reads K and V rounded to fp8 as the cache
    # stores them (the CPU tests' oracle, registered by tests/hf_reference.py), with transformers
    # bf16 reading them so as the control (a K element that bf16 moves across an fp8 rounding
    # boundary moves by a whole fp8 step: bf16 noise, amplified); graphs against no graphs, exactly.
    from tests.hf_reference import ATTENTION_BY_KV_CACHE_DTYPE
    for kv in ("fp8", "fp8_e5m2"):
        attention = ATTENTION_BY_KV_CACHE_DTYPE[kv]
        fp8_kern, fp8_kern_logits, _ = run(f"kernels, {kv} cache", prompts, greedy, kernels="auto",
                                           enforce_eager=True, kv_cache_dtype=kv)
        fp8_graph, _, _ = run(f"graphs, {kv} cache", prompts, greedy, kernels="auto", kv_cache_dtype=kv)
        fp8_eager, fp8_eager_logits, _ = run(f"eager, {kv} cache", prompts, greedy, kernels="none",
                                             enforce_eager=True, kv_cache_dtype=kv)
        hf32_fp8 = HFQwen3.from_pretrained(path, dtype=torch.float32, attn_implementation=attention).to(dev).eval()
        hf16_fp8 = HFQwen3.from_pretrained(path, dtype=torch.bfloat16, attn_implementation=attention).to(dev).eval()
        with torch.inference_mode():
            fp8_ref_logits = [hf32_fp8(torch.tensor([p], device=dev)).logits[0, -1].float().cpu() for p in prompts[:4]]
            fp8_hf16_logits = [hf16_fp8(torch.tensor([p], device=dev)).logits[0, -1].float().cpu()
                               for p in prompts[:4]]
            fp8_hf16_out = [hf16_fp8.generate(torch.tensor([p], device=dev), max_new_tokens=args.tokens,
                                              do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                            for p in prompts]
        del hf16_fp8
        fp8_control = f"{kv} cache: transformers bf16 greedy vs fp32 (control)"
        compare_logits(f"{kv} cache: transformers bf16 logits vs fp32 (control)", fp8_hf16_logits, fp8_ref_logits, 1.0)
        fp8_noise = 2 * max(results[f"{kv} cache: transformers bf16 logits vs fp32 (control)"]["rel_err"])
        teacher_forced(fp8_control, fp8_hf16_out, reference=hf32_fp8, control=fp8_control)
        compare_logits(f"{kv} cache: kernel logits vs transformers fp32 reading {kv}", fp8_kern_logits, fp8_ref_logits,
                       fp8_noise)
        teacher_forced(f"{kv} cache: kernels greedy, teacher-forced vs fp32 reading {kv}", fp8_kern,
                       reference=hf32_fp8, control=fp8_control)
        compare(f"{kv} cache: graphs vs kernels (no graphs)", fp8_graph, fp8_kern, args.tokens)
        # The kernels against PyTorch's path, both fp8: as close as the bf16 caches' two paths are
        # (their K differ only where the two round a bf16 differently, and few of those cross an
        # fp8 boundary).
        compare_logits(f"{kv} cache: kernel logits vs eager logits", fp8_kern_logits, fp8_eager_logits, bf16_noise)
        teacher_forced(f"{kv} cache: eager greedy, teacher-forced vs fp32 reading {kv}", fp8_eager,
                       reference=hf32_fp8, control=fp8_control)
        results[f"{kv} cache: kernels vs eager, exact prefix"] = dict(
            agree=[common_prefix(g, r) for g, r in zip(fp8_kern, fp8_eager)])
        # How far fp8 moves the logits from the model-dtype cache's (reported, not judged).
        results[f"{kv} cache vs model-dtype cache, kernel logits"] = dict(
            rel_err=[round(((a - b).norm() / b.norm()).item(), 5) for a, b in zip(fp8_kern_logits, kern_logits)],
            exact_prefix=[common_prefix(a, b) for a, b in zip(fp8_kern, kern)])
        del hf32_fp8
        free_gpu()

    # A graph replay against the same padded batch run eagerly through the same kernels: bitwise
    # equal logits, and the padding rows (slot -1) leave the KV cache untouched.
    if dev == "cuda":
        # A pool of its own size: the check clones it and compares the two, 2.5x the pool in all,
        # which a pool sized by gpu_memory_utilization=0.5 can exceed (it did at f331417).
        llm = LLM(path, num_kv_blocks=1024, max_num_seqs=64)
        runner = llm.engine.runner
        from mini_engine.runner.batch import BatchRow
        rows, next_block = [], 0
        for _ in range(13):                       # pads to the captured 16
            ctx = rng.randrange(20, 900)
            blocks = list(range(next_block, next_block + ctx // runner.block_size + 1))
            next_block += len(blocks)
            # Half the rows sample (one of them seeded), half are greedy: the graph samples them all.
            params = SamplingParams(temperature=0.8, seed=7) if len(rows) % 2 else greedy
            rows.append(BatchRow([rng.randrange(vocab)], ctx, blocks, True, params, params.seed))
        # Four rows take their input token from the previous launch's samples, on the device (the
        # other turn's).
        prev = torch.tensor([rng.randrange(vocab) for _ in range(13)], device=dev)
        runner.sampled_tokens[1 - runner.turn, :13] = prev
        for i in (0, 4, 5, 12):
            rows[i].prev_token_index = 12 - i
        from mini_engine.engine.sequence import PENDING_TOKEN
        expected_ids = [prev[r.prev_token_index].item() if r.prev_token_index >= 0 else r.token_ids[0] for r in rows]
        for r in rows:
            if r.prev_token_index >= 0:
                r.token_ids = [PENDING_TOKEN]
        with torch.inference_mode():
            t, meta = runner.prepare_inputs(rows, graph_size=16)    # staged where graph 16 reads
            kv_before = runner.kv_cache.clone()
            graph_logits = runner.graph_runner.replay(16, runner.turn)[:13].clone()
            graph_tokens = runner.sampled_tokens[runner.turn, :13].clone()
            written = (runner.kv_cache != kv_before).any(dim=(0, 1, 3, 4, 5)).sum().item()   # blocks touched
            ids_taken = t.input_ids[:13].tolist() == expected_ids
            eager_logits = runner.model.compute_logits(runner.model(t.input_ids, t.positions, meta))[:13]
            sampler_tokens = runner.sampler(graph_logits, runner.sampling_tensors(rows, t))
        equal = torch.equal(graph_logits, eager_logits)
        same_tokens = torch.equal(graph_tokens, sampler_tokens)
        results["graph replay vs same padded batch, eager"] = dict(equal=equal, blocks_written=written,
                                                                    prev_tokens_taken=ids_taken,
                                                                    graph_sampler_matches=same_tokens)
        if not equal:
            failures.append("graph replay logits differ from the same padded batch run eagerly")
        if written != 13:
            failures.append(f"graph replay wrote {written} KV blocks, expected the 13 rows' own")
        if not ids_taken:
            failures.append("the graph did not take the previous launch's tokens as its inputs")
        if not same_tokens:
            failures.append("the graph's sampled tokens differ from the sampler's on the same logits")
        del llm, runner
        free_gpu()

    # Whole runs with and without graphs: 16 is a captured size, 13 and 37 pad, and max_tokens
    # differ so sequences finish mid-batch and the batch shrinks across sizes. Padded rows change
    # the GEMMs' M, and cuBLAS may pick another kernel for it, so a random model's near-tied
    # tokens can flip after a while: require the first 8 tokens equal, and every token a valid
    # greedy choice (teacher-forced, as above). The 8 prompts above, whose shapes match, agree
    # exactly.
    for n in (16, 13, 37):
        ps = [[rng.randrange(vocab) for _ in range(rng.randrange(10, 300))] for _ in range(n)]
        params = [SamplingParams(temperature=0, max_tokens=rng.randrange(8, 48), ignore_eos=True) for _ in ps]
        a, _, _ = run(f"graphs bs={n}", ps, params, kernels="auto")
        b, _, _ = run(f"no graphs bs={n}", ps, params, kernels="auto", enforce_eager=True)
        compare(f"graphs vs no graphs, batch {n}", a, b, 8)
        results[f"graphs vs no graphs, batch {n}"]["identical"] = a == b
        teacher_forced(f"graphs, batch {n}, teacher-forced vs fp32", a, ps)
        if n == 13:
            # A row restricted to its top-k is drawn inside the graph (kernels/top_k_sampling.py).
            # top_k=1 at temperature 1 is greedy (up to which of two tied logits it keeps), so it
            # must agree with the greedy run as the others do.
            top1 = [SamplingParams(temperature=1.0, top_k=1, max_tokens=p.max_tokens, ignore_eos=True) for p in params]
            c, _, _ = run(f"graphs bs={n}, top_k=1", ps, top1, kernels="auto")
            compare(f"graphs, batch {n}: top_k=1 at T=1 vs greedy", c, a, 8)
            teacher_forced(f"graphs, batch {n}, top_k=1, teacher-forced vs fp32", c, ps)
            # Top-k and top-p drawn inside the graphs (kernels/top_k_sampling.py): seeded rows draw
            # the same tokens with graphs, without them, and beside a penalised row, which sends
            # every step to the eager sampler (the same kernels, on its fp32 copy of the logits).
            tk = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=100 + i, max_tokens=p.max_tokens,
                                 ignore_eos=True) for i, p in enumerate(params)]
            f, _, _ = run(f"graphs bs={n}, top_k=20", ps, tk, kernels="auto")
            g, _, _ = run(f"no graphs bs={n}, top_k=20", ps, tk, kernels="auto", enforce_eager=True)
            compare(f"graphs vs no graphs, batch {n}, seeded top_k=20 top_p=0.9", f, g, 8)
            results[f"graphs vs no graphs, batch {n}, seeded top_k=20 top_p=0.9"]["identical"] = f == g
            beside = SamplingParams(temperature=0.8, repetition_penalty=1.2, max_tokens=48, ignore_eos=True)
            h, _, _ = run(f"graphs bs={n + 1}, top_k=20 beside a penalised row", ps + ps[:1], tk + [beside],
                          kernels="auto")
            compare(f"batch {n}, seeded top_k=20: alone (graphs) vs beside a penalised row (eager)", f, h[:n], 8)
            changed = sum(x != y for x, y in zip(f, c))
            results[f"graphs, batch {n}, top_k=20 at T=0.8 vs top_k=1"] = dict(outputs_changed=changed, ok=changed > 0)
            if changed == 0:
                failures.append("seeded top_k=20 sampling drew the greedy tokens for every row")
            # Penalties: the sampler counts each row's tokens, its newest read on the device from
            # the graph's input tokens (the previous step's samples, which the host has not seen).
            # Penalties that favour the tokens seen: this model's greedy outputs at 152k tokens
            # rarely repeat one, so penalties against repeats changed 1 of 13 outputs (f433836), and
            # so did presence and frequency penalties of -1.5 and -0.5 beside a repetition penalty of
            # 1.3 (7a87be9). A repetition penalty of 0.5 doubles a seen token's positive logit, and
            # its bf16 error with it: the teacher-forced limit is scaled by the same 1 / 0.5.
            q = SamplingParams(temperature=0, repetition_penalty=0.5, presence_penalty=-1.5, frequency_penalty=-0.5,
                               ignore_eos=True)
            pen = [dataclasses.replace(q, max_tokens=p.max_tokens) for p in params]
            d, _, _ = run(f"graphs bs={n}, penalties", ps, pen, kernels="auto")
            e, _, _ = run(f"no graphs bs={n}, penalties", ps, pen, kernels="auto", enforce_eager=True)
            compare(f"graphs vs no graphs, batch {n}, penalties", d, e, 8)
            results[f"graphs vs no graphs, batch {n}, penalties"]["identical"] = d == e
            teacher_forced(f"graphs, batch {n}, penalties, teacher-forced vs fp32 penalised", d, ps, q)
            changed = sum(x != y for x, y in zip(d, a))
            results[f"graphs, batch {n}, penalties"] = dict(outputs_changed_by_penalties=changed, ok=changed > n // 2)
            if changed <= n // 2:
                failures.append(f"penalties changed only {changed} of {n} greedy outputs")
    # Preemption during decode: a pool too small for all 24 sequences at once (120 blocks of 16
    # tokens hold 17 of them at 7 blocks; each needs an eighth at its 13th token).
    ps = [[rng.randrange(vocab) for _ in range(100)] for _ in range(24)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    small, _, info = run("graphs, small pool", ps, params, kernels="auto", block_size=16, num_kv_blocks=120)
    roomy, _, _ = run("graphs, roomy pool", ps, params, kernels="auto", block_size=16)
    results["preemption"] = dict(preemptions=info["preemptions"])
    if info["preemptions"] == 0:
        failures.append("the small pool did not preempt")
    compare("preemption: small pool vs roomy pool", small, roomy, 8)
    results["preemption: small pool vs roomy pool"]["identical"] = small == roomy
    teacher_forced("preempted run, teacher-forced vs fp32", small, ps)

    report(results, failures, args.out)


def report(results, failures, out):
    for name, r in results.items():
        print(f"{name:40s} {'PASS' if r.get('ok', r.get('equal', True)) else 'FAIL'}  {r}")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "gpu_correctness.json"), "w") as f:
            json.dump(dict(results=results, failures=failures), f, indent=1)
    print("FAILURES:" if failures else "ALL PASSED", *failures, sep="\n  ")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
