"""GPTQ weights (mini_engine/quantization.py, model/gptq_repack.py): a checkpoint as AutoGPTQ and
GPTQModel lay one out (Qwen3-*-GPTQ-Int4: W^T's 4-bit values packed along the input rows, the zero
points along the columns in plain order, v1's stored less one, each row's group in g_idx),
repacked into AWQ's layout as it loads, against transformers.

The oracle is transformers' Qwen3ForCausalLM in fp32 over the checkpoint dequantized by GPTQ's
definition, written here apart from the engine's repack (gptq_oracle): W^T[k, n] = (q[k, n] -
z[g_idx[k], n]) * s[g_idx[k], n], v1's zero points read as GPTQModel reads them. Past the repack a
GPTQ checkpoint runs as AWQ, so the source checkpoint and the helpers are test_qwen3_awq.py's, and
so is the bar: logits to fp32's rounding, greedy tokens equal through the scheduler."""
import functools
import json
import os

import pytest
import torch

from benchmarks.awq_check import per_call_check
from benchmarks.engine_judge import dequantized_model
from mini_engine import LLM
from mini_engine.config import EngineConfig
from mini_engine.kernels.awq_linear import pack_awq_ref
from mini_engine.model import gptq_repack
from mini_engine.model.gptq_repack import repack_qweight, repack_qzeros
from mini_engine.model.random_checkpoint import gptq_tensors, int32_words, quantize_gptq_ref, write_gptq_layout
from mini_engine.quantization import GptqConfig
from mini_engine.runner.model_runner import ModelRunner
from tests.conftest import tiny_config
from tests.engine.test_greedy_vs_transformers import mixed_prompts
from tests.model.test_qwen3_awq import (AWQ_TINY, GROUP, assert_config_refused, greedy, oracle_greedy,  # noqa: F401
                                        rewritten, source)
from tests.model.test_qwen3_fp8 import assert_quantized_weights_never_in_full_precision
from tests.model.test_qwen3_vs_transformers import four_prompt_logits

# The logits' largest difference from the oracle's: both multiply the same fp32 weights.
TOLERANCE = 1e-4


# ---- the format ----

