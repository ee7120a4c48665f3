"""Owns the model and the KV pool on the device: turns a scheduled batch into tensors, runs the
forward pass and the sampler, and sizes the pool from measured memory."""
import atexit
import contextlib
import random
import time
import warnings

import numpy as np
import torch
import torch.nn.functional as F

from mini_engine.config import KV_CACHE_DTYPES, EngineConfig
from mini_engine.distributed import (TensorParallel, abandon_process_group, check_no_process_group, init_process_group,
                                     leave_process_group, min_over_ranks)
from mini_engine.kernels import KERNEL_NAMES, resolve_kernels
from mini_engine.kernels.prev_tokens import take_prev_tokens, take_prev_tokens_ref
from mini_engine.compilation_config import default_capture_sizes, padded_size
from mini_engine.kernels.paged_attention import (DECODE_STAGES, DECODE_TILE_N, decode_num_splits,
                                                decode_workspace_numel, prefill_block_q, prefill_work)
from mini_engine.kernels.triton_utils import num_sms
from mini_engine.kernels.rotary_kv import FP8_DTYPES
from mini_engine.kernels.sampling import sample
from mini_engine.layers.attention import AttentionMetadata
from mini_engine.host_to_device import to_device
from mini_engine.layers.pooler import pool_chunks, pooled_token_indices
from mini_engine.layers.penalties import (PenaltyState, allowed_token_tensors, banned_token_tensors,
                                         grammar_bitmask_tensors, logit_bias_tensors, penalty_tensors)
from mini_engine.layers.sampler import (Sampler, SamplingTensors, candidate_top_k, logprob_tensors, needs_top_k_top_p,
                                       prompt_logprob_tensors, prompt_logprobs_by_row, sample_logprobs)
from mini_engine.layers.moe import Qwen3SparseMoeBlock
from mini_engine.logits_processors import LogitsProcessors
from mini_engine.model.loader import hold_quantized_weights, load_model
from mini_engine.model.qwen3 import Qwen3ForCausalLM, Qwen3MLP
from mini_engine.quantization import AwqConfig
from mini_engine.runner.batch import BatchRow, StepHandle, StepInputBuffers, StepTensors
from mini_engine.runner.cuda_graph import CUDAGraphRunner
from mini_engine.runner.lora_adapters import LoRAAdapters
from mini_engine.runner.piecewise_graph import PiecewiseGraphRunner
from mini_engine.runner.sleep_mode import SleepState, distinct_storages, release, restore
from mini_engine.runner.tensor_parallel_workers import TensorParallelWorkers
from mini_engine.runner.weight_updates import WeightUpdater, broadcast_tensor
from mini_engine.sampling_params import SamplingParams


# An eager step of more tokens than max_num_seqs (a decode batch has at most that many) runs its
# products over a multiple of this many rows: the padding tokens write no KV and belong to no
# sequence. So the row counts cuBLAS can see are few, and load_gemm_kernels launches each once.
EAGER_TOKEN_MULTIPLE = 64


def padded_token_count(num_tokens: int, max_num_seqs: int) -> int:
    if num_tokens <= max_num_seqs:
        return num_tokens
    return -(-num_tokens // EAGER_TOKEN_MULTIPLE) * EAGER_TOKEN_MULTIPLE


def token_column(values: list[int], chunks: list[np.ndarray], pad: int, fill: int) -> list[int] | np.ndarray:
    """One token-level input of a step: the single-token rows' values, then the prefill chunks'
    arrays, then pad tokens of fill."""
    if not chunks:
        return values + [fill] * pad
    return np.concatenate([np.asarray(values, dtype=np.int64), *chunks, np.full(pad, fill, dtype=np.int64)])


def piecewise_sizes_for(config: EngineConfig, graphs: bool, tp: TensorParallel, lora: bool) -> tuple[int, ...]:
    """The token counts the runner captures as piecewise graphs (runner/piecewise_graph.py): the
    config's where graphs run at all, but none under tensor parallelism or LoRA, whose collectives
    and adapter masks the pieces were neither built nor run with (rank 0 warns: those steps run eager)."""
    if not graphs or not config.piecewise_graph_sizes:
        return ()
    if tp.size > 1 or lora:
        if tp.rank == 0:
            decode = "" if config.cuda_graph_sizes else " (and, in PIECEWISE mode, every decode step too)"
            warnings.warn(f"no piecewise CUDA graphs under {'tensor parallelism' if tp.size > 1 else 'LoRA'}: steps "
                          f"with prompt tokens run eager{decode}", stacklevel=2)
        return ()
    return config.piecewise_graph_sizes


def gemm_row_counts(max_num_seqs: int, max_num_batched_tokens: int) -> tuple[list[int], list[int]]:
    """Every row count an eager step's cuBLAS products can have: (lm_head's, the projections').
    lm_head sees the rows a step samples, 1 to max_num_seqs; the projections see a step's tokens,
    as padded_token_count pads them."""
    sample_rows = list(range(1, max_num_seqs + 1))
    token_rows = sorted({padded_token_count(n, max_num_seqs) for n in range(1, max_num_batched_tokens + 1)})
    return sample_rows, token_rows


# What a CUDA graphs' pool takes at the least, whatever its allocations: PyTorch's caching
# allocator gives it whole segments, one of 2 MiB for its small blocks and one of 20 MiB for blocks
# of 1-10 MiB. A tiny model's graphs took exactly these 22 MiB on the H200 for a 2 MiB peak
# (benchmarks/NOTES.md, entry 68). A floor, not a bound: the warning after capture is the check.
GRAPH_POOL_SEGMENTS_BYTES = 22 * 2**20

# A row that samples one token greedily: the piecewise graphs' reserve step's
# (ModelRunner.piecewise_sized_step) and a draft model's (runner/draft_model.py).
GREEDY_ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1)

# The dtypes the model may run in, by name (torch's aliases included).
MODEL_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16, "half": torch.float16, "float64": torch.float64, "double": torch.float64}


def host_tier_chunks(num_bytes: int, slot_bytes: int, largest: int = 2**30) -> list[int]:
    """The host tier's slots in chunks, each at most num_bytes' largest power of two still left,
    and at most `largest` (or one slot, if larger): each chunk's allocation then pins what it asks,
    all of them together at most num_bytes."""
    largest = max(largest, 1 << (slot_bytes - 1).bit_length())
    chunks = []
    while num_bytes >= slot_bytes:
        chunk = min(largest, 1 << (num_bytes.bit_length() - 1))
        if chunk < slot_bytes:
            break
        chunks.append(chunk // slot_bytes)
        num_bytes -= chunk
    return chunks


def resolve_device_dtype(config: EngineConfig, tp: TensorParallel = TensorParallel()) -> tuple[torch.device, torch.dtype]:
    device = config.resolved_device()
    if device.type == "cuda" and tp.size > 1:
        if torch.cuda.device_count() < tp.size:
            raise ValueError(f"tensor_parallel_size={tp.size} needs {tp.size} GPUs, this machine has "
                             f"{torch.cuda.device_count()}")
        device = torch.device("cuda", tp.rank)
        torch.cuda.set_device(device)
    if config.dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        name = str(config.dtype).removeprefix("torch.")          # a torch.dtype, or its name
        dtype = MODEL_DTYPES.get(name)
        if dtype is None:
            raise ValueError(f"dtype {config.dtype!r} is not one of {sorted(MODEL_DTYPES)}")
    return device, dtype


def resolve_kv_cache_dtype(config: EngineConfig, device: torch.device, model_dtype: torch.dtype,
                           kernels: frozenset[str]) -> torch.dtype:
    dtype = KV_CACHE_DTYPES[config.kv_cache_dtype] or model_dtype
    # Triton converts to and from e4m3 on compute capability 8.9 (Ada) and newer only. e5m2's
    # kernels compile for older GPUs too, but have not run on one: both are refused there.
    fp8_kernels = kernels & {"attention", "rope_kv"}
    if (dtype in FP8_DTYPES and fp8_kernels and device.type == "cuda"
            and torch.cuda.get_device_capability(device) < (8, 9)):
        others = ",".join(name for name in KERNEL_NAMES if name not in fp8_kernels)
        raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype!r} needs a GPU of compute capability 8.9 or "
                         f"newer for the Triton kernels {sorted(fp8_kernels)}: leave them out, as "
                         f"kernels={others!r} (eager attention, so no CUDA graphs)")
    return dtype


