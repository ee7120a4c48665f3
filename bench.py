"""The origin document's benchmark: nano-vllm's workload (256 random-token prompts of 100-1024
tokens, 100-1024 output tokens each, ignore_eos, max_model_len=2048: 142,827 input and 133,966
output tokens), run through mini_engine, vLLM or transformers' continuous batching, reported
against the memory-traffic floor, and appended as one JSON line to benchmarks/results.jsonl.

    python bench.py --engine mini --model ~/models/Qwen3-0.6B
    python bench.py --engine mini --kernels none --enforce-eager --label "eager baseline"
    python bench.py --engine hf --num-seqs 64

With no --model it uses a random bf16 checkpoint of Qwen3-0.6B's exact shape, written once to a
cache folder. On a machine without a GPU the default is the CPU smoke workload: fewer, shorter
requests on a tiny random model, labelled "cpu-smoke" in the JSON line.
"""
import argparse
import dataclasses
import importlib.util
import json
import os
import random
import subprocess
import sys
import time
from datetime import datetime, timezone

REPO = os.path.dirname(os.path.abspath(__file__))
MAX_MODEL_LEN = 2048
# nano-vllm's bench.py, and the scaled-down stand-in for machines without a GPU.
WORKLOADS = {
    "full": dict(num_requests=256, min_len=100, max_input_len=1024, max_output_len=1024),
    "cpu-smoke": dict(num_requests=256, min_len=32, max_input_len=256, max_output_len=128),
}
# A tiny Qwen3 for the CPU smoke workload; its vocabulary covers the prompts' token ids (0-10000).
TINY_QWEN3 = dict(vocab_size=10240, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=MAX_MODEL_LEN,
                  bos_token_id=10238, eos_token_id=10239)


