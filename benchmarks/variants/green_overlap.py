# Run from the repo root with PYTHONPATH=. on the H200.
"""Feasibility of overlapping decode attention with the projections by SM partitioning (green
contexts): one layer at 256 rows run in sequence on the whole GPU, against the two half-batches'
attention and projection chains run concurrently, each stream on its own share of the SMs."""
import sys
import torch
import torch.nn.functional as F
sys.path.insert(0, ".")
from benchmarks.decode_sweep import PROJECTIONS, LAYERS, DTYPE, make_kv_cache, NUM_HEADS, HEAD_DIM, MAX_MODEL_LEN
from mini_engine.kernels.paged_attention import paged_decode_attention
from mini_engine.kernels.activation import silu_and_mul
from mini_engine.kernels.rms_norm import add_rms_norm

print(torch.__version__, torch.version.cuda)
from torch.cuda import green_contexts
print([n for n in dir(green_contexts.GreenContext) if not n.startswith("__")])

dev = "cuda"
gen = torch.Generator(device=dev).manual_seed(0)
B, CTX, BS = 256, 650, 16
nblk = B * (CTX // BS + 1) + 16
k_cache, v_cache = make_kv_cache(nblk, BS, "token", gen)
tables = torch.arange(B * (MAX_MODEL_LEN // BS), device=dev, dtype=torch.int32).view(B, -1) % nblk
lens = torch.randint(200, 1100, (B,), generator=gen, device=dev).to(torch.int32)
lens = torch.cat([lens[: B // 2].sort(descending=True).values, lens[B // 2:].sort(descending=True).values])
q = torch.randn(B, NUM_HEADS, HEAD_DIM, device=dev, dtype=DTYPE)
qsl = torch.arange(B + 1, device=dev, dtype=torch.int32)
ws = {n: [torch.randn(o, i, device=dev, dtype=DTYPE) * 0.02 for _ in range(LAYERS)] for n, (o, i) in PROJECTIONS.items()}
norm_w = torch.ones(1024, device=dev, dtype=DTYPE)


def attention(rows, layer):
    s = slice(rows[0], rows[1])
    return paged_decode_attention(q[s], k_cache, v_cache, tables[s], lens[s], qsl[: rows[1] - rows[0] + 1],
                                  HEAD_DIM ** -0.5, MAX_MODEL_LEN)


def chain(attn_out, residual, layer):
    """o_proj, add+norm, MLP, add+norm, next qkv: what runs between two attentions."""
    h = F.linear(attn_out.flatten(1), ws["o"][layer])
    x, residual = add_rms_norm(h, residual, norm_w, 1e-6)
    h = F.linear(silu_and_mul(F.linear(x, ws["gate_up"][layer])), ws["down"][layer])
    x, residual = add_rms_norm(h, residual, norm_w, 1e-6)
    return F.linear(x, ws["qkv"][(layer + 1) % LAYERS]), residual


res_full = torch.randn(B, 1024, device=dev, dtype=DTYPE)


def sequential():
    for layer in range(LAYERS):
        out = attention((0, B), layer)
        chain(out, res_full, layer)


def timed(fn, reps=5):
    g = torch.cuda.CUDAGraph()
    fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        fn()
    g.replay(); torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record(); torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / LAYERS * 1e3      # us a layer


def make_streams(n_attn):
    """Attention on a green context of n_attn SMs; the chain on an ordinary stream, whose blocks
    land wherever attention leaves room (torch 2.11's create() cannot make disjoint partitions:
    each one starts from the same SMs)."""
    ga = green_contexts.GreenContext.create(num_sms=n_attn, device_id=0)
    return ga.Stream(), torch.cuda.Stream(), (ga,)


print(f"sequential, whole GPU: {timed(sequential):.1f} us a layer")
half = B // 2
print(f"attention 256 rows alone: {timed(lambda: [attention((0, B), l) for l in range(LAYERS)]):.1f} us")
print(f"attention 128 rows alone: {timed(lambda: [attention((0, half), l) for l in range(LAYERS)]):.1f} us")
att_half = attention((0, half), 0)
res_half = [torch.randn(half, 1024, device=dev, dtype=DTYPE) for _ in range(2)]
print(f"chain 256 rows alone: {timed(lambda: [chain(attention((0, B), 0) if False else torch.zeros(B, NUM_HEADS, HEAD_DIM, device=dev, dtype=DTYPE), res_full, l) for l in range(LAYERS)]):.1f} us (incl. a zeros fill)")
print(f"chain 128 rows alone: {timed(lambda: [chain(att_half, res_half[0], l) for l in range(LAYERS)]):.1f} us")

for n_attn in (88, 96, 104, 112, 120):
    try:
        sa, sb, keep = make_streams(n_attn)
    except Exception as e:
        print(f"green contexts {n_attn}: {type(e).__name__}: {e}"); continue
    for label, stream in (("attention 128 rows", sa),):
        def on_stream():
            cur = torch.cuda.current_stream()
            stream.wait_stream(cur)
            with torch.cuda.stream(stream):
                for l in range(LAYERS):
                    attention((0, half), l)
            cur.wait_stream(stream)
        try:
            print(f"  {n_attn} SMs: {label} alone on its partition: {timed(on_stream):.1f} us")
        except Exception as e:
            print(f"  {n_attn} SMs: {label}: {type(e).__name__}: {e}")

    def chain_on_b():
        cur = torch.cuda.current_stream()
        sb.wait_stream(cur)
        with torch.cuda.stream(sb):
            for l in range(LAYERS):
                chain(att_half, res_half[0], l)
        cur.wait_stream(sb)
    try:
        print(f"  {132 - n_attn} SMs: chain 128 rows alone on its partition: {timed(chain_on_b):.1f} us")
    except Exception as e:
        print(f"  chain on partition: {type(e).__name__}: {e}")

    def overlapped():
        """Per layer: A's attention on sa while B's chain runs on sb, then the roles swap."""
        cur = torch.cuda.current_stream()
        sa.wait_stream(cur); sb.wait_stream(cur)
        for l in range(LAYERS):
            for first, second in ((0, 1), (1, 0)):
                with torch.cuda.stream(sa):
                    out = attention((first * half, first * half + half), l)
                with torch.cuda.stream(sb):
                    chain(att_half, res_half[second], l)
                ev_a, ev_b = sa.record_event(), sb.record_event()
                sa.wait_event(ev_b); sb.wait_event(ev_a)
        cur.wait_stream(sa); cur.wait_stream(sb)
    try:
        print(f"  {n_attn}/{132 - n_attn} SMs: overlapped halves: {timed(overlapped):.1f} us a layer")
    except Exception as e:
        print(f"  overlapped: {type(e).__name__}: {e}")
