"""kernels/fp8_fused_moe.py: the fp8 experts' grouped GEMMs against their PyTorch reference, on
fresh random inputs (padded expert blocks, a partial last group of H, several blocks of one
expert), and the reference against the definition, token by token."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
from mini_engine.kernels.fp8_fused_moe import (FP8_DECODE_CONFIG, FP8_DECODE_WIDE_CONFIG,  # noqa: E402
                                               FP8_PREFILL_CONFIG, fp8_fused_moe, fp8_fused_moe_ref)
from mini_engine.kernels.fp8_linear import (BLOCK, dequantize_fp8_ref, quantize_fp8_ref,  # noqa: E402
                                            quantize_fp8_weight_ref)
from tests.kernels.test_fused_moe import random_routing  # noqa: E402

# Tolerances relative to a call's largest output (assert_matches). fp32: the kernel sums gate/up
# in another order than the reference, so a SwiGLU value on an e4m3 rounding boundary can quantize
# to the neighbouring value (one step: 1/16 to 1/8 of it) before the down GEMM; measured: 1.5e-4
# of the largest output, else ~5e-7. bf16: besides, the reference rounds at every step, and the
# interpreter rounds fp32 -> bf16 toward zero (the GPU to nearest), so that a few percent of the
# SwiGLU values quantize to a neighbour; measured over 3 seeds of each case: 0.044 of the largest
# output at most, a relative norm of 0.035. A wrong scale (of a block, a row or an expert), a lost
# pair or a doubled routing weight is off by tens of percent (test_wrong_scales_or_weights_are_caught).
TOL = {torch.float32: dict(atol=1e-3, rtol=1e-3), torch.bfloat16: dict(atol=0.08, rtol=0.05)}
BF16_NORM_TOL = 0.06

# name: (tokens T, hidden H, intermediate I, experts E, top-k K, routing). I is whole 128-row
# blocks (fp8 experts need it); H = 200 leaves the last group of the gate/up GEMM's K short.
CASES = {
    "decode": (1, 128, 128, 16, 4, "random"),        # K blocks of one pair each, the rest padding
    "empty": (0, 128, 128, 4, 2, "random"),
    "ragged": (5, 200, 128, 4, 3, "random"),         # 15 pairs: no multiple of any block_m
    "one_expert": (20, 128, 256, 4, 2, "one_expert"),  # 40 pairs on expert 2: several blocks, 2 groups of I
}
# (FP8_DECODE_WIDE_CONFIG differs from the decode tiles in block_m alone: the GPU's graph test takes it.)
CONFIGS = {"block_m16": FP8_DECODE_CONFIG, "block_m64": FP8_PREFILL_CONFIG}
GRAPH_CONFIGS = CONFIGS | {"block_m32": FP8_DECODE_WIDE_CONFIG}


def block_varied(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """N(0, 1) values whose 128 x 128 blocks differ in size by factors of ~e (so do their scales): a
    kernel that reads another block's scale, or another expert's, is off by that much."""
    *lead, rows, cols = shape
    sizes = torch.exp(0.5 * torch.randn(*lead, -(-rows // BLOCK), -(-cols // BLOCK), generator=gen))
    return torch.randn(shape, generator=gen) * sizes.repeat_interleave(BLOCK, -2)[..., :rows, :] \
        .repeat_interleave(BLOCK, -1)[..., :cols]


def make_inputs(case: str, dtype: torch.dtype, device: str, seed: int = 0):
    """(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale): fp8 experts quantized from
    weights scaled so every stage stays O(1), hidden rows of different sizes; each token's K
    experts distinct (as a router's top-k), except in "one_expert". Routing weights sum to 1."""
    num_tokens, hidden_size, intermediate_size, num_experts, top_k, routing = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen) * torch.exp(0.5 * torch.randn(num_tokens, 1,
                                                                                                generator=gen))
    w13, w13_scale = quantize_fp8_weight_ref(block_varied((num_experts, 2 * intermediate_size, hidden_size), gen)
                                             / (2 * hidden_size ** 0.5))
    w2, w2_scale = quantize_fp8_weight_ref(block_varied((num_experts, hidden_size, intermediate_size), gen)
                                           / (2 * intermediate_size ** 0.5))
    ids, weights = random_routing(num_tokens, num_experts, top_k, routing, gen)
    return (hidden.to(device, dtype), w13.to(device), w2.to(device), weights.to(device, dtype), ids.to(device),
            w13_scale.to(device), w2_scale.to(device))