def make_workload(num_seqs: int | None = 256, num_requests: int = 256, min_len: int = 100,
                  max_input_len: int = 1024, max_output_len: int = 1024) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's workload, draw for draw (random.Random(0) is the stream random.seed(0) gives):
    all prompts first, then all max_tokens. num_seqs takes the first requests of the whole
    workload, so a smaller run is a prefix of the full one (None: all of them)."""
    num_seqs = num_requests if num_seqs is None else num_seqs
    if not 1 <= num_seqs <= num_requests:
        raise ValueError(f"num_seqs must be in [1, {num_requests}], got {num_seqs}")
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(min_len, max_input_len))]
               for _ in range(num_requests)]
    max_tokens = [rng.randint(min_len, max_output_len) for _ in range(num_requests)]
    return prompts[:num_seqs], max_tokens[:num_seqs]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=["mini", "mini-async", "vllm", "hf"], default="mini",
                   help="mini-async: mini_engine's AsyncLLM, every request its own concurrent generate()")
    p.add_argument("--output-kind", choices=["final_only", "delta", "cumulative"], default="final_only",
                   help="mini-async only: what each generate() yields (SamplingParams.output_kind)")
    p.add_argument("--model", help="checkpoint folder (default: the cached random Qwen3-0.6B, or the tiny "
                                   "model for the CPU smoke workload)")
    p.add_argument("--random-moe-layers", type=int, metavar="N",
                   help="instead of --model: a random bf16 checkpoint of Qwen3-30B-A3B's shape (128 experts, "
                        "8 a token) cut to N of its 48 layers, written once to the cache folder")
    p.add_argument("--random-8b-layers", type=int, metavar="N",
                   help="instead of --model: a random bf16 checkpoint of Qwen3-8B's shape cut to N of its 36 "
                        "layers, written once to the cache folder")
    p.add_argument("--workload", choices=["auto", "full", "cpu-smoke"], default="auto",
                   help="auto: full on a GPU, cpu-smoke without one")
    p.add_argument("--num-seqs", type=int, help="run only the first N requests of the workload")
    p.add_argument("--label", default="", help="free-text note saved in the JSON line")
    p.add_argument("--results", default=os.path.join(REPO, "benchmarks", "results.jsonl"))
    p.add_argument("--cache-dir", help="where the random checkpoints are kept (default ~/.cache/mini_engine)")
    p.add_argument("--temperature", type=float, default=0.6, help="nano-vllm's bench samples at 0.6")
    p.add_argument("--top-k", type=int, default=-1, help="-1: off, as nano-vllm's bench (Qwen3 asks for 20)")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0: off, as nano-vllm's bench (Qwen3 asks for 0.95)")
    p.add_argument("--min-p", type=float, default=0.0, help="0: off")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="0: off (not for --engine hf)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="0: off (not for --engine hf)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1: off")
    engine = p.add_argument_group("engine options (passed through; vLLM/transformers take what they can)")
    engine.add_argument("--max-num-seqs", type=int, default=256)
    engine.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN,
                        help=f"nano-vllm's bench uses {MAX_MODEL_LEN}; the checkpoint's own is Qwen3's 40,960")
    engine.add_argument("--max-num-batched-tokens", type=int)
    engine.add_argument("--block-size", type=int)
    engine.add_argument("--gpu-memory-utilization", type=float)
    engine.add_argument("--kernels", default="auto", help='mini only: "auto", "none" or a comma list')
    engine.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    engine.add_argument("--compilation-config", type=json.loads, help='mini only: JSON, as vLLM\'s, e.g. '
                        '\'{"cudagraph_mode": "FULL_DECODE_ONLY"}\' (steps with prompt tokens eager, no piecewise '
                        'graphs) or '
                        '\'{"max_cudagraph_capture_size": 64}\' (larger steps eager)')
    engine.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"],
                        help="mini and vllm: the KV cache's element type (auto: the model's)")
    engine.add_argument("--quantization", choices=["fp8"], help="mini only: fp8 weights (an FP8 checkpoint "
                        "is fp8 without it; with it a bf16 one is quantized as it loads)")
    four_bit = engine.add_mutually_exclusive_group()
    four_bit.add_argument("--awq", action="store_true", help="mini only: run the checkpoint as Qwen3-*-AWQ lays "
                          "itself out, 4-bit weights in groups of 128 (written once beside it by write_awq_layout)")
    four_bit.add_argument("--gptq", action="store_true", help="mini only: run the checkpoint as Qwen3-*-GPTQ-Int4 "
                          "lays itself out, 4-bit weights in groups of 128, v1 zero points (written once beside it by "
                          "write_gptq_layout; repacked into AWQ's layout as it loads)")
    engine.add_argument("--no-prefix-caching", action="store_true")
    engine.add_argument("--no-async-scheduling", action="store_true", help="mini only: each step waits for its tokens")
    engine.add_argument("--speculative-config", type=json.loads, help='mini only: JSON, as vLLM\'s, e.g. '
                        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\'')
    engine.add_argument("--logits-processors", nargs="+", metavar="NAME", help="mini only: custom logits "
                        "processors by qualified name (package.module:Class), loaded for the whole run")
    engine.add_argument("--random-loras", type=int, metavar="K", help="mini only: K random LoRA adapters of rank "
                        "--max-lora-rank on every projection (enable_lora, max_loras K), request i runs adapter i %% K")
    engine.add_argument("--max-lora-rank", type=int, default=16, help="mini only: with --random-loras")
    engine.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="GPUs the model is split over (mini and vllm); the floor counts their bandwidth together")
    p.add_argument("--profile", metavar="DIR", help="mini only: time every step (wall and GPU), print the "
                   "table by batch size, write steps.jsonl and profile.png to DIR")
    engine.add_argument("--hf-attn", default="paged|sdpa", help="hf only: attn_implementation to load with")
    return p.parse_args(argv)


def tiny_checkpoint(cache_dir: str | None) -> str:
    from mini_engine.model.random_checkpoint import QWEN3_0_6B, cached_checkpoint
    return cached_checkpoint("qwen3-tiny-random", QWEN3_0_6B | TINY_QWEN3, cache_dir)


def warm_up(llm, prompts: list[list[int]], sampling: dict) -> None:
    """Runs a workload of the timed one's shape (other random tokens, so the prefix cache gains
    nothing) with the timed run's sampling options: every kernel the timed run needs is compiled
    before the clock starts."""
    from mini_engine import SamplingParams
    from benchmarks.peers import WARMUP_PROMPTS, WARMUP_TOKENS
    llm.generate(WARMUP_PROMPTS, SamplingParams(max_tokens=WARMUP_TOKENS, **sampling), use_tqdm=False)
    rng = random.Random(1)
    lengths = [len(p) for p in prompts[:32]]
    # max_tokens 1..32: the batch shrinks through every small size, as the run's tail will.
    llm.generate([[rng.randint(0, 10000) for _ in range(n)] for n in lengths],
                 [SamplingParams(max_tokens=i + 1, ignore_eos=True, **sampling)
                  for i in range(len(lengths))], use_tqdm=False)


def four_bit_checkpoint(model: str, method: str, device: str) -> str:
    """model's AWQ or GPTQ layout (`method`; group 128), written once beside it (rounded on `device`)."""
    from mini_engine.model.random_checkpoint import write_awq_layout, write_gptq_layout, written_once
    write = {"awq": write_awq_layout, "gptq": write_gptq_layout}[method]
    return written_once(os.path.join(model, f"{method}-g128"), lambda folder: write(model, folder, device=device))


