"""Programmatic dependent launch (kernels/triton_utils.py): a PDL kernel may start while the kernel
ahead still runs, so it must not touch what that kernel writes before `pdl_enter`. The first test
reads every such kernel's source for that rule; the second, on a Hopper GPU, checks that a decode
step's CUDA graph gives the same logits, bit for bit, with PDL and without."""
import inspect
import re

import pytest
import torch

from mini_engine.kernels import activation, linear, paged_attention, rms_norm, rotary_kv, sampling, triton_utils
from mini_engine.kernels.triton_utils import HAS_TRITON

KERNEL_MODULES = (activation, linear, paged_attention, rms_norm, rotary_kv, sampling)


def _pdl_kernels():
    for module in KERNEL_MODULES:
        for name, kernel in vars(module).items():
            fn = getattr(kernel, "fn", None)        # a @triton.jit function's Python source
            if fn is None or fn.__module__ != module.__name__:
                continue
            source = inspect.getsource(fn)
            if re.search(r"USE_PDL:\s*tl\.constexpr", source):
                yield f"{module.__name__}.{name}", source


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_pdl_kernels_write_nothing_and_read_no_activation_before_they_enter():
    kernels = dict(_pdl_kernels())
    assert len(kernels) >= 7, sorted(kernels)      # decode attention and its reduce, rope, SwiGLU, norm, linear x2
    for name, source in kernels.items():
        body = source.split('"""')[2] if source.count('"""') >= 2 else source     # skip the docstring
        assert body.count("pdl_enter(USE_PDL)") == 1, name
        before = body.split("pdl_enter(USE_PDL)")[0]
        assert "tl.store" not in before and "tl.atomic" not in before, name
        # what may be read early: step inputs and constants, never a kernel's output
        for pointer in re.findall(r"tl\.load\((\w+)", before):
            assert pointer in ("positions_ptr", "cos_sin_ptr", "block_table_ptr", "block_tables_ptr",
                               "seq_lens_ptr", "query_start_loc_ptr"), (name, pointer)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="PDL needs a GPU of compute capability 9.0 or newer")
def test_decode_graph_logits_do_not_change_with_pdl(tiny_checkpoint, monkeypatch):
    from mini_engine.config import EngineConfig
    from mini_engine.runner.batch import BatchRow
    from mini_engine.runner.model_runner import ModelRunner
    from mini_engine.sampling_params import SamplingParams

    runner = ModelRunner(EngineConfig(tiny_checkpoint, device="cuda", num_kv_blocks=40 * 33, max_model_len=256,
                                      max_num_seqs=48, block_size=4, enforce_eager=True))
    params = SamplingParams(temperature=0, max_tokens=4)
    results = []
    for pdl in ("0", "1"):
        monkeypatch.setenv("MINI_ENGINE_PDL", pdl)
        triton_utils.use_pdl.cache_clear()
        # the same random context each time, so that attention reads values, not zeros
        runner.kv_cache.normal_(generator=torch.Generator(device="cuda").manual_seed(0))
        logits_by_batch = []
        for batch in (1, 7, 40):        # one split and several; the skinny and cuBLAS projections
            rows = [BatchRow([3 + i], 10 + 3 * i, list(range(33 * i, 33 * i + 33)), True, params)
                    for i in range(batch)]
            model = runner.model
            logits = torch.empty(batch, model.config.vocab_size, dtype=runner.dtype, device="cuda")
            with torch.inference_mode():
                t, meta = runner.prepare_inputs(rows, graph_size=batch)
                model.compute_logits(model(t.input_ids, t.positions, meta), out=logits)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    model.compute_logits(model(t.input_ids, t.positions, meta), out=logits)
                for _ in range(3):
                    graph.replay()
            torch.cuda.synchronize()
            logits_by_batch.append(logits.clone())
        results.append(logits_by_batch)
    triton_utils.use_pdl.cache_clear()
    for without, with_pdl in zip(*results):
        assert torch.equal(without, with_pdl)


def test_pdl_is_off_without_a_hopper_gpu_or_when_turned_off(monkeypatch):
    """The interpreter and older GPUs have no griddepcontrol; MINI_ENGINE_PDL=0 is the A/B switch."""
    triton_utils.use_pdl.cache_clear()
    try:
        assert triton_utils.pdl_options(torch.device("cpu")) == {"USE_PDL": False, "launch_pdl": False}
        monkeypatch.setenv("MINI_ENGINE_PDL", "0")
        assert not triton_utils.use_pdl(torch.device("cuda"))       # decided before any CUDA call
    finally:
        triton_utils.use_pdl.cache_clear()