def check_fp8_kernels(config: EngineConfig, device: torch.device, kernels: frozenset[str]) -> bool:
    """Whether fp8 weights' products take the Triton kernel fp8_linear (a Qwen3-MoE's fp8 experts
    take fused_moe's fp8 grouped GEMM where fused_moe is on): Triton's fp8 dot needs compute
    capability 8.9 (Ada) or newer; on an older GPU they are refused, as for the fp8 KV cache."""
    if config.quantization != "fp8":
        return False
    fp8_kernels = kernels & ({"fp8_linear", "fused_moe"} if config.model_config.num_experts else {"fp8_linear"})
    if fp8_kernels and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        others = ",".join(name for name in KERNEL_NAMES if name not in fp8_kernels)
        raise ValueError(f"fp8 weights need a GPU of compute capability 8.9 or newer for the Triton kernels "
                         f"{sorted(fp8_kernels)}: leave them out, as kernels={others!r} (products in fp32 from the "
                         f"fp8 weights)")
    return "fp8_linear" in kernels


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: TensorParallel | None = None, port: int | None = None,
                 kv_bytes_beside: int = 0, bytes_beside: int = 0):
        """tp and port: a tensor-parallel worker's rank, and where rank 0 gathers the ranks. Rank 0
        (tp None) starts the other ranks itself when config.tensor_parallel_size > 1.
        kv_bytes_beside and bytes_beside: what each of this pool's slots also costs elsewhere, and
        what is set aside besides (a draft model's own K and V, and its CUDA graphs' buffers:
        runner/draft_model.py), counted when the pool is sized from GPU memory."""
        self.kv_bytes_beside, self.bytes_beside = kv_bytes_beside, bytes_beside
        # Set once started: every rank runs start-up's steps (the pool's sizing) by itself, and
        # rank 0 sends the others only the engine's.
        self.workers: TensorParallelWorkers | None = None
        self.broken: str | None = None          # a step that failed under tensor parallelism
        workers = None
        if tp is None:
            tp = TensorParallel(0, config.tensor_parallel_size)
            if tp.size > 1:
                check_no_process_group()
                workers = TensorParallelWorkers(config)
                port = workers.port
        self.tp = tp
        self.in_process_group = False
        try:
            self.start(config, port)
        except BaseException:
            # The other ranks may wait in a collective for this one: they are terminated, and this
            # process leaves the group without them (else no engine could start in it again).
            if workers is not None:
                workers.terminate()
            if self.in_process_group:
                abandon_process_group()
                self.in_process_group = False
            raise
        self.workers = workers
        if workers is not None:
            atexit.register(self.shutdown)      # the other ranks leave the group with this one
            if self.lora is not None:
                # The workers read no adapter file: they take rank 0's copies (WorkerAdapters).
                workers.share_adapters(self.lora.cache, config.max_cpu_loras)

    def start(self, config: EngineConfig, port: int | None) -> None:
        self.config = config
        self.model_config = mc = config.model_config
        tp = self.tp
        self.device, self.dtype = resolve_device_dtype(config, tp)
        if tp.size > 1:
            init_process_group(tp, port, self.device)
            self.in_process_group = True
        self.kernels = resolve_kernels(config.kernels, self.device.type)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config, self.device, self.dtype, self.kernels)
        self.block_size = config.block_size
        self.rng = random.Random(config.seed)
        torch.manual_seed(config.seed)

        # An embedding model (runner "pooling") returns pooled hidden states: no lm_head, no sampling.
        # A cross-encoder keeps its lm_head for two of its logits (PoolerConfig.classifier_token_ids).
        self.pooling = config.runner == "pooling"
        self.classifier_token_ids = config.pooler.classifier_token_ids if self.pooling else None
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            # On meta: a quantized checkpoint's weights are then allocated once, quantized
            # (hold_quantized_weights), never in bf16 first (Qwen3-30B-A3B-FP8: 61 GB against 31),
            # and the rest are not initialised only to be overwritten by the loader.
            with torch.device("meta"):
                self.model = Qwen3ForCausalLM(mc, self.kernels, tp,
                                              lm_head=not self.pooling or self.classifier_token_ids is not None)
        finally:
            torch.set_default_dtype(default_dtype)
        # What sleep mode gives back (the weights, the KV pool) in segments of PyTorch's allocator that
        # hold nothing else: a segment goes back to the device only when all of it is free. So first
        # the free segments the process cached before (a checkpoint written or a model run in it)
        # go, and then the step buffers are allocated before the weights (allocated after, they fit
        # the free ends of the weights' segments: on the H200 they kept 0.3-1.2 GiB of a sleeping
        # engine's memory).
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        # Consecutive launches take turns, 0 and 1 (self.turn: the next launch's). A turn has its
        # own staged inputs (self.inputs[turn]) and samples (self.sampled_tokens[turn], static, so
        # that a CUDA graph reads and writes them), where the next launch takes its input tokens
        # (a row's prev_token_index). So on CUDA the next step's inputs cross on a copy stream, and
        # the step's tokens go to the host on a stream of their own, while the device runs on: the
        # next launch waits for neither, and the one after finds both long done (it waits for
        # tokens_copied[turn] before it overwrites the turn's samples, and its input copy for
        # StepInputBuffers.release). Between two decode graphs the device then runs no copy at
        # all (benchmarks/NOTES.md, entry 41).
        self.turn = 0
        self.sampled_tokens = torch.zeros(2, config.max_num_seqs, dtype=torch.int64, device=self.device)
        self.tokens_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.tokens_copied: list[torch.cuda.Event | None] = [None, None]
        self.take_prev_tokens = take_prev_tokens if "prev_tokens" in self.kernels else take_prev_tokens_ref
        self.max_blocks = -(-config.max_model_len // self.block_size)
        # The Triton varlen attention kernel: it leaves tokens outside every sequence alone, so an
        # eager step's tokens may be padded (the PyTorch reference gives each token a row), and its
        # programs take their queries from a work list built here (prefill_work).
        self.triton_attention = "attention" in self.kernels
        max_tokens = padded_token_count(config.max_num_batched_tokens, config.max_num_seqs)
        self.prefill_block_q = prefill_block_q(mc.num_attention_heads // mc.num_key_value_heads)
        max_work_items = config.max_num_batched_tokens // self.prefill_block_q + config.max_num_seqs
        # Not tokens_stream: there the next step's input copy would queue behind the tokens' copy,
        # which waits for the step before to end.
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # In a memory pool of their own: in the allocator's shared one they could fit the free tail of
        # a segment that another model's weights leave (a draft model's embedding, started first),
        # and hold it, and so hold the whole segment, while those weights sleep.
        self.step_buffer_pool = torch.cuda.MemPool() if self.device.type == "cuda" else None
        with torch.cuda.use_mem_pool(self.step_buffer_pool) if self.step_buffer_pool else contextlib.nullcontext():
            self.inputs = [StepInputBuffers(max(max_tokens, config.max_num_seqs), config.max_num_seqs, self.max_blocks,
                                            max_work_items, self.device, self.copy_stream) for _ in range(2)]
        fp8_triton = check_fp8_kernels(config, self.device, self.kernels)
        if mc.quantization is not None:
            use_triton = "awq_linear" in self.kernels if isinstance(mc.quantization, AwqConfig) else fp8_triton
            hold_quantized_weights(self.model, mc.quantization, use_triton, self.device)
        self.model.materialize(self.device)
        load_model(self.model, config.model)
        if config.quantization == "fp8" and mc.quantization is None:
            self.model.quantize_fp8(fp8_triton)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()        # the bf16 weights' memory, for the KV pool
        self.model.eval()
        # With enable_lora: every projection's adapter slots, allocated before the KV pool is sized.
        self.lora = LoRAAdapters(self.model, config) if config.enable_lora else None
        # load_weights' side (runner/weight_updates.py), and sleep mode's (runner/sleep_mode.py).
        self.weights = WeightUpdater(self.model, config.model, self.dtype)
        self.sleep_state = SleepState()
        self.not_ready: str | None = None       # why the model cannot run a step now (asleep, weights missing)
        # Unseeded rows' noise on the PyTorch path from the runner's own generator, not the process's:
        # every tensor-parallel rank then draws the same, whatever else rank 0's process draws.
        self.sampler = Sampler(use_triton="sampler" in self.kernels,
                               generator=torch.Generator(self.device).manual_seed(config.seed))
        # Made before the KV pool is sized, so that what they hold on the device is counted.
        self.logits_processors = (LogitsProcessors(config.logits_processors, config, self.device)
                                  if config.logits_processors else None)

        # This rank's KV heads (all of them without tensor parallelism); one slot's K and V across
        # all layers, in bytes.
        self.num_kv_heads = tp.shard(mc.num_key_value_heads)
        self.kv_bytes_per_token = (2 * mc.num_hidden_layers * self.num_kv_heads * mc.head_dim
                                   * self.kv_cache_dtype.itemsize)
        # Graphs need the Triton attention kernel: the eager path's shapes follow the context length.
        # An embedding model runs no decode steps, which are what the graphs serve.
        graphs = (self.device.type == "cuda" and not config.enforce_eager and "attention" in self.kernels
                  and not self.pooling)
        self.piecewise_sizes = piecewise_sizes_for(config, graphs, tp, self.lora is not None)
        self.use_cuda_graphs = graphs and bool(config.cuda_graph_sizes or self.piecewise_sizes)
        self.graph_runner = self.piecewise = None
        # The sizes an eager decode step reckons its attention's split count for (graph_size_for).
        self.padding_sizes = config.cuda_graph_sizes or tuple(default_capture_sizes(config.max_num_seqs))
        self.graph_reserve_bytes = 0              # set aside for the graphs' pool when sizing the KV pool
        self.cuda_graph_capture_s = self.cuda_graph_pool_bytes = None     # measured at capture
        self.decode_workspace = None
        if self.triton_attention:
            # One scratch for every layer's decode splits: allocated before the KV pool is sized, so
            # it is counted there, and never inside a CUDA graph's pool (decode_workspace_numel).
            numel = decode_workspace_numel(config.max_num_seqs, tp.shard(mc.num_attention_heads), self.num_kv_heads,
                                           mc.head_dim, config.max_model_len, self.device)
            self.decode_workspace = torch.empty(numel, dtype=torch.float32, device=self.device)
            for layer in self.model.layers:
                layer.self_attn.attn.decode_workspace = self.decode_workspace
        # Penalised requests' counts, a row for each request that can run: before the KV pool is sized.
        self.penalty_state = PenaltyState.allocate(0 if self.pooling else config.max_num_seqs, mc.vocab_size,
                                                   self.device)
        # Every rank holds its heads' share of the same blocks: the pool is the smallest rank's.
        self.num_kv_blocks = min_over_ranks(config.num_kv_blocks or self.kv_blocks_in(config.kv_cache_memory_bytes)
                                            or self.profile_num_kv_blocks(), tp, self.device)
        self.kv_cache = self.allocate_kv_cache(self.num_kv_blocks)
        self.host_kv_slots = self.allocate_host_kv_cache()
        self.num_host_kv_blocks = len(self.host_kv_slots)
        if self.use_cuda_graphs:
            self.capture_cuda_graphs()
            # (A pool the caller sized, in blocks or bytes, set nothing aside here: nothing to compare.)
            sized_here = config.num_kv_blocks is None and config.kv_cache_memory_bytes is None
            if sized_here and self.cuda_graph_pool_bytes > self.graph_reserve_bytes:
                warnings.warn(f"CUDA graphs took {self.cuda_graph_pool_bytes / 2**20:.0f} MiB, more than the "
                              f"{self.graph_reserve_bytes / 2**20:.0f} MiB set aside when the KV pool was sized")
        self.gemm_warmup_s = None
        if self.device.type == "cuda":
            self.load_gemm_kernels()

    def capture_cuda_graphs(self) -> None:
        """The decode graphs and the piecewise ones, over the weights and the KV pool where they lie
        now (at start-up, and again when sleep mode has given their memory back and allocated it
        anew, or the pool has been reallocated)."""
        start, reserved = time.perf_counter(), torch.cuda.memory_reserved(self.device)
        if self.config.cuda_graph_sizes:
            self.graph_runner = CUDAGraphRunner(self.model, self.config.cuda_graph_sizes, self.device,
                                                self.sampled_tokens, self.take_prev_tokens,
                                                # With custom logits processors every step samples outside.
                                                sample if "sampler" in self.kernels and not self.logits_processors
                                                else None)
            self.graph_runner.capture(lambda bs, turn: self.prepare_inputs([], graph_size=bs, turn=turn))
        if self.piecewise_sizes:
            self.piecewise = PiecewiseGraphRunner(self.model, self.piecewise_sizes, self.device)
            self.piecewise.capture()
        self.cuda_graph_capture_s = time.perf_counter() - start
        self.cuda_graph_pool_bytes = torch.cuda.memory_reserved(self.device) - reserved

    def drop_cuda_graphs(self) -> None:
        """Lets go of the graphs (which hold the addresses of the weights and the KV pool they were
        captured over), and so of their pools."""
        self.graph_runner = self.piecewise = None

    @torch.inference_mode()
    def load_gemm_kernels(self) -> None:
        """Runs every cuBLAS product an eager step can launch once, at start-up: lm_head at every
        count of rows a step can sample, and the four projections of a layer (all layers share
        their shapes) at every token count a step can have once padded (gemm_row_counts).

        cuBLAS picks its kernel by the product's shape and loads a kernel the first time it
        launches it, and that first launch waits until the device has run everything queued before
        it (on the H200: a 100 ms queue, then 1.5 ms; benchmarks/cublas_first_launch.py). Decode
        steps replay graphs, whose kernels loaded at capture; a mixed step at a row count whose
        kernel had not been launched yet stopped the host until the device had run the whole step
        before it, then left the device idle while it caught up: 25-54 ms stopped in lm_head in four
        of the benchmark's nine prefill steps, and the ninth (12,823 tokens, whose kernel no count in
        a ladder of every 64th had loaded) ~30 ms in its projections (benchmarks/step_gaps.py,
        NOTES entry 33). Hence the padding: it makes the row counts a known, short list.
        A Qwen3-MoE model's sparse layers have one cuBLAS product, the router's, where the Triton
        kernels do not take it (kernels/moe_router.py); its dense layers, if any, the dense MLP's two."""
        start = time.perf_counter()
        mc = self.model_config
        sample_rows, token_rows = gemm_row_counts(self.config.max_num_seqs, self.config.max_num_batched_tokens)
        attn = self.model.layers[0].self_attn
        mlps = {type(layer.mlp): layer.mlp for layer in self.model.layers}      # one of each kind
        dense, sparse = mlps.get(Qwen3MLP), mlps.get(Qwen3SparseMoeBlock)
        # Zeros, read by the products (and the residual adds into `residual`, which stay zero).
        max_rows = max(sample_rows[-1], token_rows[-1])
        if self.lora is not None:                 # the LoRA products run too, on no adapter
            self.model.lora_step.begin(torch.full((max_rows,), -1, dtype=torch.int32, device=self.device))
        hidden, residual, o_in, down_in = (
            torch.zeros(max_rows, width, dtype=self.dtype, device=self.device)
            for width in (mc.hidden_size, mc.hidden_size, attn.o_proj.in_features,
                          dense.down_proj.in_features if dense else 1))
        for n in sample_rows if self.model.lm_head is not None else []:
            self.model.compute_logits(hidden[:n])
        for n in token_rows:
            attn.qkv_proj(hidden[:n])
            attn.o_proj(o_in[:n], residual=residual[:n])
            if dense is not None:
                dense.gate_up_proj(hidden[:n])
                dense.down_proj(down_in[:n], residual=residual[:n])
            if sparse is not None and "fused_moe" not in self.kernels:
                F.linear(hidden[:n], sparse.gate.weight)
        torch.cuda.synchronize(self.device)
        self.gemm_warmup_s = time.perf_counter() - start

    def shutdown(self) -> None:
        """Tensor parallelism's end, on every rank at once (rank 0 tells the others): NCCL destroys
        a communicator only when every rank destroys it, and not while a CUDA graph still holds its
        operations, so each rank drops its graphs and then leaves the process group; rank 0 then
        waits for the other processes to end. This process may then start another tensor-parallel
        engine. Nothing to do without tensor parallelism."""
        if not self.in_process_group:
            return
        if self.workers is not None:
            self.workers.stop()
        if (self.graph_runner is not None or self.piecewise is not None) and self.broken is None:
            torch.cuda.synchronize(self.device)
        self.drop_cuda_graphs()
        # Out of step, the other ranks are gone or stuck: NCCL's collective destruction would wait.
        (abandon_process_group if self.broken is not None else leave_process_group)()
        self.in_process_group = False
        if self.workers is not None:
            self.workers.join()
            self.workers = None
            atexit.unregister(self.shutdown)

    # ---- weight updates and sleep mode (runner/weight_updates.py, runner/sleep_mode.py) ----

    def load_weights(self, weights) -> int:
        """Writes checkpoint-named tensors into the model's parameters in place (WeightUpdater), on
        every rank: checked whole on this one first (a ValueError changes nothing anywhere), then sent
        to the other ranks, each tensor broadcast whole from this rank's device over the process
        group (NCCL's NVLink on GPUs), each rank cutting its own share. Returns how many were written."""
        self.check_not_broken()
        if "weights" in self.sleep_state.sleeping_tags:
            raise RuntimeError("the weights sleep: wake_up(tags=['weights']) before load_weights")
        updates = self.weights.check(weights)
        plan = self.weights.plan(updates)
        if self.workers is None:
            self.apply_weights(plan)
            return len(updates)
        try:
            self.workers.call("receive_weights", [(u.checkpoint_name, tuple(u.source.shape), u.source.dtype)
                                                  for u in updates])
            for u in updates:
                broadcast_tensor(u.source.to(self.device).contiguous())
                u.source = None
            self.apply_weights(plan)
            written_everywhere = min_over_ranks(1, self.tp, self.device) == 1
        except BaseException as e:
            self.broken = f"{type(e).__name__} while loading weights: {e}"
            raise
        if not written_everywhere:
            self.broken = "a tensor-parallel rank failed to load the weights"
            raise RuntimeError(f"{self.broken} (see its log); the ranks' weights differ: restart the engine")
        return len(updates)

    def receive_weights(self, header: list[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        """A worker's side of load_weights: each tensor received whole, cut to this rank's share at
        once (a whole update is never held), then written as rank 0 writes its own."""
        updates, failed = [], None
        for name, shape, dtype in header:
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
            broadcast_tensor(tensor)
            if failed is None:
                try:
                    update = self.weights.check_one(name, tensor)
                    update.tensor, update.source = update.tensor.clone(), None
                    updates.append(update)
                except Exception as e:      # every broadcast still pairs up with rank 0's
                    failed = e
        try:
            if failed is not None:
                raise failed
            self.apply_weights(self.weights.plan(updates))
        except Exception:
            min_over_ranks(0, self.tp, self.device)
            raise
        min_over_ranks(1, self.tp, self.device)

    def apply_weights(self, plan) -> None:
        self.weights.apply(plan)
        self.forget_lora_slots()
        self.update_readiness()

    def forget_lora_slots(self) -> None:
        """With LoRA: the slots hold each adapter's A with the old norms folded in
        (NormedPackedLinear.lora_pair), so each is loaded again at its next step."""
        if self.lora is not None:
            self.lora.forget_slots()

    def sleep(self, level: int) -> None:
        """Gives back the device memory of the weights (level 1: copied to the host first; level 2:
        discarded) and of the KV pool (its contents discarded), and drops the CUDA graphs, which
        hold their addresses. The engine has no request running (LLMEngine.sleep)."""
        self.check_not_broken()
        if self.workers is not None:
            self.workers.call("sleep", level)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.drop_cuda_graphs()
        self.sleep_state.released["weights"] = release(distinct_storages(self.model.parameters()),
                                                       keep_contents=level == 1)
        self.sleep_state.released["kv_cache"] = release([self.kv_cache.untyped_storage()], keep_contents=False)
        if level == 2:
            self.weights.discard_all()
            self.forget_lora_slots()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.update_readiness()

    def wake_up(self, tags: list[str]) -> None:
        """Allocates the sleeping tags' memory again (the weights' contents from the host copy, if
        level 1 made one; a KV pool of zeros), and, once both are awake, captures the CUDA graphs."""
        self.check_not_broken()
        if self.workers is not None:
            self.workers.call("wake_up", tags)
        for tag in tags:
            if tag in self.sleep_state.released:        # (a wake-up called again after one that failed)
                restore(self.sleep_state.released[tag])     # forgotten only once restored: restore can run again
                del self.sleep_state.released[tag]
        if (not self.sleep_state.released and self.use_cuda_graphs and self.graph_runner is None
                and self.piecewise is None):
            self.capture_cuda_graphs()
        self.update_readiness()

    def update_readiness(self) -> None:
        if self.sleep_state.released:
            self.not_ready = (f"the engine is asleep ({', '.join(sorted(self.sleep_state.released))} released): "
                              "wake_up() first")
        elif self.weights.discarded:
            missing = self.weights.missing_names()
            self.not_ready = (f"sleep(level=2) discarded the weights: load_weights must give every one again before "
                              f"the model runs ({len(missing)} not given yet, e.g. {missing[:3]})")
        else:
            self.not_ready = None

    def check_not_broken(self) -> None:
        if self.broken is not None:
            raise RuntimeError(f"tensor parallelism: the ranks are out of step ({self.broken}): restart the engine")

    # ---- the KV pool ----

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        mc = self.model_config
        if self.device.type == "cuda":
            torch.cuda.empty_cache()            # a segment of its own, as the weights' (start)
        # Zeroed, not empty: attention reads whole blocks and masks the slots past a sequence's
        # end, and a masked weight of 0 times a NaN left in uninitialised memory is still NaN.
        kv_cache = torch.zeros(2, mc.num_hidden_layers, num_blocks, self.block_size, self.num_kv_heads,
                               mc.head_dim, dtype=self.kv_cache_dtype, device=self.device)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.attn.k_cache = kv_cache[0, i]
            layer.self_attn.attn.v_cache = kv_cache[1, i]
        return kv_cache

    def allocate_host_kv_cache(self) -> list[torch.Tensor]:
        """kv_offloading_size's host tier (engine/host_block_pool.py), this rank's share of it (as
        vLLM's): its slots, each one block's K and V across all layers, contiguous, so that a block
        crosses in one copy. Pinned on CUDA, so that the copies queue on the step's stream without
        holding the host; in chunks of host_tier_chunks' powers of two, since PyTorch's pinned
        allocator rounds each allocation up to one (a tier of 12 GiB in one piece pins 16)."""
        size = self.config.kv_offloading_size
        if size is None:
            return []
        mc = self.model_config
        slot_shape = (2, mc.num_hidden_layers, self.block_size, self.num_kv_heads, mc.head_dim)
        slot_bytes = self.kv_bytes_per_token * self.block_size
        slots = []
        for num_slots in host_tier_chunks(int(size * 2**30 / self.tp.size), slot_bytes):
            chunk = torch.empty(num_slots, *slot_shape, dtype=self.kv_cache_dtype,
                                pin_memory=self.device.type == "cuda")
            slots += chunk.unbind(0)
        if not slots:
            raise ValueError(f"kv_offloading_size={size} GiB holds no KV block: a block of {self.block_size} tokens "
                             f"takes {slot_bytes / 2**20:.2f} MiB on each of the {self.tp.size} ranks")
        return slots

    @torch.inference_mode()
    def move_kv(self, stores: list[tuple[int, int]], loads: list[tuple[int, int]]) -> None:
        """The host tier's copies that the block manager scheduled (BlockManager.take_kv_transfers),
        queued on the device's stream before the step that follows: the stores (device block to
        host slot) of the blocks it evicted, then the loads (host slot to device block) of its
        prefix hits. The stream orders them after the steps that wrote the evicted blocks, and
        before the step that overwrites them or reads the loaded ones; on every rank."""
        self.check_not_broken()
        if self.workers is not None:
            self.workers.call("move_kv", stores, loads)
        for block, slot in stores:
            self.host_kv_slots[slot].copy_(self.kv_cache[:, :, block], non_blocking=True)
        for slot, block in loads:
            self.kv_cache[:, :, block].copy_(self.host_kv_slots[slot], non_blocking=True)

    def release_kv_cache(self) -> None:
        """The layers let go of their views of the pool, whose memory goes back to the device once
        nothing else holds it."""
        for layer in self.model.layers:
            layer.self_attn.attn.k_cache = layer.self_attn.attn.v_cache = torch.empty(0)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def reallocate_kv_cache(self, num_blocks: int) -> None:
        """A pool of num_blocks in place of this one (its contents dropped), and the CUDA graphs,
        which hold the old pool's addresses, captured anew."""
        self.drop_cuda_graphs()
        self.kv_cache = None
        self.release_kv_cache()
        self.num_kv_blocks = num_blocks
        self.kv_cache = self.allocate_kv_cache(num_blocks)
        if self.use_cuda_graphs:
            self.capture_cuda_graphs()

    def kv_blocks_in(self, num_bytes: int | None) -> int | None:
        """kv_cache_memory_bytes' blocks (None where it is not given): each slot's K and V, and what
        it costs beside (a draft model's)."""
        if num_bytes is None:
            return None
        block_bytes = (self.kv_bytes_per_token + self.kv_bytes_beside) * self.block_size
        if num_bytes < block_bytes:
            raise ValueError(f"kv_cache_memory_bytes={num_bytes} holds no KV block: a block of {self.block_size} "
                             f"tokens takes {block_bytes} bytes")
        return num_bytes // block_bytes

    def profile_num_kv_blocks(self) -> int:
        if self.device.type != "cuda":
            return self.config.cpu_kv_blocks
        # Run the largest steps the config allows against a scratch pool (one max_model_len
        # sequence's blocks, which every row shares), measure the peaks, and give the pool what
        # gpu_memory_utilization leaves after weights and those peaks.
        torch.cuda.empty_cache()
        self.allocate_kv_cache(self.max_blocks)
        base = torch.cuda.memory_allocated(self.device)
        peaks = []
        batches = self.warmup_batches(list(range(self.max_blocks)))
        graph_batches = []
        if self.use_cuda_graphs and self.config.cuda_graph_sizes:
            graph_batches.append(self.graph_sized_decode(list(range(self.max_blocks))))
        if self.use_cuda_graphs and self.piecewise_sizes:
            graph_batches.append(self.piecewise_sized_step(list(range(self.max_blocks))))
        batches += graph_batches
        for rows in batches:
            torch.cuda.reset_peak_memory_stats(self.device)
            self.execute(rows)
            torch.cuda.synchronize(self.device)
            peaks.append(torch.cuda.max_memory_allocated(self.device) - base)
        self.release_kv_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        peak_transient = max(peaks)
        # CUDA graphs hold their static buffers (the decode graphs' logits), and private pools
        # about as large as the largest captured step's activations, which the eager path cannot
        # reuse, in whole segments of the caching allocator: a pool for the decode graphs, one for
        # the piecewise ones. The eager steps measured (the last peaks) held their activations and
        # the decode graphs' logits (an eager step's own are as large); the piecewise graphs'
        # static buffers are added.
        self.graph_reserve_bytes = (sum(peaks[len(peaks) - len(graph_batches):])
                                    + len(graph_batches) * GRAPH_POOL_SEGMENTS_BYTES)
        if self.piecewise_sizes:
            mc = self.model_config
            self.graph_reserve_bytes += PiecewiseGraphRunner.buffer_bytes(
                self.piecewise_sizes, mc.hidden_size, mc.num_attention_heads, mc.head_dim, self.dtype)
        budget = (total * self.config.gpu_memory_utilization - (total - free) - peak_transient
                  - self.graph_reserve_bytes - self.bytes_beside)
        num_blocks = int(budget // ((self.kv_bytes_per_token + self.kv_bytes_beside) * self.block_size))
        if num_blocks < 1:
            raise RuntimeError(f"no GPU memory left for the KV cache (budget {budget / 2**30:.2f} GiB); "
                               "raise gpu_memory_utilization or lower max_num_batched_tokens/max_num_seqs")
        return num_blocks

    def graph_sized_decode(self, block_table: list[int]) -> list[BatchRow]:
        """A decode step as the largest CUDA graph runs it: its rows at max_model_len, sampling as the
        graphs sample (within a top-k and a nucleus, the second graph's work; no fp32 copy of the
        logits, no sort). Its peak sizes the graphs' reserve: warmup_batches' decode step, max_num_seqs
        rows through the sampler's hungriest path, had set aside 1,666 MiB on the H200 for a pool of
        58 MiB (benchmarks/NOTES.md, entry 68)."""
        params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_tokens=1)
        # Seeded, so that it draws nothing from the engine's stream of seeds for unseeded requests:
        # their outputs are then the same whatever the graphs.
        return [BatchRow([0], self.config.max_model_len - 1, block_table, True, params, seed=0)
                for _ in range(self.config.cuda_graph_sizes[-1])]

    def piecewise_sized_step(self, block_table: list[int]) -> list[BatchRow]:
        """A step of prompt tokens as the largest piecewise graphs run it: its peak sizes their
        pool's reserve (rows of at most max_model_len tokens, greedy, the last sampling; the
        config caps the largest size at max_num_seqs such rows)."""
        num_tokens, per_row = self.piecewise_sizes[-1], self.config.max_model_len
        lengths = [per_row] * (num_tokens // per_row) + ([num_tokens % per_row] if num_tokens % per_row else [])
        assert len(lengths) <= self.config.max_num_seqs and num_tokens <= self.config.max_num_batched_tokens
        return [BatchRow([0] * n, 0, block_table, i == len(lengths) - 1, GREEDY_ONE_TOKEN)
                for i, n in enumerate(lengths)]

    def warmup_batches(self, block_table: list[int]) -> list[list[BatchRow]]:
        """The two extreme steps: a full token budget of prefill, and max_num_seqs decodes at
        max_model_len (then two one-row steps for the top-k sampler's kernels). Every row shares
        one block table: only memory use matters here. The two steps' rows sample with a logit
        bias, penalties, min_p and within a nucleus: the sampler's most
        memory-hungry path (an fp32 copy of the logits, the penalty counts' fill, then a sort of
        every row's logits in fp32), which also compiles its fp32 kernels before any request needs
        them. The prefill rows fill penalty rows with their zeros, which the decode rows then read."""
        cfg = self.config
        num_seqs = min(cfg.max_num_seqs, cfg.max_num_batched_tokens)
        per_seq = min(cfg.max_num_batched_tokens // num_seqs, cfg.max_model_len)
        if self.pooling:        # a full budget of prompts whose every token's state is summed (MEAN)
            kind = "MEAN" if self.classifier_token_ids is None else "LAST"     # a cross-encoder's: its logits
            return [[BatchRow([0] * per_seq, 0, block_table, False, pooling=kind) for _ in range(num_seqs)]]
        params = SamplingParams(temperature=1.0, top_p=0.5, max_tokens=1, repetition_penalty=1.1, min_p=0.01,
                                logit_bias={0: 1.0})
        prefill = [BatchRow([0] * per_seq, 0, block_table, True, params, penalty_row=i,
                            history=np.zeros(per_seq - 1, dtype=np.int64)) for i in range(num_seqs)]
        decode = [BatchRow([0], cfg.max_model_len - 1, block_table, True, params, penalty_row=i)
                  for i in range(cfg.max_num_seqs)]
        # A row each for the top-k sampler's kernels, so that they compile here: on bf16 logits, then
        # on the fp32 copy that a penalty makes.
        top_k = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_tokens=1)
        penalised_top_k = SamplingParams(temperature=1.0, top_k=20, repetition_penalty=1.1, max_tokens=1)
        return [prefill, decode, [BatchRow([0], 0, block_table, True, top_k)],
                [BatchRow([0], 0, block_table, True, penalised_top_k, penalty_row=0)]]

    # ---- one step ----

    def execute(self, rows: list[BatchRow]) -> list[int]:
        """Runs one step and waits for it: the sampled token of each row with sample=True."""
        tokens, _ = self.launch(rows).result()
        return tokens

    @torch.inference_mode()
    def launch(self, rows: list[BatchRow], prev_tokens: torch.Tensor | None = None) -> "StepHandle":
        """Enqueues one step on the device and returns at once; the handle's result() waits for
        the sampled tokens (one per row with sample=True, in order). Rows of one token must come
        first (they take the batched decode path). A row whose prev_token_index is set takes its
        input token from the previous launch's samples, still on the device: the host need not
        know it, so the engine can schedule step n+1 while step n runs. prev_tokens: where such
        rows take their tokens instead, a device tensor of at most max_num_seqs tokens that work
        queued before this launch fills (a draft model's drafts: runner/draft_model.py); it takes
        the previous launch's samples' place, which the host must already have read."""
        if self.broken is not None:
            raise RuntimeError(f"tensor parallelism: a step failed on rank 0 ({self.broken}) after the other "
                               "ranks had started it; their collectives no longer pair up: restart the engine")
        if self.not_ready is not None:
            raise RuntimeError(self.not_ready)
        turn = self.turn
        try:
            if self.workers is not None:
                self.workers.send(rows)         # the other ranks run the same step on their shares
            if prev_tokens is not None:
                assert self.workers is None, "the other ranks would take their own samples"
                # Every row that takes a token on the device takes one of these (none still waits
                # for the previous launch's samples, which these overwrite).
                assert prev_tokens.shape[0] <= self.config.max_num_seqs and all(
                    r.prev_token_index < prev_tokens.shape[0] for r in rows)
                if self.tokens_copied[1 - turn] is not None:
                    torch.cuda.current_stream(self.device).wait_event(self.tokens_copied[1 - turn])
                self.sampled_tokens[1 - turn, :prev_tokens.shape[0]].copy_(prev_tokens)
            handle = self.enqueue(rows, turn)
        except BaseException as e:
            if self.tp.size > 1:                # where it failed, the other ranks (some of them) went on
                self.broken = f"{type(e).__name__}: {e}"
            raise
        finally:
            self.inputs[turn].release()       # (also after a failed launch: its kernels may be queued)
        # A failed launch leaves the turn as it was, and its samples (but for prev_tokens, copied over
        # samples the host had read already).
        self.turn = 1 - turn
        return handle

    def enqueue(self, rows: list[BatchRow], turn: int) -> "StepHandle":
        graph_size = None
        # A step with prompt log-probabilities or pooling takes no decode graph: it needs its prompts'
        # hidden states (the piecewise graphs give them).
        prompt_rows = [r for r in rows if r.prompt_logprob_targets is not None]
        pooling_rows = any(r.pooling is not None for r in rows)
        # Nor does a step with prompt embeddings: a graph embeds token ids only.
        embeds = self.prompt_embeds(rows) if any(r.prompt_embeds is not None for r in rows) else None
        if self.graph_runner is not None and not prompt_rows and not pooling_rows and embeds is None:
            graph_size = self.graph_runner.graph_size(len(rows), max(len(r.token_ids) for r in rows))
        # What no decode graph holds replays the piecewise graphs, where they hold its tokens (a
        # prompt's embeddings and pooling run eager).
        piece_size = None
        if graph_size is None and self.piecewise is not None and not pooling_rows and embeds is None:
            piece_size = self.piecewise.size_for(sum(len(r.token_ids) for r in rows))
        t, meta = self.prepare_inputs(rows, graph_size, turn, piece_size)
        if self.tokens_copied[turn] is not None:
            # The launch before the last one copies this turn's samples out: long done by now.
            torch.cuda.current_stream(self.device).wait_event(self.tokens_copied[turn])
        sample_rows = [r for r in rows if r.sample]
        samples, tokens = self.sampled_tokens[turn], None
        if graph_size is not None:
            graph_samples = (len(sample_rows) == len(rows) and self.graph_runner.sample is not None
                             and self.logits_processors is None and not self.samples_outside_graph(sample_rows))
            top_k = graph_samples and any(candidate_top_k(r.params) for r in sample_rows)
            logits = self.graph_runner.replay(graph_size, turn, top_k)[:len(rows)]
            if len(sample_rows) < len(rows):
                logits = logits[t.logits_indices]
            elif graph_samples:
                tokens = samples[:len(rows)]         # sampled inside the graph
        else:
            if any(r.prev_token_index >= 0 for r in rows):
                self.take_prev_tokens(t.input_ids, t.prev_index, self.sampled_tokens[1 - turn])
            if piece_size is not None:
                hidden = self.piecewise.forward(t, meta)
            else:
                hidden = self.model(t.input_ids, t.positions, meta, t.lora_slots, embeds)
            logits = self.model.compute_logits(hidden[t.logits_indices]) if sample_rows else None
        prompt_extras = self.prompt_logprob_extras(rows, prompt_rows, hidden) if prompt_rows else []
        pooled = self.pool(rows, hidden) if pooling_rows else None
        if not sample_rows and not prompt_rows and pooled is None:
            return StepHandle.done([], None)
        if not sample_rows:
            tokens = torch.empty(0, dtype=torch.int64, device=self.device)
        elif tokens is None:
            sampling = self.sampling_tensors(sample_rows, t)
            tokens = self.sampler(logits, sampling)
            if sampling.penalties is not None:
                sampling.penalties.record(tokens)
            samples[:len(tokens)].copy_(tokens)
        # Log-probabilities, only for the rows that asked: they go to the host with the tokens.
        want = [i for i, r in enumerate(sample_rows) if r.params is not None and r.params.logprobs is not None]
        extras = []
        if want:
            num_top = [sample_rows[i].params.logprobs for i in want]
            extras = logprob_tensors(tokens, logits, self.to_device(want, torch.int64), max(num_top))
        finish = None
        if want or prompt_rows:
            def finish(*host: list) -> tuple[list | None, list | None]:
                sampled, prompt = host[:len(extras)], host[len(extras):]
                return (sample_logprobs(len(sample_rows), want, num_top, *sampled) if want else None,
                        prompt_logprobs_by_row([len(r.prompt_logprob_targets) for r in prompt_rows],
                                               [r.num_prompt_logprobs for r in prompt_rows], *prompt)
                        if prompt_rows else None)
        handle = StepHandle.copying(tokens, self.tokens_stream, extras + prompt_extras, finish, pooled)
        self.tokens_copied[turn] = handle.ready
        return handle

    def prompt_logprob_extras(self, rows: list[BatchRow], prompt_rows: list[BatchRow],
                              hidden: torch.Tensor) -> list[torch.Tensor]:
        """The log-probabilities of the prompt tokens that the prompt rows' tokens predict: row
        r's first len(r.prompt_logprob_targets) tokens, at their flat positions in the step (rows
        lie in order, each len(token_ids) tokens)."""
        starts = np.cumsum([0] + [len(r.token_ids) for r in rows])
        positions = np.concatenate([np.arange(start, start + len(r.prompt_logprob_targets))
                                    for r, start in zip(rows, starts) if r.prompt_logprob_targets is not None])
        targets = np.concatenate([r.prompt_logprob_targets for r in prompt_rows])
        ints = self.to_device(np.stack([positions, targets]), torch.int64)
        return prompt_logprob_tensors(self.model.compute_logits, hidden, ints[0], ints[1],
                                      max(r.num_prompt_logprobs for r in prompt_rows))

    def pool(self, rows: list[BatchRow], hidden: torch.Tensor) -> torch.Tensor:
        """The pooling rows' shares of their prompts' vectors, [pooling rows, hidden] fp32, in row
        order (layers/pooler.py): rows lie in order, each len(token_ids) tokens. A cross-encoder's
        rows (LAST: each its prompt's last token) give the classifier tokens' logits instead, and a
        sequence classifier's its score head's, [pooling rows, num_labels]."""
        starts = np.cumsum([0] + [len(r.token_ids) for r in rows])
        chunks = [(start, len(r.token_ids), r.pooling) for r, start in zip(rows, starts) if r.pooling is not None]
        ints = self.to_device(np.stack(pooled_token_indices(chunks)), torch.int64)
        if self.classifier_token_ids is not None:
            logits = self.model.compute_logits(hidden[ints[0]])
            return logits[:, list(self.classifier_token_ids)].float()
        pooled = pool_chunks(hidden, ints[0], ints[1], len(chunks))
        # A sequence classifier's rows: their shares' logits (its head is linear, so MEAN's shares still sum).
        return pooled if self.model.score is None else self.model.score(pooled)

    def prompt_embeds(self, rows: list[BatchRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's tokens given as embeddings: their indices among the step's tokens (laid out
        row after row, as prepare_inputs lays them) and the embeddings, on the device."""
        indices, values, start = [], [], 0
        for row in rows:
            if row.prompt_embeds is not None:
                indices.append(np.arange(start, start + row.prompt_embeds.shape[0]))
                values.append(row.prompt_embeds)
            start += len(row.token_ids)
        return (to_device(torch.from_numpy(np.concatenate(indices)), self.device),
                to_device(torch.cat(values).to(self.dtype), self.device))

    @staticmethod
    def samples_outside_graph(rows: list[BatchRow]) -> bool:
        """Does any row ask for what only the eager sampler applies: a top-k above TOP_K_MAX, top-p
        without top-k, min_p, a penalty, a logit bias, allowed_token_ids, a grammar's mask, a bad
        word's ban or, while its output is shorter than min_tokens, no stop token? (A greedy row's
        argmax is the same under top-k, top-p and min_p.)"""
        return any(needs_top_k_top_p(p := r.params) or (p.temperature > 0 and p.min_p > 0) or p.penalized
                   or p.logit_bias or p.allowed_token_ids or r.num_output_tokens < p.min_tokens
                   or r.grammar_bitmask is not None or r.banned_tokens for r in rows)

    def prepare_inputs(self, rows: list[BatchRow], graph_size: int | None = None, turn: int | None = None,
                       piece_size: int | None = None) -> tuple[StepTensors, AttentionMetadata]:
        """The step's flat input tensors, its sampling rows' temperatures and seeds, and its
        attention metadata, staged in StepInputBuffers by one copy. A decode row costs a few list
        appends; block tables are one padded array a row. graph_size: lay the step out as the CUDA
        graph of that batch size was captured (rows padded with greedy ones that write nowhere,
        tables max_model_len wide). turn: whose input buffer (and so graph) the step takes, given
        by a caller that knows no queued work still reads it (launch, the graphs' capture); by
        default the next launch's, staged after all work queued so far. piece_size: pad the
        step's tokens to this count, the piecewise graphs' it replays."""
        if turn is None:
            turn = self.turn
            self.inputs[turn].release()
        # Token-level inputs: single-token rows (they come first) append to the lists, each prefill
        # chunk adds numpy arrays (a 16k-token step spends ~3 ms less than with Python ints a token).
        input_ids, positions, slot_mapping, prev_index = [], [], [], []
        chunk_ids, chunk_positions, chunk_slots, chunk_prev = [], [], [], []
        query_start_loc, seq_lens, logits_indices, temperatures, seeds, top_k, top_p = [0], [], [], [], [], [], []
        bs = self.block_size
        num_tokens = 0
        for row in rows:
            n, start, table = len(row.token_ids), row.start_position, row.block_table
            if n == 1 and not chunk_ids:
                input_ids.append(row.token_ids[0])
                positions.append(start)
                slot_mapping.append(table[start // bs] * bs + start % bs)
                prev_index.append(row.prev_token_index)
            else:
                chunk = np.arange(start, start + n)
                table_array = row.block_table_array if row.block_table_array is not None else np.asarray(table)
                chunk_ids.append(row.token_ids)
                chunk_positions.append(chunk)
                chunk_slots.append(table_array[chunk // bs].astype(np.int64) * bs + chunk % bs)
                prev = np.full(n, -1, dtype=np.int64)
                prev[-1] = row.prev_token_index
                chunk_prev.append(prev)
            num_tokens += n
            query_start_loc.append(num_tokens)
            seq_lens.append(start + n)
            if row.sample:
                logits_indices.append(num_tokens - 1)
                temperatures.append(row.params.temperature)
                top_k.append(candidate_top_k(row.params))
                top_p.append(row.params.top_p)
                # Seeded rows draw from their own stream; the rest get a fresh seed every step.
                seeds.append(row.seed if row.seed is not None else self.rng.getrandbits(31))
        num_decodes = len(input_ids)        # the leading single-token rows
        decode_splits = None
        if graph_size is None:
            width, max_seq_len = max(len(r.block_table) for r in rows), max(seq_lens)
            max_query_len, num_rows = max(len(r.token_ids) for r in rows), len(rows)
            if max_query_len == 1 and self.triton_attention:
                # An eager decode step's attention is launched as the graph it would pad to launches
                # it: tables max_model_len wide, and that graph's split count. Each row's attention
                # then matches the graph's bit for bit, and Triton compiles a variant of the kernel
                # for each captured size's split count, not for every split count and table width
                # that batch sizes and longest contexts give: 24 of ~0.4 s each, mid-run, in the
                # benchmark without graphs (benchmarks/NOTES.md, entry 68).
                width, max_seq_len = self.max_blocks, self.config.max_model_len
                decode_splits = decode_num_splits(self.graph_size_for(num_rows), self.num_kv_heads, max_seq_len,
                                                  DECODE_TILE_N, num_sms(self.device), DECODE_STAGES)
            # Tokens past query_start_loc[-1]: no sequence's, so attention skips them. Only the
            # products and elementwise kernels see them (up to the piecewise graphs' count).
            if piece_size is not None:
                pad = piece_size - num_tokens
            elif self.triton_attention:
                pad = padded_token_count(num_tokens, self.config.max_num_seqs) - num_tokens
            else:
                pad = 0
        else:
            width, max_seq_len, max_query_len, num_rows = self.max_blocks, self.config.max_model_len, 1, graph_size
            # Rows of one token each (num_tokens == len(rows) here), greedy, with a context of one.
            pad = graph_size - len(rows)
            seq_lens += [1] * pad
            query_start_loc += range(num_tokens + 1, num_tokens + pad + 1)
            pad_samples = graph_size - len(temperatures)
            temperatures += [0.0] * pad_samples
            seeds += [0] * pad_samples
            top_k += [0] * pad_samples
            top_p += [1.0] * pad_samples
            num_decodes = graph_size
        # Padding tokens write no KV (slot -1), and take no adapter.
        columns = [token_column(values, chunks, pad, fill)
                   for values, chunks, fill in ((input_ids, [np.asarray(ids) for ids in chunk_ids], 0),
                                                (positions, chunk_positions, 0), (slot_mapping, chunk_slots, -1),
                                                (prev_index, chunk_prev, -1))]
        # Each token's adapter slot: its row's (rows lie in order, each len(token_ids) tokens).
        lora_column = np.full(num_tokens + pad, -1)
        if self.lora is not None:
            lora_column[:num_tokens] = np.repeat(self.lora.slots(rows), [len(r.token_ids) for r in rows])
        num_tokens += pad
        block_tables = np.zeros((num_rows, width), dtype=np.int32)       # padding rows read block 0
        for i, row in enumerate(rows):
            block_tables[i] = self.padded_block_table(row, width)
        work = np.zeros((0, 4), dtype=np.int32)
        if max_query_len > 1 and self.triton_attention:
            work = prefill_work(np.diff(query_start_loc), seq_lens, self.prefill_block_q)
        t = self.inputs[turn].stage([*columns, seeds, seq_lens, query_start_loc, block_tables, temperatures, work,
                                     top_k, top_p, lora_column, logits_indices], num_tokens, num_rows, width,
                                    len(temperatures), len(logits_indices), len(work))
        meta = AttentionMetadata(slot_mapping=t.slot_mapping, query_start_loc=t.query_start_loc, seq_lens=t.seq_lens,
                                 block_tables=t.block_tables, num_decodes=num_decodes, max_query_len=max_query_len,
                                 max_seq_len=max_seq_len, prefill_work=t.prefill_work if len(work) else None,
                                 decode_splits=decode_splits)
        return t, meta

    def graph_size_for(self, num_rows: int) -> int:
        """The captured size a decode step of num_rows pads to (the default ladder's where no graphs
        are captured); num_rows itself above the largest."""
        return padded_size(self.padding_sizes, num_rows) or num_rows

    @staticmethod
    def padded_block_table(row: BatchRow, width: int) -> np.ndarray:
        if row.block_table_array is not None and row.block_table_array.shape[0] >= width:
            return row.block_table_array[:width]
        table = np.full(width, -1, dtype=np.int32)
        table[:len(row.block_table)] = row.block_table
        return table

    def sampling_tensors(self, rows: list[BatchRow], t: StepTensors) -> SamplingTensors:
        """The sampling rows' parameters: temperatures, seeds and the candidate sampler's top-k and
        top-p as prepare_inputs staged them; the rest (rare, so not staged) copied here when a row
        sets them."""
        params = [r.params for r in rows]
        # The rows the Triton sampler draws from their best logits (their top_k and top_p staged in
        # t.top_k and t.top_p) need no restriction here, and greedy rows none at all (the argmax is
        # the same). Where another row needs one, the drawn rows keep theirs: apply_top_k_top_p
        # takes a small top-k's group by torch.topk, but sorts the vocabulary for a row without one.
        drawn = ["sampler" in self.kernels and candidate_top_k(p) > 0 for p in params]
        restricting = any(needs_top_k_top_p(p, "sampler" in self.kernels) for p in params)
        top_k = [max(p.top_k, 0) if restricting and p.temperature > 0 else 0 for p in params]
        top_p = [p.top_p if restricting and p.temperature > 0 else 1.0 for p in params]
        min_p = [p.min_p for p in params]
        penalised = [i for i, p in enumerate(params) if p.penalized]
        penalties = None
        if penalised:
            if any(rows[i].penalty_row < 0 for i in penalised):
                raise ValueError("a penalised row needs a penalty_row: its request's row of the penalty counts")
            fill = [i for i in penalised if rows[i].history is not None]
            if fill:
                # A sampling row's newest token is its last input token: filled on the device, by
                # the time these kernels run, where the host only knows it is in flight.
                newest = t.input_ids[t.logits_indices[self.to_device(fill, torch.int64)]]
                self.penalty_state.fill([rows[i].penalty_row for i in fill], [rows[i].history for i in fill],
                                        [rows[i].num_prompt_tokens for i in fill], newest)
            penalties = penalty_tensors(penalised, [rows[i].penalty_row for i in penalised],
                                        [params[i] for i in penalised], self.penalty_state)
        processors = None
        if self.logits_processors is not None:
            requests = [r.logits_request for r in rows]
            if any(q is not None for q in requests):
                assert all(q is not None for q in requests), "every engine row that samples carries its request"
                self.logits_processors.update(requests)
                processors = self.logits_processors
            # else a warm-up step's rows, which no request owns: they go past the processors
        return SamplingTensors(
            temperatures=t.temperatures[:len(rows)],
            top_k=self.to_device(top_k, torch.int64) if any(top_k) else None,
            top_p=self.to_device(top_p, torch.float32) if any(p < 1.0 for p in top_p) else None,
            seeds=t.seeds[:len(rows)],
            row_seeds=[r.seed for r in rows],
            all_greedy=all(p.temperature == 0 for p in params),
            row_top_k=top_k,
            penalties=penalties,
            logit_bias=logit_bias_tensors(params, self.device) if any(p.logit_bias for p in params) else None,
            allowed=allowed_token_tensors(params, self.device) if any(p.allowed_token_ids for p in params) else None,
            grammar=grammar_bitmask_tensors(rows, self.device) if any(r.grammar_bitmask is not None for r in rows)
            else None,
            banned=banned_token_tensors(rows, self.model_config.eos_token_ids, self.model_config.vocab_size,
                                        self.device)
            if any(p.min_tokens or p.bad_words for p in params) else None,
            min_p=self.to_device(min_p, torch.float32) if any(min_p) else None,
            candidate_top_k=t.top_k[:len(rows)] if any(drawn) else None,
            candidate_top_p=t.top_p[:len(rows)] if any(drawn) else None,
            processors=processors,
        )

    def to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=dtype), self.device)
