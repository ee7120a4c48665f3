"""The memory-traffic floor of a workload: the bytes any engine must read from device memory to
generate its tokens, and the copy bandwidth that turns those bytes into seconds.

Decode is bound by memory, not FLOPs: each step reads every weight once (the batch shares them) and
each running sequence reads its whole KV context. Summed over a workload:

    kv_read_bytes     = kv_bytes_per_token * sum over generated tokens of their context length
    weight_read_bytes = weight_bytes * (number of steps) >= weight_bytes * max(max_tokens)
    floor_s           = (kv_read_bytes + weight_read_bytes) / copy bandwidth

Output token j (0-based) of a request with a P-token prompt is computed over a context of P + j
tokens (token 0 by the prefill, over the prompt; token j by the decode of token P + j - 1, which
attends to itself too), so a request of M output tokens reads sum_{j<M} (P + j) = M*P + M(M-1)/2.
"""
import json
import os
import struct
import time

import torch


def context_tokens_read(prompt_lens: list[int], max_tokens: list[int]) -> int:
    """Sum over every generated token of its context length (see the module docstring)."""
    return sum(m * p + m * (m - 1) // 2 for p, m in zip(prompt_lens, max_tokens))


def kv_bytes_per_token(config: dict, dtype_bytes: int) -> int:
    """K and V of one token across all layers: layers * 2 * kv_heads * head_dim * dtype bytes."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    return config["num_hidden_layers"] * 2 * kv_heads * head_dim * dtype_bytes


def checkpoint_num_params(path: str, experts_only: bool = False) -> int:
    """Parameters a decode step reads, counted from the safetensors headers (no tensor is loaded).
    A tied lm_head is the embedding matrix itself: some checkpoints (Qwen3-0.6B's) store it anyway,
    so it is skipped when config.json says the embeddings are tied. experts_only: a Qwen3-MoE
    checkpoint's expert projections alone (tensors under `.experts.`)."""
    with open(os.path.join(path, "config.json")) as f:
        tied = json.load(f).get("tie_word_embeddings", False)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    total = 0
    for name in files:
        with open(os.path.join(path, name), "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        for tensor, info in header.items():
            if tensor == "__metadata__" or (tied and tensor == "lm_head.weight"):
                continue
            if experts_only and ".experts." not in tensor:
                continue
            n = 1
            for d in info["shape"]:
                n *= d
            total += n
    return total


def experts_touched(num_experts: int, top_k: int, batch: int) -> float:
    """The distinct experts a layer reads in a step of `batch` tokens that each pick top_k of
    num_experts at random, uniformly: E (1 - (1 - k/E)^b) on average. A random checkpoint's router
    picks close to that; a trained one's routing is not uniform, and for it this is an estimate."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def workload_floor(prompt_lens: list[int], max_tokens: list[int], weight_bytes: int,
                   kv_bytes_per_tok: int, experts: tuple[int, int, int] | None = None) -> dict:
    """Bytes the floor counts for this workload (seconds need a bandwidth: see floor_report).

    experts: a Qwen3-MoE checkpoint's (expert bytes, num_experts, top_k), of which weight_bytes
    holds the expert bytes too. A step then reads its experts' share of them: at step j every
    request with more than j output tokens is still running, and they touch experts_touched of
    each layer's experts, so the tail of a run reads a few experts where its first steps read all."""
    kv_read = kv_bytes_per_tok * context_tokens_read(prompt_lens, max_tokens)
    decode_steps = max(max_tokens)       # the longest request alone needs this many forward passes
    weight_read = weight_bytes * decode_steps
    if experts is not None:
        expert_bytes, num_experts, top_k = experts
        running = [sum(m > j for m in max_tokens) for j in range(decode_steps)]
        weight_read = round(sum(weight_bytes - expert_bytes * (1 - experts_touched(num_experts, top_k, b) / num_experts)
                                for b in running))
    return {"weight_bytes": weight_bytes, "kv_bytes_per_token": kv_bytes_per_tok, "decode_steps": decode_steps,
            "kv_read_bytes": kv_read, "weight_read_bytes": weight_read, "floor_bytes": kv_read + weight_read}


def floor_report(floor: dict, bandwidth_bytes_s: float, wall_s: float) -> dict:
    """Floor seconds at the measured bandwidth, the fraction of it a run achieved, and the achieved
    memory bandwidth (floor bytes / wall time, the number gpt-fast reports)."""
    floor_s = floor["floor_bytes"] / bandwidth_bytes_s
    return floor | {"copy_bandwidth_GBps": bandwidth_bytes_s / 1e9, "floor_s": floor_s,
                    "floor_fraction": floor_s / wall_s, "achieved_GBps": floor["floor_bytes"] / wall_s / 1e9}


def copy_bandwidth(device: torch.device, nbytes: int | None = None, iters: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written (2 * nbytes per
    copy). 4 GiB on CUDA, as the floor's reference; 256 MiB on CPU. Frees its buffers afterwards,
    so engines that size their KV pool from free memory see it all again."""
    is_cuda = device.type == "cuda"
    nbytes = nbytes or (4 << 30 if is_cuda else 256 << 20)
    src = torch.full((nbytes,), 1, dtype=torch.uint8, device=device)   # touched: no zero-page reads
    dst = torch.empty_like(src)
    dst.copy_(src)                                                     # warm-up (and first touch)
    if is_cuda:
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dst.copy_(src)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        seconds = time.perf_counter() - t0
    del src, dst
    if is_cuda:
        torch.cuda.empty_cache()
    return 2 * nbytes * iters / seconds
