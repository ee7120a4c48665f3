"""The router's one launch (kernels/moe_router.py) against route_ref, transformers' order of
operations; and what the launch is for: a token's experts do not depend on its batch."""
import pytest
import torch

pytest.importorskip("triton")
from mini_engine.kernels.moe_router import route, route_ref  # noqa: E402


def inputs(device, dtype, num_tokens, num_experts, hidden_size=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden_size, generator=gen).to(device, dtype)
    w = (0.3 * torch.randn(num_experts, hidden_size, generator=gen)).to(device, dtype)
    return x, w


@pytest.mark.parametrize("num_tokens", [1, 5, 37])
@pytest.mark.parametrize("num_experts, top_k", [(8, 2), (6, 3), (128, 8), (4, 1)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_router_matches_reference_fp32(device, num_tokens, num_experts, top_k, renormalize):
    x, w = inputs(device, torch.float32, num_tokens, num_experts, seed=num_experts + top_k)
    weights, ids = route(x, w, top_k, renormalize)
    ref_weights, ref_ids = route_ref(x, w, top_k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)
    assert torch.allclose(weights.sum(-1), torch.ones(num_tokens, device=device), atol=1e-5) == (
        renormalize or top_k == num_experts)


def test_router_matches_reference_bf16(device):
    """bf16: our fp32 sum rounded to bf16 against cuBLAS's (or the CPU's) bf16 product; a near
    tie between two experts' logits may round either way, so the ids must agree wherever the
    8th and 9th logits are apart, and the weights wherever the ids agree."""
    x, w = inputs(device, torch.bfloat16, 128, 128, hidden_size=256)
    weights, ids = route(x, w, 8, True)
    ref_weights, ref_ids = route_ref(x, w, 8, True)
    # logits of ~5 in bf16 are 1/32 apart: a gap of 0.15 is beyond any rounding of either product
    logits = torch.nn.functional.linear(x.float(), w.float()).sort(-1, descending=True).values
    clear = (logits[:, 7] - logits[:, 8]) > 0.15
    assert clear.sum() >= 48
    same = (ids.long().sort(-1).values == ref_ids.sort(-1).values).all(-1)
    assert same[clear].all()
    torch.testing.assert_close(weights[same].float(), ref_weights[same].float(), rtol=2e-2, atol=1e-2)


def test_a_tokens_experts_do_not_depend_on_the_batch(device):
    """Each token's ids and weights are the same bits whether its batch has 1, 3, 17 or 200 rows:
    what a CUDA graph's padded batch and an eager step's need to agree (bf16, where it matters)."""
    x, w = inputs(device, torch.bfloat16, 200, 128, hidden_size=256, seed=3)
    weights, ids = route(x, w, 8, True)
    for n in (1, 3, 17):
        part_weights, part_ids = route(x[:n], w, 8, True)
        assert torch.equal(part_ids, ids[:n]) and torch.equal(part_weights, weights[:n])


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")     # the interpreter's NaN
def test_a_row_of_nan_still_gets_experts_in_range(device):
    """A CUDA graph's padding rows hold whatever attention left there: their ids index weights."""
    x, w = inputs(device, torch.float32, 3, 6)
    x[1] = float("nan")
    weights, ids = route(x, w, 3, True)
    assert ((ids >= 0) & (ids < 6)).all()
    ref_weights, ref_ids = route_ref(x, w, 3, True)
    assert torch.equal(ids[[0, 2]].long(), ref_ids[[0, 2]])