def random_loras(model: str, count: int, rank: int) -> list:
    """count random adapters of the model's shape (written once, beside the checkpoint)."""
    from mini_engine import LoRARequest
    from mini_engine.config import ModelConfig
    from mini_engine.lora import write_random_adapter
    mc = ModelConfig.from_pretrained(model)
    return [LoRARequest(f"random-{i}", i + 1, write_random_adapter(os.path.join(model, f"lora-r{rank}-{i}"), mc, rank, i))
            for i in range(count)]


def mini_engine_options(opts) -> dict:
    """The engine options bench.py passes to LLM (and AsyncLLM)."""
    kwargs = dict(max_model_len=opts.max_model_len, max_num_seqs=opts.max_num_seqs, kernels=opts.kernels,
                  enforce_eager=opts.enforce_eager, enable_prefix_caching=not opts.no_prefix_caching,
                  kv_cache_dtype=opts.kv_cache_dtype, tensor_parallel_size=opts.tensor_parallel_size,
                  async_scheduling=not opts.no_async_scheduling)
    for name in ("max_num_batched_tokens", "block_size", "gpu_memory_utilization", "speculative_config",
                 "quantization", "logits_processors", "compilation_config"):
        if getattr(opts, name) is not None:
            kwargs[name] = getattr(opts, name)
    return kwargs


def run_mini(model: str, prompts, max_tokens, opts) -> dict:
    from mini_engine import LLM, SamplingParams
    from benchmarks.peers import sampling_options
    kwargs = mini_engine_options(opts)
    loras = None
    if opts.random_loras:
        kwargs |= dict(enable_lora=True, max_loras=opts.random_loras, max_lora_rank=opts.max_lora_rank)
        loras = random_loras(model, opts.random_loras, opts.max_lora_rank)
    llm = LLM(model, **kwargs)
    engine = llm.engine
    warm_up(llm, prompts, sampling_options(opts))
    params = [SamplingParams(ignore_eos=True, max_tokens=m, **sampling_options(opts)) for m in max_tokens]
    profiler = None
    if opts.profile:
        from benchmarks.step_profile import StepProfiler
        profiler = StepProfiler(engine, num_requests=len(prompts))
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False,   # returns once every token is on the host
                           lora_request=None if loras is None else [loras[i % len(loras)] for i in range(len(prompts))])
    wall = time.perf_counter() - start
    if profiler:
        profiler.print_summary()
        print("profile picture:", profiler.save(opts.profile, f"mini_engine, {len(prompts)} requests, "
                                                f"wall {wall:.2f} s (profiled: one event pair per step)"))
    config = {f.name: getattr(engine.config, f.name) for f in dataclasses.fields(engine.config)
              if f.name != "model_config"}
    if engine.config.speculative_config is not None:
        config["speculative_config"] = dataclasses.asdict(engine.config.speculative_config)
    config["logits_processors"] = [f"{c.__module__}:{c.__qualname__}" for c in engine.config.logits_processors]
    runner = engine.runner
    config |= {"kernels_resolved": sorted(runner.kernels), "num_kv_blocks": runner.num_kv_blocks,
               "dtype_resolved": str(runner.dtype).removeprefix("torch."),
               "kv_cache_dtype_resolved": str(runner.kv_cache_dtype).removeprefix("torch."),
               "cuda_graphs": getattr(runner, "use_cuda_graphs", None),
               "cuda_graph_capture_s": getattr(runner, "cuda_graph_capture_s", None),
               "piecewise_sizes_captured": list(getattr(runner, "piecewise_sizes", ())),
               "cuda_graph_pool_bytes": getattr(runner, "cuda_graph_pool_bytes", None),
               "cuda_graph_reserve_bytes": getattr(runner, "graph_reserve_bytes", None),
               "gemm_warmup_s": getattr(runner, "gemm_warmup_s", None)}
    kv_blocks_free = engine.num_free_blocks == engine.block_manager.num_blocks
    weight_bytes = expert_bytes = None
    if engine.config.quantization:      # fp8 weights: the bytes the ranks hold (a tied lm_head once), for the floor
        held = {name: p.numel() * p.element_size() for name, p in runner.model.named_parameters()}
        weight_bytes = sum(held.values()) * opts.tensor_parallel_size
        # a Qwen3-MoE's fp8 experts (their scales included), of which a step reads those its tokens pick
        expert_bytes = sum(n for name, n in held.items() if ".experts." in name) * opts.tensor_parallel_size or None
    llm.shutdown()
    return {"wall_s": wall, "output_counts": [len(o.outputs[0].token_ids) for o in outputs],
            "kv_blocks_free": kv_blocks_free,
            "dtype_bytes": runner.dtype.itemsize, "kv_dtype_bytes": runner.kv_cache_dtype.itemsize,
            "weight_bytes": weight_bytes, "expert_bytes": expert_bytes,
            "engine_version": None, "engine_config": config,
            "engine_stats": {"num_preemptions": engine.num_preemptions,
                             "prefix_cache_hit_tokens": engine.prefix_cache_hit_tokens,
                             **({"spec_decode": dataclasses.asdict(engine.spec_decode_stats)}
                                if engine.config.speculative_config is not None else {})}}


