import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
from mini_engine.kernels.fused_moe import (ALIGN_KERNEL_MAX_PAIRS, DECODE_CONFIG, DECODE_WIDE_CONFIG,  # noqa: E402
                                           PREFILL_CONFIG, fused_moe, fused_moe_ref, max_padded_slots, moe_align,
                                           moe_align_ref)

# bf16: the reference rounds to bf16 at every step (down output, times the weight, each add into
# the sum), the kernel once per pair and once per token; and the interpreter rounds fp32 -> bf16
# toward zero, not to nearest. Over the cases below that reaches 0.03 on outputs of magnitude ~1
# (4 ulps at 1-2): atol = rtol = 3e-2 leaves a third to spare. Dropped or doubled routing weights,
# or a lost pair, move outputs by ~0.1-1 (test_fused_moe_applies_each_routing_weight_once).
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}

# name: (tokens T, hidden H, intermediate I, experts E, top-k K, routing). H and I are not powers
# of two except in "wide", whose K loops take several full BLOCK_K steps over several column tiles.
CASES = {
    "decode": (1, 64, 32, 16, 4, "random"),         # one token: K blocks, each one pair and padding
    "empty": (0, 48, 40, 4, 2, "random"),
    "ragged": (5, 48, 40, 4, 3, "random"),          # 15 pairs: no multiple of either block_m
    "top1": (7, 48, 40, 4, 1, "random"),
    "sparse": (2, 48, 40, 32, 2, "random"),         # E > T*K: most experts get nothing
    "one_expert": (20, 48, 40, 4, 2, "one_expert"),  # all 40 pairs on expert 2: several 16-slot blocks
    "wide": (9, 256, 64, 8, 2, "random"),
}
CONFIGS = {"block_m16": DECODE_CONFIG, "block_m32": DECODE_WIDE_CONFIG, "block_m128": PREFILL_CONFIG}


def random_routing(num_tokens: int, num_experts: int, top_k: int, routing: str, gen: torch.Generator):
    """Each token's top_k expert ids (all expert 2's where routing is "one_expert", else distinct
    random ones) and routing weights that sum to 1."""
    if routing == "one_expert":
        ids = torch.full((num_tokens, top_k), 2)
    else:
        ids = torch.rand(num_tokens, num_experts, generator=gen).argsort(dim=1)[:, :top_k]
    weights = 0.1 + 0.9 * torch.rand(num_tokens, top_k, generator=gen)
    return ids, weights / weights.sum(dim=1, keepdim=True)


def make_inputs(case: str, dtype: torch.dtype, device: str, seed: int = 0):
    """(hidden, w13, w2, topk_weights, topk_ids): weights scaled so every stage stays O(1); each
    token's K experts distinct (as a router's top-k), except in "one_expert", where every pair of
    every token goes to expert 2. Routing weights in (0.1, 1), summing to 1 per token."""
    num_tokens, hidden_size, intermediate_size, num_experts, top_k, routing = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen)
    w13 = torch.randn(num_experts, 2 * intermediate_size, hidden_size, generator=gen) / hidden_size ** 0.5
    w2 = torch.randn(num_experts, hidden_size, intermediate_size, generator=gen) / intermediate_size ** 0.5
    ids, weights = random_routing(num_tokens, num_experts, top_k, routing, gen)
    return (hidden.to(device, dtype), w13.to(device, dtype), w2.to(device, dtype), weights.to(device, dtype),
            ids.to(device))


