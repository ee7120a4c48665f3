"""The LoRA slots of one projection layer (layers/lora.py): the masked product over all slots against
the definition, token by token, on fresh random inputs; and the layers' paths that a model run
through the engine does not reach on CPU (fp8 weights, a rank's share under tensor parallelism)."""
import os
import random

import pytest
import torch

from mini_engine.distributed import TensorParallel
from mini_engine.kernels.fp8_linear import fp8_linear_ref, quantize_fp8_weight_ref
from mini_engine.kernels.rms_norm import rms_norm_ref
from mini_engine.kernels.triton_utils import HAS_TRITON
from mini_engine.layers.linear import Linear, NormedPackedLinear, PackedLinear, RowParallelLinear
from mini_engine.layers.lora import LoRASlots, LoRAStep, lora_delta_ref


def random_pair(rank: int, out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(rank, in_features), torch.randn(out_features, rank)


def packed_pair(pairs: list, output_sizes: list[int], in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed layer's projections' pairs as one (A stacked, B block-diagonal): the definition."""
    a = torch.cat([p[0] if p else torch.zeros(0, in_features) for p in pairs])
    b = torch.block_diag(*[p[1] if p else torch.zeros(size, 0) for p, size in zip(pairs, output_sizes)])
    return a, b


# CPU tensors take a Triton kernel only through the interpreter (on a GPU machine: lora_check.py).
TRITON = pytest.param(True, marks=pytest.mark.skipif(not HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1",
                                                     reason="needs triton's interpreter"))


@pytest.mark.parametrize("use_triton", [False, TRITON], ids=["pytorch", "triton"])
@pytest.mark.parametrize("seed", range(3))
def test_masked_product_is_the_definition(seed, use_triton):
    """The PyTorch path, and the fused kernel (kernels/lora.py, through Triton's interpreter)."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    max_loras, max_rank, in_features, output_sizes = 3, 8, 24, [16, 8, 8]
    step = LoRAStep(max_loras, torch.float32, torch.device("cpu"), use_triton)
    slots = LoRASlots(step, in_features, output_sizes, max_rank)
    by_slot = {}
    for slot in range(max_loras):
        # Each projection of lower rank than the slot, or left alone (None), as adapters come.
        pairs = [random_pair(rng.randint(1, max_rank), size, in_features) if rng.random() < 0.8 else None
                 for size in output_sizes]
        slots.load(slot, pairs)
        by_slot[slot] = packed_pair(pairs, output_sizes, in_features)
    token_slots = [rng.choice([-1, 0, 1, 2]) for _ in range(37)]
    step.begin(torch.tensor(token_slots, dtype=torch.int32))
    x = torch.randn(37, in_features)
    base = torch.randn(37, sum(output_sizes))
    got = slots.add(x, base.clone()) - base
    torch.testing.assert_close(got.double(), lora_delta_ref(x, token_slots, by_slot), rtol=1e-5, atol=1e-4)
    # A slot loaded again holds only its new adapter: nothing of the old one is left.
    slots.load(1, [None, random_pair(2, 8, in_features), None])
    slots.clear(2)
    assert slots.a[2 * slots.width:].abs().sum() == 0 and slots.b[:, 2 * slots.width:].abs().sum() == 0
    assert slots.b[:16, slots.width:2 * slots.width].abs().sum() == 0


@pytest.mark.parametrize("use_triton", [False, TRITON], ids=["pytorch", "triton"])
def test_packed_layer_shrinks_in_its_own_product(use_triton):
    """q/k/v's product over [W; A_all]: its output is
    x W^T plus each token's delta, W stays the layer's weight (a view into the joined buffer,
    which loading writes through), and a slot loaded afterwards lands in the buffer."""
    torch.manual_seed(3)
    rng = random.Random(3)
    output_sizes, in_features = [16, 8, 8], 24
    layer = PackedLinear(in_features, output_sizes, bias=False)
    weight = layer.weight.detach().clone()
    step = LoRAStep(2, torch.float32, torch.device("cpu"), use_triton)
    layer.enable_lora(step, 4)
    assert layer.lora.joined is not None and layer.lora.joined.shape[0] == 32 + 2 * 3 * 4
    assert layer.weight.data_ptr() == layer.lora.joined.data_ptr() and torch.equal(layer.weight, weight)
    by_slot = {}
    for slot in range(2):
        pairs = [random_pair(rng.randint(1, 4), size, in_features) for size in output_sizes]
        layer.lora.load(slot, pairs)
        by_slot[slot] = packed_pair(pairs, output_sizes, in_features)
    token_slots = [rng.choice([-1, 0, 1]) for _ in range(19)]
    step.begin(torch.tensor(token_slots, dtype=torch.int32))
    x = torch.randn(19, in_features)
    with torch.no_grad():
        got = layer(x)
    want = x.double() @ weight.double().t() + lora_delta_ref(x, token_slots, by_slot)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    with torch.no_grad():       # a weight written after the join (a load) is the product's
        layer.weight.mul_(2)
        torch.testing.assert_close(layer(x).double(), want + x.double() @ weight.double().t(), rtol=1e-5, atol=1e-4)


def with_lora(layer: Linear, max_loras: int = 2, max_rank: int = 4) -> LoRAStep:
    step = LoRAStep(max_loras, torch.float32, torch.device("cpu"))
    layer.enable_lora(step, max_rank)
    return step


def test_fp8_checkpoint_projection_reads_the_normed_input():
    """An FP8 checkpoint's q/k/v keep the norm outside the weight (it is done in the quantize
    launch): the LoRA pair reads the normed input, not the residual stream."""
    torch.manual_seed(0)
    layer = NormedPackedLinear(256, [128, 128], False, 1e-6)
    with torch.no_grad():
        layer.norm_weight.copy_(torch.rand(256) + 0.5)
    weight, scale = quantize_fp8_weight_ref(torch.randn(256, 256) * 0.05)
    layer.hold_fp8_weight(False, "cpu")
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.weight_scale_inv.copy_(scale)
    step = with_lora(layer)
    pairs = [random_pair(4, 128, 256), random_pair(3, 128, 256)]
    layer.lora.load(1, pairs)
    step.begin(torch.tensor([1, -1, 1], dtype=torch.int32))
    x = torch.randn(3, 256)
    out, norm_input = layer(x)
    assert norm_input is None
    base = fp8_linear_ref(x, layer.weight, layer.weight_scale_inv, None, layer.norm_weight, 1e-6)
    delta = lora_delta_ref(rms_norm_ref(x, layer.norm_weight, 1e-6), [1, -1, 1], {1: packed_pair(pairs, [128, 128], 256)})
    torch.testing.assert_close((out - base).double(), delta, rtol=1e-4, atol=1e-3)


def test_row_parallel_ranks_deltas_sum_to_the_whole():
    """o_proj and down_proj under tensor parallelism: each rank's input is its share of the
    columns, and its A's columns the same share; the all-reduce's sum of their deltas is the
    whole delta (here the sum is taken by hand: no process group)."""
    torch.manual_seed(1)
    a, b = random_pair(4, 12, 16)
    x = torch.randn(5, 16)
    token_slots = [0, -1, 0, 0, -1]
    total = torch.zeros(5, 12, dtype=torch.float64)
    for rank in range(2):
        layer = RowParallelLinear(8, 12, False, tp=TensorParallel(rank, 2))
        step = with_lora(layer)
        layer.lora.load(0, [layer.lora_pair(a, b)])
        step.begin(torch.tensor(token_slots, dtype=torch.int32))
        share = x[:, rank * 8:(rank + 1) * 8]
        total += (layer.lora.add(share, torch.zeros(5, 12))).double()
    torch.testing.assert_close(total, lora_delta_ref(x, token_slots, {0: (a, b)}), rtol=1e-5, atol=1e-5)


def test_column_parallel_rank_takes_its_rows_of_b():
    torch.manual_seed(2)
    layer = NormedPackedLinear(16, [4, 2], False, 1e-6, tp=TensorParallel(1, 2))     # q 8 rows, k 4, halved
    layer.fold_norm_weight()
    q, k = random_pair(3, 8, 16), random_pair(3, 4, 16)
    (qa, qb), (ka, kb) = layer.lora_pair(*q), layer.lora_pair(*k)
    torch.testing.assert_close(qb, q[1][4:])
    torch.testing.assert_close(kb, k[1][2:])
    torch.testing.assert_close(qa, q[0] * layer.folded_norm_weight)