def assert_matches(out: torch.Tensor, expected: torch.Tensor) -> None:
    """Within TOL, its atol relative to the largest output (the outputs of one call span decades)."""
    tol = TOL[out.dtype]
    scale = expected.float().abs().max().item() if expected.numel() else 1.0
    torch.testing.assert_close(out, expected, atol=tol["atol"] * scale, rtol=tol["rtol"])
    if out.dtype == torch.bfloat16 and out.numel():
        assert (out.float() - expected.float()).norm() <= BF16_NORM_TOL * expected.float().norm()


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("case", CASES)
def test_fp8_fused_moe_matches_reference(device, config, case):
    args = make_inputs(case, torch.float32, device)
    out = fp8_fused_moe(*args, config=config)
    assert out.shape == args[0].shape and out.dtype == torch.float32
    assert_matches(out, fp8_fused_moe_ref(*args))


def test_fp8_fused_moe_in_bf16_picks_its_own_tiles(device):
    args = make_inputs("ragged", torch.bfloat16, device, seed=1)
    assert_matches(fp8_fused_moe(*args), fp8_fused_moe_ref(*args))


def test_fp8_fused_moe_adds_into_the_residual(device):
    args = make_inputs("ragged", torch.float32, device, seed=2)
    residual = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(5)).to(device)
    expected = fp8_fused_moe_ref(*args, residual=residual.clone())
    mine = residual.clone()
    assert fp8_fused_moe(*args, residual=mine).data_ptr() == mine.data_ptr()
    assert_matches(mine, expected)


def test_wrong_scales_or_weights_are_caught(device):
    """The reference with one block's scale of an expert in use doubled (gate/up or down), or a
    pair's routing weight dropped, is outside even bf16's tolerance of the kernel's output."""
    hidden, w13, w2, weights, ids, w13_scale, w2_scale = make_inputs("ragged", torch.float32, device, seed=3)
    out = fp8_fused_moe(hidden, w13, w2, weights, ids, w13_scale, w2_scale)
    expert = int(ids[0, 0])
    wrong_13, wrong_2, dropped = w13_scale.clone(), w2_scale.clone(), weights.clone()
    wrong_13[expert, 1, 1] *= 2             # up rows, the short last group of H
    wrong_2[expert, 0, 0] *= 2
    dropped[-1, -1] = 0
    for wrong in ((weights, wrong_13, w2_scale), (weights, w13_scale, wrong_2), (dropped, w13_scale, w2_scale)):
        topk_weights, scales = wrong[0], wrong[1:]
        expected = fp8_fused_moe_ref(hidden, w13, w2, topk_weights, ids, *scales)
        assert not torch.allclose(out, expected, atol=TOL[torch.bfloat16]["atol"] * expected.abs().max(),
                                  rtol=TOL[torch.bfloat16]["rtol"])


def test_reference_is_the_definition():
    """Token by token: sum over k of weight * W2 q(silu(gate) * up), gate and up = W13 q(x), with
    W the dequantized blocks and q() the row groups' quantization."""
    hidden, w13, w2, weights, ids, w13_scale, w2_scale = make_inputs("ragged", torch.float32, "cpu")

    def q(x):
        values, scales = quantize_fp8_ref(x[None])
        return dequantize_fp8_ref(values, scales, 1)[0]
    intermediate_size = w2.shape[2]
    expected = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate_up = dequantize_fp8_ref(w13[e], w13_scale[e], BLOCK) @ q(hidden[t])
            act = F.silu(gate_up[:intermediate_size]) * gate_up[intermediate_size:]
            expected[t] += weights[t, k] * (dequantize_fp8_ref(w2[e], w2_scale[e], BLOCK) @ q(act))
    torch.testing.assert_close(fp8_fused_moe_ref(hidden, w13, w2, weights, ids, w13_scale, w2_scale), expected,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("config", GRAPH_CONFIGS.values(), ids=GRAPH_CONFIGS.keys())
def test_fp8_fused_moe_replays_in_cuda_graph(config):
    """Captured once with static buffers, the graph follows new hidden rows and routings copied
    into them: the quantize launches and the GEMMs' grids depend on T, K and E alone."""
    hidden, w13, w2, weights, ids, w13_scale, w2_scale = make_inputs("one_expert", torch.bfloat16, "cuda")
    static = [t.clone() for t in (hidden, weights, ids)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):     # warm-up off the capture: compiles the kernels
        fp8_fused_moe(static[0], w13, w2, static[1], static[2], w13_scale, w2_scale, config=config)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_fused_moe(static[0], w13, w2, static[1], static[2], w13_scale, w2_scale, config=config)
    for seed in (1, 2):
        new_hidden, _, _, new_weights, _, _, _ = make_inputs("one_expert", torch.bfloat16, "cuda", seed)
        new_ids = torch.randint(0, w13.shape[0], ids.shape, device="cuda")
        for buffer, value in zip(static, (new_hidden, new_weights, new_ids)):
            buffer.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(out, fp8_fused_moe_ref(new_hidden, w13, w2, new_weights, new_ids, w13_scale, w2_scale))
