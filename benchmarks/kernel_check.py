"""GPU check of the Triton kernels: each against its PyTorch reference at Qwen3-0.6B's full shapes,
then decode attention timed against the device's own copy bandwidth, with a few tile/split configs.

    PYTHONPATH=. python benchmarks/kernel_check.py [--out DIR]

Prints max abs / relative error and PASS/FAIL per check, then a table; with --out also writes
DIR/kernel_check.json. Needs CUDA (about a minute on an H200).
"""
import argparse
import json
import math
import os
import sys
import time

import torch

HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB = 1024, 16, 8, 128, 3072, 151936
BLOCK_SIZE, EPS, DTYPE = 64, 1e-6, torch.bfloat16   # EngineConfig's block size on CUDA
MAX_MODEL_LEN = 40960          # what the decode path gets as max_seq_len under CUDA graphs (the default max_model_len)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="directory to write kernel_check.json into")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# ---- helpers ----

def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max abs error, max abs error / max abs reference); NaN anywhere counts as infinite error."""
    out, ref = out.float(), ref.float()
    if out.isnan().any() != ref.isnan().any() or (out.isnan() != ref.isnan()).any():
        return math.inf, math.inf
    diff = (out - ref).nan_to_num(0.0).abs().max().item()
    return diff, diff / max(ref.nan_to_num(0.0).abs().max().item(), 1e-30)


class Report:
    def __init__(self):
        self.checks, self.timings = [], []

    def check(self, name: str, out, ref, atol: float, rtol: float):
        abs_err, rel_err = errors(out, ref)
        ok = bool(torch.allclose(out.float(), ref.float(), atol=atol, rtol=rtol, equal_nan=True))
        self.checks.append(dict(name=name, max_abs_err=abs_err, rel_err=rel_err, passed=ok))
        print(f"  {'PASS' if ok else 'FAIL'}  {name:<58} max abs {abs_err:9.3e}  rel {rel_err:9.3e}", flush=True)

    def flag(self, name: str, ok: bool, detail: str = ""):
        self.checks.append(dict(name=name, passed=bool(ok), detail=detail))
        print(f"  {'PASS' if ok else 'FAIL'}  {name:<58} {detail}", flush=True)

    def time(self, name: str, fn, nbytes: float, copy_bw: float | None = None, **extra):
        import triton.testing
        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        gbps = nbytes / (ms * 1e-3) / 1e9
        row = dict(name=name, ms=ms, bytes=nbytes, gb_per_s=gbps, **extra)
        if copy_bw:
            row["frac_of_copy_bw"] = gbps / copy_bw
        self.timings.append(row)
        frac = f"  {row['frac_of_copy_bw']:6.1%} of copy" if copy_bw else ""
        print(f"  {name:<72} {ms * 1e3:9.1f} us  {gbps:8.0f} GB/s{frac}", flush=True)
        return row


def paged_batch(query_lens, seq_lens, gen, num_extra_blocks=64):
    """A paged batch over a shuffled block pool: K/V random in every slot, block tables padded -1."""
    dev = "cuda"
    blocks_per_seq = [(n + BLOCK_SIZE - 1) // BLOCK_SIZE for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + num_extra_blocks
    pool = torch.randperm(num_blocks, generator=gen, device=dev).to(torch.int32)
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq) + 1), -1, dtype=torch.int32, device=dev)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        block_tables[b, :n] = pool[used:used + n]
        used += n
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen, device=dev).to(DTYPE)
    v_cache = torch.randn(shape, generator=gen, device=dev).to(DTYPE)
    q = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM, generator=gen, device=dev).to(DTYPE)
    query_start_loc = torch.tensor([0] + list(query_lens), device=dev).cumsum(0).to(torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    return q, k_cache, v_cache, block_tables, seq_lens_t, query_start_loc


# ---- correctness ----

def check_elementwise(rep: Report, gen):
    from mini_engine.kernels.activation import silu_and_mul, silu_and_mul_ref
    from mini_engine.kernels.rms_norm import rms_norm, rms_norm_ref
    from mini_engine.kernels.rotary_kv import qk_norm_rope_kv_write, qk_norm_rope_kv_write_ref, rope_cos_sin_cache
    dev = "cuda"
    for T in (1, 257, 16384):
        x = (4 * torch.randn(T, HIDDEN, generator=gen, device=dev)).to(DTYPE)     # the residual stream
        weight = (1 + 0.1 * torch.randn(HIDDEN, generator=gen, device=dev)).to(DTYPE)
        rep.check(f"rms_norm T={T}", rms_norm(x, weight, EPS), rms_norm_ref(x, weight, EPS), 3e-2, 1.6e-2)

        gate_up = (2 * torch.randn(T, 2 * INTERMEDIATE, generator=gen, device=dev)).to(DTYPE)
        rep.check(f"silu_and_mul T={T}", silu_and_mul(gate_up), silu_and_mul_ref(gate_up), 2e-2, 1.6e-2)
        rep.check(f"silu_and_mul T={T} with the folded norm's 1/rms", silu_and_mul(gate_up, x, EPS),
                  silu_and_mul_ref(gate_up, x, EPS), 2e-2, 3.2e-2)

        qkv = torch.randn(T, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, generator=gen, device=dev).to(DTYPE)
        positions = torch.randint(0, MAX_MODEL_LEN, (T,), generator=gen, device=dev)
        cos_sin = rope_cos_sin_cache(HEAD_DIM, MAX_MODEL_LEN, 1_000_000.0, device=dev)
        q_norm = (1 + 0.1 * torch.randn(HEAD_DIM, generator=gen, device=dev)).to(DTYPE)
        k_norm = (1 + 0.1 * torch.randn(HEAD_DIM, generator=gen, device=dev)).to(DTYPE)
        num_blocks = (T + BLOCK_SIZE - 1) // BLOCK_SIZE + 4
        slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen, device=dev)[:T]
        slots[::7] = -1                                              # padded tokens write nowhere
        k_cache = torch.full((num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), float("nan"), dtype=DTYPE, device=dev)
        v_cache = torch.full_like(k_cache, float("nan"))
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        args = (qkv, positions, cos_sin, q_norm, k_norm, EPS)
        shape = (slots, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)
        q_ref = qk_norm_rope_kv_write_ref(*args, k_ref, v_ref, *shape)
        q = qk_norm_rope_kv_write(*args, k_cache, v_cache, *shape)
        rep.check(f"qk_norm_rope_kv_write T={T} q", q, q_ref, 6.3e-2, 3.2e-2)
        rep.check(f"qk_norm_rope_kv_write T={T} k_cache (NaN = unwritten)", k_cache, k_ref, 6.3e-2, 3.2e-2)
        rep.check(f"qk_norm_rope_kv_write T={T} v_cache (NaN = unwritten)", v_cache, v_ref, 0.0, 0.0)
        q_ref = qk_norm_rope_kv_write_ref(*args, k_ref, v_ref, *shape, x)
        q = qk_norm_rope_kv_write(*args, k_cache, v_cache, *shape, x)
        label = f"qk_norm_rope_kv_write T={T} with the folded norm's 1/rms"
        rep.check(f"{label} q", q, q_ref, 6.3e-2, 3.2e-2)
        rep.check(f"{label} k_cache (NaN = unwritten)", k_cache, k_ref, 6.3e-2, 3.2e-2)
        rep.check(f"{label} v_cache (NaN = unwritten)", v_cache, v_ref, 6.3e-2, 3.2e-2)


def check_attention(rep: Report, gen):
    from mini_engine.kernels.paged_attention import paged_attention, paged_attention_ref
    scale = HEAD_DIM ** -0.5
    # Mixed: decode rows first (as the runner orders them), then prefill chunks: fresh, after a
    # prefix hit, a later chunk of a long prompt, and short ones.
    num_decodes = 48
    dec_ctx = torch.randint(100, 2000, (num_decodes,), generator=gen, device="cuda").tolist()
    chunks = [(2048, 0), (1000, 3000), (512, 17), (77, 4096), (1, 5), (300, 300)]      # (query len, cached)
    query_lens = [1] * num_decodes + [n for n, _ in chunks]
    seq_lens = dec_ctx + [n + c for n, c in chunks]
    batch = paged_batch(query_lens, seq_lens, gen)
    ref = paged_attention_ref(*batch, scale)
    out = paged_attention(*batch, scale, max(query_lens), max(seq_lens))
    rep.check(f"paged_attention mixed ({num_decodes} decodes + {len(chunks)} chunks, T={sum(query_lens)})",
              out, ref, 2e-2, 2e-2)

    seq_lens = torch.randint(100, 2000, (256,), generator=gen, device="cuda").tolist()
    batch = paged_batch([1] * 256, seq_lens, gen)
    ref = paged_attention_ref(*batch, scale)
    out = paged_attention(*batch, scale, 1, max(seq_lens))
    rep.check("paged_attention decode 256 seqs ctx U(100,2000)", out, ref, 2e-2, 2e-2)
    out = paged_attention(*batch, scale, 1, MAX_MODEL_LEN)
    rep.check(f"paged_attention decode, max_seq_len={MAX_MODEL_LEN} (graph bound)", out, ref, 2e-2, 2e-2)
    small = paged_batch([1] * 4, [8000, 33, 4000, 1], gen)
    ref = paged_attention_ref(*small, scale)
    out = paged_attention(*small, scale, 1, MAX_MODEL_LEN)
    rep.check("paged_attention decode 4 seqs (split across programs)", out, ref, 2e-2, 2e-2)


def check_sampler(rep: Report, gen):
    from mini_engine.kernels.sampling import SAMPLE_CHUNK_SIZE, sample
    dev = "cuda"
    B = 256
    logits = 3 * torch.randn(B, VOCAB, generator=gen, device=dev)
    temps = torch.where(torch.arange(B, device=dev) % 2 == 0, 0.0, 0.8)
    seeds = torch.randint(0, 2**31, (B,), generator=gen, device=dev)
    tokens = sample(logits, temps, seeds)
    greedy = temps == 0
    rep.flag("sample: greedy rows == argmax", torch.equal(tokens[greedy], logits[greedy].argmax(-1)))
    rep.flag("sample: same seeds -> same tokens", torch.equal(tokens, sample(logits, temps, seeds)))
    masked = logits.clone()
    masked[:, 1000:] = float("-inf")
    rep.flag("sample: -inf columns never chosen", bool((sample(masked, temps, seeds) < 1000).all()))
    # A row's token depends on its logits, temperature and seed alone (at the default chunk size, not
    # exactly across chunk sizes: the float sums group differently): the same rows reversed, alone,
    # and next to rows they have not met give the same tokens. And bf16 logits against the fp32 copy
    # of the same rounded values, through the Sampler layer's Triton path.
    rev = torch.arange(B - 1, -1, -1, device=dev)
    rep.flag("sample B=256: a row's token whatever the batch order",
             torch.equal(sample(logits[rev], temps[rev], seeds[rev]), tokens[rev]))
    rep.flag("sample B=1: a row's token == its token in the B=256 batch",
             all(sample(logits[r:r + 1], temps[r:r + 1], seeds[r:r + 1]).item() == tokens[r].item() for r in (0, 1)))
    strangers = 3 * torch.randn(B // 2, VOCAB, generator=gen, device=dev)
    mixed = sample(torch.cat([strangers, logits[B // 2:]]), temps, torch.cat([seeds[:B // 2] + 1, seeds[B // 2:]]))
    rep.flag("sample B=256: a row's token next to other rows", torch.equal(mixed[B // 2:], tokens[B // 2:]))
    from mini_engine.layers.sampler import Sampler, SamplingTensors
    low = logits.to(torch.bfloat16)
    params = SamplingTensors(temperatures=temps, top_k=None, top_p=None, seeds=seeds, row_seeds=seeds.tolist(),
                             all_greedy=False)
    rep.flag("sample: bf16 logits (Sampler) == fp32 of the same values",
             torch.equal(Sampler(use_triton=True)(low, params), sample(low.float(), temps, seeds)))
    # Distribution: many rows with the same logits (a stride-0 view: one row in memory), one seed
    # each; chi-square over the likely tokens, the rest lumped into one bin, at two temperatures (the
    # scale). Likely tokens either side of a chunk boundary and in the last, partial chunk; columns of
    # probability 0 (-inf, and -200, whose exp2 underflows in fp32) must never be drawn.
    num_draws, top = 65536, 15
    perm = torch.randperm(VOCAB, generator=gen, device=dev)
    row = torch.full((VOCAB,), float("-inf"), device=dev)
    row[perm[:VOCAB // 2]] = -4.0
    row[perm[VOCAB // 2:VOCAB // 2 + 1000]] = -200.0
    row[perm[:top]] = torch.linspace(0.0, 3.0, top, device=dev)
    row[[SAMPLE_CHUNK_SIZE - 1, SAMPLE_CHUNK_SIZE, VOCAB - 1]] = torch.tensor([2.0, 2.5, 1.5], device=dev)
    dead = (row == float("-inf")) | (row == -200.0)
    for t in (1.0, 0.7):
        draws = sample(row.expand(num_draws, -1), torch.full((num_draws,), t, device=dev),
                       torch.arange(num_draws, device=dev) * 7919 + int(t * 10))
        counts = torch.bincount(draws, minlength=VOCAB).double()
        rep.flag(f"sample T={t}: columns of probability 0 never drawn", counts[dead].sum().item() == 0,
                 f"{int(counts[dead].sum().item())} draws")
        probs = (row / t).double().softmax(-1)
        heavy = probs * num_draws >= 20
        expected = torch.cat([probs[heavy] * num_draws, (probs[~heavy].sum() * num_draws)[None]])
        observed = torch.cat([counts[heavy], counts[~heavy].sum()[None]])
        chi2 = ((observed - expected) ** 2 / expected).sum().item()
        dof = int(heavy.sum().item())
        bound = dof + 6 * math.sqrt(2 * dof)            # mean + 6 standard deviations of chi-square(dof)
        rep.flag(f"sample T={t}: distribution == softmax (chi-square)", chi2 < bound,
                 f"chi2 {chi2:.1f} < {bound:.1f}, dof {dof}")


# ---- performance ----

def copy_bandwidth(rep: Report) -> float:
    src = torch.empty(2**30 // 2, dtype=DTYPE, device="cuda").normal_()
    dst = torch.empty_like(src)
    row = rep.time("device-to-device copy (1 GiB, read + write)", lambda: dst.copy_(src), 2 * src.numel() * 2)
    return row["gb_per_s"]


def bench_decode(rep: Report, gen, copy_bw: float):
    from mini_engine.kernels.paged_attention import (
        DECODE_STAGES, decode_num_splits, paged_attention, paged_decode_attention,
        paged_decode_attention_torch)
    scale = HEAD_DIM ** -0.5
    for num_seqs, lo, hi in ((256, 900, 1100), (8, 3500, 4500)):
        seq_lens = torch.randint(lo, hi, (num_seqs,), generator=gen, device="cuda").tolist()
        q, k_cache, v_cache, block_tables, seq_lens_t, qsl = batch = paged_batch([1] * num_seqs, seq_lens, gen)
        kv_bytes = 2 * sum(seq_lens) * NUM_KV_HEADS * HEAD_DIM * k_cache.element_size()
        nbytes = kv_bytes + 2 * q.numel() * q.element_size()     # K + V + q + out
        tag = f"decode B={num_seqs} ctx~{(lo + hi) // 2}"
        default = decode_num_splits(num_seqs, NUM_KV_HEADS, max(seq_lens), 64,
                                    torch.cuda.get_device_properties(0).multi_processor_count,
                                    DECODE_STAGES)
        rep.time(f"{tag} paged_attention (splits={default})",
                 lambda: paged_attention(*batch, scale, 1, max(seq_lens)), nbytes, copy_bw, kind="default",
                 num_seqs=num_seqs)
        rep.time(f"{tag} paged_attention, max_seq_len={MAX_MODEL_LEN}",
                 lambda: paged_attention(*batch, scale, 1, MAX_MODEL_LEN), nbytes, copy_bw, kind="graph-bound",
                 num_seqs=num_seqs)
        configs = [dict(tile_n=t, num_splits=s, num_warps=w, num_stages=st)
                   for t, s, w, st in ((64, 1, 4, 3), (64, 2, 4, 3), (64, 4, 4, 3), (32, 1, 4, 4), (128, 1, 4, 2),
                                       (128, 1, 8, 3), (64, 1, 8, 3), (16, 1, 4, 4))]
        if num_seqs < 64:
            configs = [dict(tile_n=64, num_splits=s, num_warps=4, num_stages=3) for s in (1, 4, 8, 16, 32)]
        for cfg in configs:
            try:
                label = "tile={tile_n} splits={num_splits} warps={num_warps} stages={num_stages}".format(**cfg)
                rep.time(f"{tag}   alt {label}",
                         lambda cfg=cfg: paged_decode_attention(*batch, scale, max(seq_lens), **cfg),
                         nbytes, copy_bw, kind="alt", config=cfg, num_seqs=num_seqs)
            except Exception as e:      # e.g. out of shared memory for a big tile: report and go on
                print(f"  {tag}   alt {label}: failed ({type(e).__name__}: {str(e)[:80]})")
        rep.time(f"{tag} eager paged_decode_attention_torch",
                 lambda: paged_decode_attention_torch(q, k_cache, v_cache, block_tables, seq_lens_t,
                                                      max(seq_lens), scale),
                 nbytes, copy_bw, kind="eager", num_seqs=num_seqs)


def bench_elementwise(rep: Report, copy_bw: float):
    from mini_engine.kernels.activation import silu_and_mul, silu_and_mul_ref
    from mini_engine.kernels.rms_norm import rms_norm, rms_norm_ref
    T, e = 16384, 2
    x = torch.randn(T, HIDDEN, device="cuda", dtype=DTYPE)
    weight = torch.ones(HIDDEN, device="cuda", dtype=DTYPE)
    nbytes = 2 * T * HIDDEN * e                  # read x, write out
    rep.time(f"rms_norm T={T}", lambda: rms_norm(x, weight, EPS), nbytes, copy_bw)
    rep.time(f"rms_norm_ref T={T} (eager)", lambda: rms_norm_ref(x, weight, EPS), nbytes, copy_bw)
    gate_up = torch.randn(T, 2 * INTERMEDIATE, device="cuda", dtype=DTYPE)
    nbytes = 3 * T * INTERMEDIATE * e
    rep.time(f"silu_and_mul T={T}", lambda: silu_and_mul(gate_up), nbytes, copy_bw)
    rep.time(f"silu_and_mul T={T} with the folded norm's 1/rms", lambda: silu_and_mul(gate_up, x, EPS),
             nbytes + T * HIDDEN * e, copy_bw)
    rep.time(f"silu_and_mul_ref T={T} (eager)", lambda: silu_and_mul_ref(gate_up), nbytes, copy_bw)
    from mini_engine.kernels.sampling import SAMPLE_CHUNK_SIZE, _chunk_stats, sample
    for B in (1, 256):
        logits = torch.randn(B, VOCAB, device="cuda")
        low = logits.to(torch.bfloat16)
        temps, seeds = torch.ones(B, device="cuda"), torch.arange(B, device="cuda")
        zeros = torch.zeros(B, device="cuda")
        rep.time(f"sample B={B} V={VOCAB} fp32", lambda: sample(logits, temps, seeds), logits.numel() * 4, copy_bw)
        rep.time(f"sample B={B} V={VOCAB} bf16", lambda: sample(low, temps, seeds), low.numel() * 2, copy_bw)
        rep.time(f"sample B={B} V={VOCAB} bf16 T=0 (argmax)", lambda: sample(low, zeros, seeds), low.numel() * 2,
                 copy_bw)
        rep.time(f"sample B={B} V={VOCAB} bf16 first kernel alone (chunk statistics)",
                 lambda: _chunk_stats(low, temps, SAMPLE_CHUNK_SIZE), low.numel() * 2, copy_bw)
        # The chunk size is a runtime argument: other sizes cost no kernel compilation, only timing.
        for chunk in (SAMPLE_CHUNK_SIZE // 2, SAMPLE_CHUNK_SIZE * 2):
            rep.time(f"sample B={B} V={VOCAB} bf16 chunk {chunk} (default {SAMPLE_CHUNK_SIZE})",
                     lambda chunk=chunk: sample(low, temps, seeds, chunk), low.numel() * 2, copy_bw)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_check.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing to check.",
              file=sys.stderr)
        return 2
    try:
        import triton
    except ImportError:
        print("kernel_check.py needs triton, which is not installed.", file=sys.stderr)
        return 2
    start = time.perf_counter()
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    rep = Report()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print("correctness (kernel vs reference, bf16, Qwen3-0.6B shapes):")
    check_elementwise(rep, gen)
    check_attention(rep, gen)
    check_sampler(rep, gen)
    torch.cuda.empty_cache()
    print("performance (median of triton.testing.do_bench):")
    copy_bw = copy_bandwidth(rep)
    bench_decode(rep, gen, copy_bw)
    bench_elementwise(rep, copy_bw)

    failed = [c["name"] for c in rep.checks if not c["passed"]]
    print("\n" + "=" * 100)
    print(f"correctness: {len(rep.checks) - len(failed)}/{len(rep.checks)} passed"
          + (f"; FAILED: {failed}" if failed else ""))
    print(f"{'timing':<72} {'us':>9} {'GB/s':>8} {'of copy':>8}")
    for row in rep.timings:
        frac = f"{row['frac_of_copy_bw']:8.1%}" if "frac_of_copy_bw" in row else ""
        print(f"{row['name'][:72]:<72} {row['ms'] * 1e3:9.1f} {row['gb_per_s']:8.0f} {frac}")
    best = max((r for r in rep.timings if r.get("num_seqs") == 256 and r.get("kind") in ("default", "alt")),
               key=lambda r: r["gb_per_s"], default=None)
    if best:
        print(f"fastest decode (256 seqs): {best['name'].strip()}  {best['frac_of_copy_bw']:.1%} of copy bandwidth "
              f"(target >= 75%)")
    print(f"total {time.perf_counter() - start:.0f} s")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                      copy_gb_per_s=copy_bw, checks=rep.checks, timings=rep.timings)
        with open(os.path.join(args.out, "kernel_check.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(f"wrote {os.path.join(args.out, 'kernel_check.json')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