def run_mini_async(model: str, prompts, max_tokens, opts) -> dict:
    """The workload through AsyncLLM: every request its own generate(), all started at once (the
    engine's process schedules them as the offline engine does), after a warm-up of bench.py's shape."""
    import asyncio
    from mini_engine import AsyncLLM, RequestOutputKind, SamplingParams
    from benchmarks.peers import WARMUP_PROMPTS, WARMUP_TOKENS, sampling_options
    if opts.random_loras or opts.tensor_parallel_size > 1:
        sys.exit("bench.py --engine mini-async: without --random-loras and -tp")
    llm = AsyncLLM(model, **mini_engine_options(opts))
    sampling = sampling_options(opts)
    kind = RequestOutputKind[opts.output_kind.upper()]

    async def generate_all(batch, params, tag):
        async def one(i):
            async for output in llm.generate(batch[i], params[i], request_id=f"{tag}-{i}"):
                counts[i] = len(output.outputs[0].token_ids) if kind is not RequestOutputKind.DELTA else \
                    counts[i] + len(output.outputs[0].token_ids)
        counts = [0] * len(batch)
        await asyncio.gather(*(one(i) for i in range(len(batch))))
        return counts

    async def run():
        rng = random.Random(1)       # bench.py's warm-up: its shapes, other tokens
        await generate_all(WARMUP_PROMPTS, [SamplingParams(max_tokens=WARMUP_TOKENS, **sampling)] * 2, "warm")
        lengths = [len(p) for p in prompts[:32]]
        await generate_all([[rng.randint(0, 10000) for _ in range(n)] for n in lengths],
                           [SamplingParams(max_tokens=i + 1, ignore_eos=True, **sampling) for i in range(len(lengths))],
                           "warm-tail")
        params = [SamplingParams(ignore_eos=True, max_tokens=m, output_kind=kind, **sampling) for m in max_tokens]
        start = time.perf_counter()
        counts = await generate_all(prompts, params, "run")
        wall = time.perf_counter() - start
        for _ in range(200):            # the engine's last report comes just after the last tokens
            if "kv_cache_blocks_used{" in llm.metrics_text() and blocks_used() == 0:
                break
            await asyncio.sleep(0.01)
        return wall, counts

    def blocks_used() -> float:
        line = next(l for l in llm.metrics_text().splitlines() if l.startswith("mini_engine:kv_cache_blocks_used{"))
        return float(line.rsplit(" ", 1)[1])

    wall, counts = asyncio.run(run())
    kv_blocks_free = blocks_used() == 0
    config = {f.name: getattr(llm.config, f.name) for f in dataclasses.fields(llm.config)
              if f.name not in ("model_config", "sampling_defaults")}
    config["logits_processors"] = [f"{c.__module__}:{c.__qualname__}" for c in llm.config.logits_processors]
    config |= {"num_kv_blocks": llm.limits.num_blocks, "output_kind": opts.output_kind}
    llm.shutdown()
    import torch
    dtype_bytes = 2 if torch.cuda.is_available() else 4       # the runner's default dtypes (bf16; fp32 on CPU)
    return {"wall_s": wall, "output_counts": counts, "kv_blocks_free": kv_blocks_free,
            "dtype_bytes": dtype_bytes,
            "kv_dtype_bytes": 1 if llm.config.kv_cache_dtype.startswith("fp8") else dtype_bytes,
            "weight_bytes": None, "expert_bytes": None, "engine_version": None, "engine_config": config}


