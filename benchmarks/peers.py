"""The peer engines bench.py compares against, on the same workload: vLLM's offline `LLM`, and
Hugging Face transformers' continuous batching (the peer that runs where vLLM is not installed).

Each run_* returns what bench.py records: wall seconds around the timed generate (warm-up excluded),
the number of tokens each request got, whether the KV pool came back whole (None: not observable
from outside that engine), the bytes per weight/KV element, and the engine's resolved config."""
import dataclasses
import inspect
import os
import sys
import time

import torch

WARMUP_PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]]    # compile/autotune/graphs before timing
WARMUP_TOKENS = 4

# bench.py's sampling options, named as mini_engine's and vLLM's SamplingParams name them.
SAMPLING_OPTIONS = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty")


def sampling_options(opts) -> dict:
    return {name: getattr(opts, name) for name in SAMPLING_OPTIONS}


def run_vllm(model: str, prompts, max_tokens, opts) -> dict:
    import vllm                                   # bench.py checked that it is installed
    from vllm import LLM, SamplingParams
    has_tokenizer = os.path.isfile(os.path.join(model, "tokenizer.json"))
    kwargs = dict(max_model_len=opts.max_model_len, max_num_seqs=opts.max_num_seqs, enforce_eager=opts.enforce_eager,
                  enable_prefix_caching=not opts.no_prefix_caching, skip_tokenizer_init=not has_tokenizer,
                  kv_cache_dtype=opts.kv_cache_dtype, tensor_parallel_size=opts.tensor_parallel_size)
    for name in ("max_num_batched_tokens", "block_size", "gpu_memory_utilization"):
        if getattr(opts, name) is not None:
            kwargs[name] = getattr(opts, name)
    llm = LLM(model, **kwargs)

    def params(m):
        return SamplingParams(ignore_eos=True, max_tokens=m, detokenize=has_tokenizer, **sampling_options(opts))
    llm.generate([{"prompt_token_ids": p} for p in WARMUP_PROMPTS], params(WARMUP_TOKENS), use_tqdm=False)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    sampling = [params(m) for m in max_tokens]
    start = time.perf_counter()
    outputs = llm.generate(inputs, sampling, use_tqdm=False)
    wall = time.perf_counter() - start
    return {"wall_s": wall, "output_counts": [len(o.outputs[0].token_ids) for o in outputs],
            "kv_blocks_free": None, "dtype_bytes": 2,
            "kv_dtype_bytes": 1 if opts.kv_cache_dtype.startswith("fp8") else 2,
            "engine_version": vllm.__version__,
            "engine_config": kwargs}


def filter_kwargs(fn_or_cls, kwargs: dict) -> dict:
    """Keep the keyword arguments this transformers version accepts (the CB API moves quickly)."""
    if dataclasses.is_dataclass(fn_or_cls):
        names = {f.name for f in dataclasses.fields(fn_or_cls)}
    else:
        names = set(inspect.signature(fn_or_cls).parameters)
    return {k: v for k, v in kwargs.items() if k in names}