def oracle(hidden, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """The definition, token by token: sum over k of weight * down(silu(gate(x)) * up(x))."""
    out = torch.zeros_like(hidden)
    intermediate_size = w2.shape[2]
    for t in range(hidden.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            gate = w13[e, :intermediate_size] @ hidden[t]
            up = w13[e, intermediate_size:] @ hidden[t]
            out[t] += topk_weights[t, k] * (w2[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("case", CASES)
def test_fused_moe_matches_reference(device, dtype, config, case):
    hidden, w13, w2, weights, ids = make_inputs(case, dtype, device)
    out = fused_moe(hidden, w13, w2, weights, ids, config)
    assert out.shape == hidden.shape and out.dtype == dtype
    torch.testing.assert_close(out, fused_moe_ref(hidden, w13, w2, weights, ids), **TOL[dtype])


def test_fused_moe_takes_int32_ids_and_picks_its_own_tiles(device):
    hidden, w13, w2, weights, ids = make_inputs("ragged", torch.float32, device)
    out = fused_moe(hidden, w13, w2, weights, ids.int())
    torch.testing.assert_close(out, fused_moe_ref(hidden, w13, w2, weights, ids), **TOL[torch.float32])


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_oracle(case):
    args = make_inputs(case, torch.float32, "cpu")
    torch.testing.assert_close(fused_moe_ref(*args), oracle(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["ragged", "one_expert"])
def test_reference_matches_transformers_bit_for_bit(case):
    """fused_moe_ref is the engine's CPU path: in bf16 it rounds as transformers' own loop does."""
    pytest.importorskip("transformers")
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    hidden, w13, w2, weights, ids = make_inputs(case, torch.bfloat16, "cpu")
    config = Qwen3MoeConfig(hidden_size=hidden.shape[1], moe_intermediate_size=w2.shape[2],
                            num_experts=w13.shape[0], num_experts_per_tok=ids.shape[1])
    config._experts_implementation = "eager"
    experts = Qwen3MoeExperts(config).to(torch.bfloat16)
    experts.gate_up_proj.data.copy_(w13)
    experts.down_proj.data.copy_(w2)
    with torch.no_grad():
        expected = experts(hidden, ids, weights)
    torch.testing.assert_close(fused_moe_ref(hidden, w13, w2, weights, ids), expected, atol=0, rtol=0)


def test_fused_moe_applies_each_routing_weight_once(device):
    """The kernel's output matches the reference, and the reference with routing weights ignored,
    squared (applied twice) or with one pair's weight zeroed (the pair dropped) is outside the
    tolerance: so any of those bugs fails the first assertion."""
    hidden, w13, w2, weights, ids = make_inputs("ragged", torch.float32, device)
    out = fused_moe(hidden, w13, w2, weights, ids, DECODE_CONFIG)
    torch.testing.assert_close(out, fused_moe_ref(hidden, w13, w2, weights, ids), **TOL[torch.float32])
    dropped = weights.clone()
    dropped[-1, -1] = 0
    for wrong in (torch.ones_like(weights), weights * weights, dropped):
        # bf16's looser tolerance, so the margin holds for the bf16 comparisons too
        assert not torch.allclose(out, fused_moe_ref(hidden, w13, w2, wrong, ids), **TOL[torch.bfloat16])


def check_alignment(ids: torch.Tensor, num_experts: int, block_m: int, align_fn=moe_align) -> None:
    """moe_align's layout, expert by expert: its pairs, then sentinels up to a multiple of block_m,
    from a start that is the previous groups' padded sizes summed; blocks labelled with the expert;
    sentinels in every slot past num_padded."""
    align = align_fn(ids, num_experts, block_m)
    num_pairs = ids.numel()
    sorted_pair_ids, block_expert_ids = align.sorted_pair_ids.cpu(), align.block_expert_ids.cpu()
    max_padded = max_padded_slots(num_pairs, num_experts, block_m)
    assert sorted_pair_ids.dtype == block_expert_ids.dtype == align.num_padded.dtype == torch.int32
    assert sorted_pair_ids.shape == (max_padded,) and block_expert_ids.shape == (max_padded // block_m,)
    assert align.num_padded.shape == (1,) and max_padded % block_m == 0
    experts = ids.reshape(-1).cpu()
    start = 0
    for e in range(num_experts):
        pairs = (experts == e).nonzero().flatten()
        padded = -(-len(pairs) // block_m) * block_m
        group = sorted_pair_ids[start:start + padded].long()
        assert sorted(group[:len(pairs)].tolist()) == pairs.tolist(), f"expert {e}'s pairs"
        assert (group[len(pairs):] == num_pairs).all(), f"expert {e}'s padding"
        assert (block_expert_ids[start // block_m:(start + padded) // block_m] == e).all()
        start += padded
    assert int(align.num_padded) == start <= max_padded
    assert (sorted_pair_ids[start:] == num_pairs).all()


@pytest.mark.parametrize("align_fn", [moe_align, moe_align_ref], ids=["kernel", "ref"])
@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_m,ids_dtype", [
    (1, 8, 128, 16, torch.int64),     # decode: 8 experts of one pair each, max_padded reached exactly
    (37, 4, 8, 16, torch.int32),
    (100, 2, 4, 64, torch.int64),
    (13, 3, 5, 4, torch.int32),
    (0, 2, 4, 16, torch.int64),
    (300, 2, 6, 16, torch.int32),     # 600 pairs: the kernel's programs each take 128 of them
])
def test_moe_align_layout(device, align_fn, num_tokens, top_k, num_experts, block_m, ids_dtype):
    gen = torch.Generator().manual_seed(num_tokens)
    ids = torch.rand(num_tokens, num_experts, generator=gen).argsort(dim=1)[:, :top_k]
    check_alignment(ids.to(device, ids_dtype), num_experts, block_m, align_fn)
    # routings with repeats and skewed loads: independent draws, and every pair on the last expert
    check_alignment(torch.randint(0, num_experts, (num_tokens, top_k), generator=gen).to(device, ids_dtype),
                    num_experts, block_m, align_fn)
    check_alignment(torch.full((num_tokens, top_k), num_experts - 1, dtype=ids_dtype, device=device),
                    num_experts, block_m, align_fn)


@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_m", [(1, 8, 128, 16), (200, 8, 128, 16),
                                                                  (70, 3, 7, 64), (513, 8, 128, 16)])
def test_align_kernel_lays_out_as_the_reference(device, num_tokens, top_k, num_experts, block_m):
    """The Triton layout is moe_align_ref's slot for slot (both keep each expert's pairs in order).
    513 tokens x 8 is past ALIGN_KERNEL_MAX_PAIRS: moe_align takes the reference's path there."""
    gen = torch.Generator().manual_seed(num_tokens)
    ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen).to(device)
    got, ref = moe_align(ids, num_experts, block_m), moe_align_ref(ids, num_experts, block_m)
    assert (num_tokens * top_k > ALIGN_KERNEL_MAX_PAIRS) == (num_tokens == 513)
    for name in ("sorted_pair_ids", "block_expert_ids", "num_padded"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_moe_adds_into_the_residual(device, dtype):
    """With residual: the experts' sum, rounded, added into it in place (the decoder's residual add)."""
    hidden, w13, w2, weights, ids = make_inputs("ragged", dtype, device)
    residual = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(5)).to(device, dtype)
    expected = fused_moe_ref(hidden, w13, w2, weights, ids, residual=residual.clone())
    mine = residual.clone()
    out = fused_moe(hidden, w13, w2, weights, ids, residual=mine)
    assert out.data_ptr() == mine.data_ptr()
    torch.testing.assert_close(mine, expected, **TOL[dtype])
    assert not torch.allclose(mine, fused_moe(hidden, w13, w2, weights, ids), **TOL[dtype])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_fused_moe_replays_in_cuda_graph(config):
    """Captured once with static buffers, the graph follows new routings copied into them: moe_align
    and the kernels read the routing on the device, with no host sync and no shape that depends on it."""
    hidden, w13, w2, weights, ids = make_inputs("wide", torch.bfloat16, "cuda")
    static = [t.clone() for t in (hidden, weights, ids)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):     # warm-up off the capture: compiles the kernels
        fused_moe(static[0], w13, w2, static[1], static[2], config)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(static[0], w13, w2, static[1], static[2], config)
    for seed in (1, 2, 3):
        new_hidden, _, _, new_weights, new_ids = make_inputs("wide", torch.bfloat16, "cuda", seed)
        if seed == 3:
            new_ids.fill_(5)        # every pair on one expert: the most blocks of one expert
        for buffer, value in zip(static, (new_hidden, new_weights, new_ids)):
            buffer.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, fused_moe_ref(new_hidden, w13, w2, new_weights, new_ids),
                                   **TOL[torch.bfloat16])