def fmt_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:,.0f} B"


def git_commit() -> tuple[str | None, bool | None]:
    """HEAD and whether tracked files differ from it. Where the tree travels without .git (the GPU
    machine), the commit comes from MINI_ENGINE_GIT_COMMIT, set by whoever sent the tree."""
    if os.environ.get("MINI_ENGINE_GIT_COMMIT"):
        return os.environ["MINI_ENGINE_GIT_COMMIT"], None
    try:
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
        status = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, check=True).stdout
        return commit, bool(status.strip())
    except (OSError, subprocess.CalledProcessError):
        return None, None


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        sys.exit("bench.py --engine vllm: vllm is not installed here (pip install vllm); nothing was run")
    import torch
    from benchmarks.floor import checkpoint_num_params, copy_bandwidth, floor_report, kv_bytes_per_token, workload_floor
    from benchmarks.peers import run_hf, run_vllm
    from mini_engine.config import ModelConfig

    has_cuda = torch.cuda.is_available()
    workload = opts.workload if opts.workload != "auto" else ("full" if has_cuda else "cpu-smoke")
    if opts.model:
        model = os.path.expanduser(opts.model)
    elif opts.random_moe_layers:
        from mini_engine.model.random_checkpoint import moe_checkpoint
        model = moe_checkpoint(opts.random_moe_layers, opts.cache_dir, device="cuda" if has_cuda else "cpu")
    elif opts.random_8b_layers:
        from mini_engine.model.random_checkpoint import dense_8b_checkpoint
        model = dense_8b_checkpoint(opts.random_8b_layers, opts.cache_dir, device="cuda" if has_cuda else "cpu")
    elif workload == "cpu-smoke":
        model = tiny_checkpoint(opts.cache_dir)
    else:
        from mini_engine.model.random_checkpoint import default_checkpoint
        model = default_checkpoint(opts.cache_dir, device="cuda" if has_cuda else "cpu")
    if opts.awq or opts.gptq:
        model = four_bit_checkpoint(model, "awq" if opts.awq else "gptq", "cuda" if has_cuda else "cpu")
    prompts, max_tokens = make_workload(opts.num_seqs, **WORKLOADS[workload])
    input_tokens, output_tokens = sum(map(len, prompts)), sum(max_tokens)

    # Measure the copy bandwidth before any engine takes the GPU's memory for its KV pool.
    device = torch.device("cuda" if has_cuda else "cpu")
    bandwidth = copy_bandwidth(device)
    print(f"{opts.engine}: {workload} workload, {len(prompts)} requests, {input_tokens:,} input and "
          f"{output_tokens:,} output tokens; model {model}", flush=True)
    run = {"mini": run_mini, "mini-async": run_mini_async, "vllm": run_vllm, "hf": run_hf}[opts.engine]
    result = run(model, prompts, max_tokens, opts)

    wall = result["wall_s"]
    with open(os.path.join(model, "config.json")) as f:
        model_config = json.load(f)
    dtype_bytes = result["dtype_bytes"]
    # Split over N GPUs, the bytes are read N at a time: each GPU reads its share at its own bandwidth.
    experts = None
    if model_config.get("model_type") == "qwen3_moe":      # a step reads only the experts its tokens pick
        mc = ModelConfig.from_dict(model_config)
        experts = (result.get("expert_bytes") or checkpoint_num_params(model, experts_only=True) * dtype_bytes,
                   mc.num_experts, mc.num_experts_per_tok)
    floor = floor_report(workload_floor([len(p) for p in prompts], max_tokens,
                                        result.get("weight_bytes") or checkpoint_num_params(model) * dtype_bytes,
                                        kv_bytes_per_token(model_config, result["kv_dtype_bytes"]), experts),
                         bandwidth * opts.tensor_parallel_size, wall)
    exact = result["output_counts"] == max_tokens
    commit, dirty = git_commit()
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    record = {
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"), "engine": opts.engine,
        "label": opts.label, "workload": workload, "cpu_smoke": workload == "cpu-smoke",
        "git_commit": commit, "git_dirty": dirty,
        "device": torch.cuda.get_device_name(device) if has_cuda else "cpu",
        "tensor_parallel_size": opts.tensor_parallel_size,
        "torch": torch.__version__, "triton": triton_version, "engine_version": result["engine_version"],
        "model": model, "num_seqs": len(prompts), "input_tokens": input_tokens, "output_tokens": output_tokens,
        "wall_s": wall, "output_tok_s": output_tokens / wall, "total_tok_s": (input_tokens + output_tokens) / wall,
        **floor,
        "checks": {"exact_max_tokens": exact, "kv_blocks_free": result["kv_blocks_free"]},
        "config": {k: v for k, v in vars(opts).items() if k not in ("results", "cache_dir")},
        "engine_config": result["engine_config"], "engine_stats": result.get("engine_stats", {}),
    }
    os.makedirs(os.path.dirname(os.path.abspath(opts.results)), exist_ok=True)
    with open(opts.results, "a") as f:
        f.write(json.dumps(record, default=str) + "\n")

    print(f"wall {wall:.2f} s | output {record['output_tok_s']:,.1f} tok/s | total {record['total_tok_s']:,.1f} tok/s")
    print(f"floor {floor['floor_s']:.3f} s: KV {fmt_bytes(floor['kv_read_bytes'])} + weights "
          f"{fmt_bytes(floor['weight_bytes'])} x {floor['decode_steps']} steps = {fmt_bytes(floor['floor_bytes'])} "
          f"at {floor['copy_bandwidth_GBps']:,.0f} GB/s copy bandwidth (device-to-device copy, read + write)")
    print(f"achieved {floor['floor_fraction']:.1%} of the floor: {floor['achieved_GBps']:,.1f} GB/s of floor traffic")
    graphs = result["engine_config"].get("cuda_graph_capture_s")
    if graphs is not None:
        cfg = result["engine_config"]
        # (The runner's: no piecewise graphs under tensor parallelism or LoRA, whatever the config says.)
        sizes, pieces = cfg["cuda_graph_sizes"], cfg["piecewise_sizes_captured"]
        what = [f"{len(sizes)} decode batch sizes ({sizes[0]} to {sizes[-1]})" if sizes else "",
                f"{len(pieces)} piecewise token counts ({pieces[0]} to {pieces[-1]})" if pieces else ""]
        print(f"CUDA graphs: {' and '.join(w for w in what if w)} captured in {graphs:.1f} s, pool "
              f"{cfg['cuda_graph_pool_bytes'] / 2**20:.0f} MiB "
              f"(set aside when sizing the KV pool: {cfg['cuda_graph_reserve_bytes'] / 2**20:.0f} MiB)")
    if result["engine_config"].get("gemm_warmup_s") is not None:
        print(f"cuBLAS kernels of eager steps loaded at start-up in {result['engine_config']['gemm_warmup_s']:.2f} s")
    print(f"checks: every request got exactly its max_tokens: {exact}; "
          f"KV blocks all free after the run: {result['kv_blocks_free']}")
    print(f"logged to {opts.results}" + (" (CPU smoke workload: not the benchmark)" if record["cpu_smoke"] else ""))
    failures = []
    if not exact:
        bad = [i for i, (got, want) in enumerate(zip(result["output_counts"], max_tokens)) if got != want]
        failures.append(f"{len(bad)} requests did not get exactly their max_tokens (first: {bad[:5]})")
    if result["kv_blocks_free"] is False:
        failures.append("KV blocks leaked: free blocks != total blocks after the run")
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