def autogptq_pack(intweight: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoGPTQ's QuantLinear.pack loops for 4 bits, written out (qlinear_cuda.py): qweight's word
    `row` holds W^T's rows i .. i + 7 ([K, N]) in nibbles 0 .. 7, qzeros' word `col` the zero
    points' columns i .. i + 7 ([K / group, N]). (AutoGPTQ passes it the zero points less one.)"""
    qweight = torch.zeros(intweight.shape[0] // 8, intweight.shape[1], dtype=torch.int64)
    i = row = 0
    while row < qweight.shape[0]:
        for j in range(i, i + 8):
            qweight[row] |= intweight[j] << (4 * (j - i))
        i += 8
        row += 1
    qzeros = torch.zeros(zeros.shape[0], zeros.shape[1] // 8, dtype=torch.int64)
    i = col = 0
    while col < qzeros.shape[1]:
        for j in range(i, i + 8):
            qzeros[:, col] |= zeros[:, j] << (4 * (j - i))
        i += 8
        col += 1
    return int32_words(qweight), int32_words(qzeros)


def test_packing_is_gptqs():
    """The repack turns AutoGPTQ's words (and GPTQModel's v1 zero points) into pack_awq_ref's of the
    same values. A v1 zero point of 0 is stored as 15 with one borrowed from the next column's:
    read a nibble at a time (+1 modulo 16), that column would be one short."""
    q = torch.randint(0, 16, (64, 24))
    q[:8, 0] = 15                                   # nibble 7 set: the word's sign bit
    zeros = torch.randint(2, 16, (2, 24))
    zeros[0, 2] = zeros[1, 7] = 0                   # asym, groups all >= 0; the second borrows beyond its word
    zeros[1, 15] = 15                               # in a nibble 7: the sign bit
    qweight, v2_zeros = autogptq_pack(q, zeros)
    v1_zeros = v2_zeros.clone()
    v1_zeros -= 0b00010001000100010001000100010001  # GPTQModel's convert_gptq_v2_to_v1_format_module, 4 bits
    assert torch.equal(repack_qweight(qweight), pack_awq_ref(q))
    assert torch.equal(repack_qzeros(v2_zeros, stored_less_one=False), pack_awq_ref(zeros))
    assert torch.equal(repack_qzeros(v1_zeros, stored_less_one=True), pack_awq_ref(zeros))
    per_nibble = (gptq_repack.plain_nibbles(v1_zeros).flatten(-2) + 1) % 16
    assert per_nibble[0, 2] == 0 and per_nibble[0, 3] == zeros[0, 3] - 1
    # AutoGPTQ's own v1 (each zero point less one before packing; it can store no 0): the same values
    _, autogptq_v1 = autogptq_pack(q, zeros.clamp(min=1) - 1)
    assert torch.equal(repack_qzeros(autogptq_v1, stored_less_one=True), pack_awq_ref(zeros.clamp(min=1)))


@pytest.mark.parametrize("sym", [False, True])
def test_the_writer_rounds_and_packs_as_gptq(sym):
    """write_gptq_layout's tensors: AutoGPTQ's words of the values GPTQ's Quantizer rounds to
    (sym: every zero point 8), each weight within a step of its value, most within half."""
    weight = torch.randn(24, 64) * 0.1
    q, zeros, scales = quantize_gptq_ref(weight, 32, sym)
    written = gptq_tensors(weight, 32, sym, zeros_less_one=True)
    qweight, v2_zeros = autogptq_pack(q, zeros)
    v1_zeros = v2_zeros.clone()
    v1_zeros -= 0x11111111
    assert torch.equal(written["qweight"], qweight) and torch.equal(written["qzeros"], v1_zeros)
    assert torch.equal(written["scales"], scales) and scales.dtype == torch.float16
    assert torch.equal(written["g_idx"], torch.arange(64, dtype=torch.int32) // 32)
    assert not sym or (zeros == 8).all()
    step = scales.float().repeat_interleave(32, 0)
    error = ((q - zeros.repeat_interleave(32, 0)) * step - weight.t()).abs()
    assert (error <= step + 1e-6).all() and (error <= step / 2 + 1e-6).float().mean() > 0.95


# ---- checkpoints and the oracle ----

@pytest.fixture(scope="module")
def edged_source(source, tmp_path_factory) -> str:
    """source with some groups of a column all >= 0 (an asym zero point of 0, which v1 stores with
    a borrow from the next column) and all <= 0 (a zero point of 15)."""
    def change(tensors):
        k = tensors["model.layers.0.self_attn.k_proj.weight"]          # [32, 64]: groups of 32 inputs
        k[2, :GROUP], k[12, GROUP:], k[7, :GROUP] = k[2, :GROUP].abs(), k[12, GROUP:].abs(), -k[7, :GROUP].abs()
        down = tensors["model.layers.1.mlp.down_proj.weight"]           # [64, 128]
        down[20, 2 * GROUP:3 * GROUP] = down[20, 2 * GROUP:3 * GROUP].abs()
    return rewritten(source, tmp_path_factory.mktemp("edged"), change)


@pytest.fixture(scope="module")
def gptq_checkpoint(edged_source, tmp_path_factory):
    """gptq_checkpoint(**write_gptq_layout's options): the checkpoint (groups of GROUP rows, asym
    and v1 unless told), written once."""
    made = {}

    def make(**options) -> str:
        options = dict(group_size=GROUP, sym=False) | options
        key = repr(sorted(options.items()))
        if key not in made:
            made[key] = write_gptq_layout(edged_source, str(tmp_path_factory.mktemp("gptq")), **options)
        return made[key]
    return make


@functools.lru_cache(maxsize=None)
def gptq_oracle(path: str):
    """transformers over the GPTQ checkpoint at `path`, each projection's weight dequantized by
    GPTQ's definition (written once beside it, in fp32)."""
    with open(os.path.join(path, "config.json")) as f:
        v1 = json.load(f)["quantization_config"]["checkpoint_format"] == "gptq"

    def dequantize(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in tensors.items():
            if name.endswith(".qweight"):
                module = name.removesuffix(".qweight")
                q = torch.empty(t.shape[0] * 8, t.shape[1])
                for j in range(8):
                    q[j::8] = (t.long() >> (4 * j)) & 0xF                # row 8i + j: nibble j of word i
                words = tensors[f"{module}.qzeros"].long()
                if v1:
                    words = words + 0x11111111       # GPTQModel's convert_gptq_v1_to_v2_format_module
                z = torch.empty(words.shape[0], words.shape[1] * 8)
                for j in range(8):
                    z[:, j::8] = (words >> (4 * j)) & 0xF                # column 8c + j: nibble j of word c
                g, s = tensors[f"{module}.g_idx"].long(), tensors[f"{module}.scales"].float()
                out[f"{module}.weight"] = ((q - z[g]) * s[g]).t().contiguous()
            elif not name.endswith((".qzeros", ".scales", ".g_idx")):
                out[name] = t
        return out
    return dequantized_model(path, dequantize, torch.float32, "eager").eval()


def reconfigured(path: str, folder, **changes) -> str:
    """path's checkpoint in folder, its quantization_config's fields changed."""
    folder = rewritten(path, folder, lambda tensors: None)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] |= changes
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def logits_error(path: str, oracle_path: str | None = None) -> float:
    """The engine's logits over `path` (one flat batch of four prompts) against the oracle's over
    oracle_path (path itself unless given): the largest difference."""
    worst = 0.0
    for prompt, logits in four_prompt_logits(path):
        with torch.inference_mode():
            expected = gptq_oracle(oracle_path or path)(torch.tensor([prompt])).logits[0]
        worst = max(worst, (logits - expected).abs().max().item())
    return worst


# ---- config.json ----

GPTQ_FIELDS = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
               "lm_head": False, "checkpoint_format": "gptq"}


def test_a_gptq_checkpoint_is_read_as_awq(gptq_checkpoint):
    """Held in AWQ's shapes, g_idx checked and dropped."""
    config = EngineConfig(gptq_checkpoint(), device="cpu")
    quantization = config.model_config.quantization
    assert config.quantization == "gptq" and isinstance(quantization, GptqConfig)
    assert quantization.group_size == GROUP and quantization.zeros_stored_less_one
    assert not EngineConfig(gptq_checkpoint(checkpoint_format="gptq_v2"),
                            device="cpu").model_config.quantization.zeros_stored_less_one
    runner = ModelRunner(EngineConfig(gptq_checkpoint(), device="cpu", num_kv_blocks=8))
    qkv = runner.model.layers[0].self_attn.qkv_proj
    assert qkv.weight is None and qkv.qweight.shape == (64, 128 // 8) and qkv.qzeros.shape == (2, 16)
    assert qkv.scales.shape == (2, 128) and runner.model.layers[0].mlp.down_proj.qweight.shape == (128, 64 // 8)
    assert not any("g_idx" in name for name, _ in runner.model.named_parameters())


def test_gptq_weights_are_never_allocated_in_full_precision(gptq_checkpoint):
    assert_quantized_weights_never_in_full_precision(gptq_checkpoint())


@pytest.mark.parametrize("change, message", [
    ({"bits": 8}, "GPTQ with 8 bits is not supported"),
    ({"bits": 3}, "GPTQ with 3 bits is not supported"),
    ({"checkpoint_format": "marlin"}, "GPTQ checkpoint_format 'marlin' is not supported"),
    ({"group_size": 12}, "GPTQ group_size must be -1 .* or a multiple of 16, got 12"),
    ({"lm_head": True}, "quantized lm_head"),
    ({"sym": "yes"}, "GPTQ's sym must be true or false"),
    ({"pack_dtype": "int16"}, "GPTQ pack_dtype 'int16' is not supported"),
    ({"dynamic": {r"-:.*\.0\..*": {}, r".*\.1\..*": {"bits": 8}}},
     r"dynamic overrides \[.*\] change the quantization"),
    ({"dynamic": {"-:(": {}}}, r"dynamic entry '-:\(' is not a regex"),
])
def test_other_gptq_configs_are_clear_errors(tmp_path, change, message):
    assert_config_refused(tmp_path, AWQ_TINY | {"quantization_config": GPTQ_FIELDS | change}, message)


def test_gptq_is_refused_where_it_cannot_be(tmp_path, source, gptq_checkpoint):
    assert_config_refused(tmp_path, tiny_config("moe-mixed") | {"quantization_config": GPTQ_FIELDS},
                          "gptq Qwen3-MoE checkpoints are not supported")
    with pytest.raises(ValueError, match="quantization='gptq' needs a GPTQ checkpoint"):
        EngineConfig(source, device="cpu", quantization="gptq")
    with pytest.raises(ValueError, match="quantization='awq', but the checkpoint is gptq"):
        EngineConfig(gptq_checkpoint(), device="cpu", quantization="awq")
    assert EngineConfig(gptq_checkpoint(), device="cpu", quantization="gptq").quantization == "gptq"


# ---- the checkpoint's tensors ----

def test_malformed_gptq_tensors_are_clear_errors(gptq_checkpoint, tmp_path):
    """Said in GPTQ's shapes: an AWQ checkpoint's qweight under a GPTQ config, say."""
    qweight = "model.layers.0.mlp.down_proj.qweight"
    cases = [
        (lambda t: t.update({qweight: t[qweight].reshape(128, 8)}),
         r"'model.layers.0.mlp.down_proj.qweight' has shape \(128, 8\), expected \(16, 64\)"),
        (lambda t: t.pop("model.layers.1.self_attn.k_proj.qzeros"),
         r"missing tensors \['model.layers.1.self_attn.k_proj.qzeros'\]"),
        (lambda t: t.update({qweight: t[qweight].float()}),
         "'model.layers.0.mlp.down_proj.qweight' is torch.float32, expected int32"),
    ]
    for i, (change, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message):
            ModelRunner(EngineConfig(rewritten(gptq_checkpoint(), tmp_path / str(i), change), device="cpu",
                                     num_kv_blocks=8))


def test_act_order_runs_only_with_the_rows_in_order(gptq_checkpoint, tmp_path):
    """desc_act true: a checkpoint whose g_idx keeps the rows in order (act-order with GPTQ's static
    groups) loads as the same one without; an act-order g_idx is refused, the tensor named."""
    in_order = gptq_checkpoint(desc_act=True)
    ours = ModelRunner(EngineConfig(in_order, device="cpu", num_kv_blocks=8)).model.state_dict()
    without = ModelRunner(EngineConfig(gptq_checkpoint(), device="cpu", num_kv_blocks=8)).model.state_dict()
    assert ours.keys() == without.keys() and all(torch.equal(ours[name], without[name]) for name in ours)
    g_idx = "model.layers.1.mlp.down_proj.g_idx"
    act_order = rewritten(in_order, tmp_path / "act-order", lambda t: t.update({g_idx: t[g_idx].flip(0)}))
    with pytest.raises(ValueError, match=rf"'{g_idx}': the input rows are not in groups of {GROUP} in order"):
        ModelRunner(EngineConfig(act_order, device="cpu", num_kv_blocks=8))


# ---- against transformers ----

VARIANTS = {"asym-v1": {}, "sym-v1": dict(sym=True), "asym-v2": dict(checkpoint_format="gptq_v2"),
            "sym-v2": dict(sym=True, checkpoint_format="gptq_v2")}


@pytest.mark.parametrize("options", VARIANTS.values(), ids=VARIANTS.keys())
def test_logits_match_transformers(gptq_checkpoint, options):
    """To fp32's rounding: the dequantized weights are exact in fp32 (a 4-bit integer times an fp16
    scale)."""
    assert logits_error(gptq_checkpoint(**options)) < TOLERANCE


def test_a_wrong_zero_point_reading_is_caught(gptq_checkpoint, tmp_path, monkeypatch):
    """The logits test can fail: v1's zero points read as v2's (each one short), or one nibble at a
    time (+1 modulo 16: the borrows of its zero points of 0 left in), miss by far more than it
    allows."""
    path = gptq_checkpoint()
    as_v2 = reconfigured(path, tmp_path / "as-v2", checkpoint_format="gptq_v2")
    assert logits_error(as_v2, oracle_path=path) > 100 * TOLERANCE

    def nibble_at_a_time(qzeros: torch.Tensor, stored_less_one: bool) -> torch.Tensor:
        return pack_awq_ref((gptq_repack.plain_nibbles(qzeros).flatten(-2) + stored_less_one) % 16)
    monkeypatch.setattr(gptq_repack, "repack_qzeros", nibble_at_a_time)
    assert logits_error(path) > 100 * TOLERANCE


def test_greedy_through_the_scheduler_matches_transformers(gptq_checkpoint):
    """Chunked prefill mixed with decode, and preemption."""
    path = gptq_checkpoint()
    prompts = mixed_prompts()
    want = oracle_greedy(path, prompts, gptq_oracle)
    assert len({tuple(w) for w in want}) > 1
    for options in (dict(num_kv_blocks=256), dict(num_kv_blocks=16, block_size=4, max_num_batched_tokens=16)):
        assert greedy(path, prompts, **options) == want


def test_one_group_of_the_whole_input(gptq_checkpoint):
    """group_size -1 (g_idx all 0): one scale and zero point a column over each projection's input."""
    path = gptq_checkpoint(group_size=-1, sym=True)
    runner = ModelRunner(EngineConfig(path, device="cpu", num_kv_blocks=8))
    assert runner.model.layers[0].mlp.down_proj.scales.shape == (1, 64)
    prompts = mixed_prompts()[:2]
    assert greedy(path, prompts, num_kv_blocks=64) == oracle_greedy(path, prompts, gptq_oracle)


def test_dynamics_unquantized_modules_stay_in_the_models_dtype(gptq_checkpoint, tmp_path):
    """GPTQModel's dynamic "-:" entries: layer 1's MLP stays fp32; a packed layer half out of GPTQ
    is refused."""
    written = gptq_checkpoint(modules_to_not_convert=["model.layers.1.mlp"])
    path = reconfigured(written, tmp_path / "dynamic", modules_to_not_convert=None,
                        dynamic={r"-:model\.layers\.1\.mlp\..*": {}})
    layers = ModelRunner(EngineConfig(path, device="cpu", num_kv_blocks=8)).model.layers
    assert layers[1].mlp.gate_up_proj.weight.dtype == torch.float32 and layers[1].mlp.down_proj.qweight is None
    assert layers[1].self_attn.o_proj.qweight is not None and layers[0].mlp.down_proj.weight is None
    prompts = mixed_prompts()[:4]
    assert greedy(path, prompts, num_kv_blocks=64) == oracle_greedy(path, prompts, gptq_oracle)
    half = reconfigured(gptq_checkpoint(), tmp_path / "half", dynamic={r"-:.*\.k_proj": {}})
    with pytest.raises(ValueError, match="modules_to_not_convert or dynamic keeps some of .*q_proj.* out of gptq"):
        ModelRunner(EngineConfig(half, device="cpu", num_kv_blocks=8))


def test_tensor_parallel_gptq_matches_transformers(gptq_checkpoint):
    """Two ranks (gloo), each slicing the repacked AWQ tensors."""
    path = gptq_checkpoint()
    prompts = mixed_prompts()[:4]
    assert greedy(path, prompts, num_kv_blocks=64, tensor_parallel_size=2) == oracle_greedy(path, prompts, gptq_oracle)


def test_triton_products_in_the_model(gptq_checkpoint):
    """The AWQ kernels (the interpreter on CPU) over the repacked weights, each call checked
    against awq_linear_ref on the same arguments."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors take Triton kernels only through its interpreter")
    checked = per_call_check(gptq_checkpoint(), mixed_prompts()[:4], 4, device="cpu", kernels="awq_linear")
    assert checked["modules"] == checked["of_modules"] > 0, checked
    assert checked["worst_rel_err"] < 1e-5, checked


def test_weight_updates_and_deep_sleep_are_refused(gptq_checkpoint):
    llm = LLM(gptq_checkpoint(), device="cpu", num_kv_blocks=16, enable_sleep_mode=True)
    try:
        with pytest.raises(ValueError, match="load_weights does not update GPTQ's 4-bit weights"):
            llm.load_weights([("model.layers.0.mlp.down_proj.qweight", torch.zeros(128, 8, dtype=torch.int32))])
        with pytest.raises(ValueError, match="sleep\\(level=2\\) .* GPTQ"):
            llm.sleep(level=2)
    finally:
        llm.shutdown()