def run_hf(model: str, prompts, max_tokens, opts) -> dict:
    """transformers' ContinuousBatchingManager, driven request by request: generate_batch takes one
    max_new_tokens for all requests, and this workload gives each its own. EOS is disabled with
    eos_token_id=-1 (what transformers itself uses for 'no EOS')."""
    if opts.kv_cache_dtype != "auto":
        sys.exit(f"bench.py --engine hf: --kv-cache-dtype {opts.kv_cache_dtype} is for mini and vllm; nothing was run")
    if opts.tensor_parallel_size != 1:
        sys.exit("bench.py --engine hf: --tensor-parallel-size is for mini and vllm; nothing was run")
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError:
        ContinuousBatchingConfig = None
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints
    except ImportError:
        WorkloadHints = None

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hf_model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation=opts.hf_attn)
    hf_model = hf_model.to(device).eval()
    if opts.presence_penalty or opts.frequency_penalty:
        raise SystemExit("bench.py --engine hf: transformers has no presence or frequency penalty")
    sampling = dict(do_sample=True, temperature=opts.temperature, top_k=max(opts.top_k, 0), top_p=opts.top_p,
                    min_p=opts.min_p or None) if opts.temperature > 0 else dict(do_sample=False)
    sampling["repetition_penalty"] = opts.repetition_penalty
    generation_config = GenerationConfig(max_new_tokens=max(max_tokens), eos_token_id=-1, pad_token_id=0, **sampling)
    cb_kwargs = dict(max_requests_per_batch=opts.max_num_seqs, allow_block_sharing=not opts.no_prefix_caching,
                     auto_switch_to_flash=False)   # keep the attention we asked for: nothing to download
    if opts.max_num_batched_tokens is not None:
        cb_kwargs["max_batch_tokens"] = opts.max_num_batched_tokens
    if opts.gpu_memory_utilization is not None:
        cb_kwargs["max_memory_percent"] = opts.gpu_memory_utilization
    init_kwargs = {"generation_config": generation_config}
    if ContinuousBatchingConfig is not None:
        init_kwargs["continuous_batching_config"] = ContinuousBatchingConfig(
            **filter_kwargs(ContinuousBatchingConfig, cb_kwargs))
    if WorkloadHints is not None:
        init_kwargs["workload_hints"] = WorkloadHints(max_prompt_length=max(map(len, prompts)),
                                                      max_generated_length=max(max_tokens), num_requests=len(prompts))
    init_kwargs = filter_kwargs(hf_model.init_continuous_batching, init_kwargs)
    eos_kwarg = {"eos_token_id": -1}

    with torch.no_grad():
        manager = hf_model.init_continuous_batching(**init_kwargs)
        if "eos_token_id" not in inspect.signature(manager.add_request).parameters:
            eos_kwarg = {}                         # then generation_config's -1 is what add_request uses
        if hasattr(manager, "warmup"):
            manager.warmup()                       # CUDA graph capture, cache allocation
        manager.start()
        try:
            def run(requests):
                for request_id, ids, m in requests:
                    manager.add_request(ids, request_id=request_id, max_new_tokens=m, **eos_kwarg)
                results = {}
                while len(results) < len(requests):
                    result = manager.get_result(timeout=1)
                    if result is None:
                        if not manager.is_running():
                            raise RuntimeError(f"transformers' generation thread stopped with "
                                               f"{len(requests) - len(results)} requests unfinished")
                    elif result.is_finished():
                        if result.error is not None:
                            raise RuntimeError(f"request {result.request_id} failed: {result.error}")
                        results[result.request_id] = result
                return results

            run([(f"warmup-{i}", p, WARMUP_TOKENS) for i, p in enumerate(WARMUP_PROMPTS)])
            requests = [(f"bench-{i}", p, m) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
            start = time.perf_counter()
            results = run(requests)
            wall = time.perf_counter() - start
        finally:
            manager.stop(block=True, timeout=30)
    resolved = getattr(manager, "continuous_batching_config", None)
    engine_config = {"attn_implementation": opts.hf_attn, "dtype": str(dtype).removeprefix("torch."),
                     "generation_config": sampling,
                     "continuous_batching_config": (
                         {k: repr(v) if not isinstance(v, (int, float, str, bool, type(None))) else v
                          for k, v in ((f.name, getattr(resolved, f.name)) for f in dataclasses.fields(resolved))}
                         if dataclasses.is_dataclass(resolved) else cb_kwargs)}
    return {"wall_s": wall, "output_counts": [len(results[r[0]].generated_tokens) for r in requests],
            "kv_blocks_free": None, "dtype_bytes": dtype.itemsize, "kv_dtype_bytes": dtype.itemsize,
            "engine_version": transformers.__version__,
            "engine_config": engine_config}
