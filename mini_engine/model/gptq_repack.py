"""GPTQ checkpoints (quant_method "gptq": AutoGPTQ's and GPTQModel's 4-bit layout, which vLLM
loads with --quantization gptq, e.g. Qwen3-*-GPTQ-Int4) read as AWQ ones: each tensor, as the
loader reads it, becomes the AWQ tensor of the same module (kernels/awq_linear.py), so that all
that follows (tensor-parallel slices, the packed q/k/v and gate/up layers, LoRA,
modules_to_not_convert, the products) is the AWQ path.

GPTQ stores a projection's W [N, K] (nn.Linear's [out, in]) as

    qweight [K / 8, N] int32      word (i, n) holds rows 8i .. 8i + 7 of column n in nibbles 0 .. 7
    qzeros  [K / group, N / 8]    word (j, c) holds columns 8c .. 8c + 7 of group j in nibbles 0 .. 7
    scales  [K / group, N]        fp16
    g_idx   [K] int32             the group of each input row
    W^T[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]

(AutoGPTQ's QuantLinear.pack and its torch dequantization, auto_gptq/nn_modules/qlinear/qlinear_cuda.py;
GPTQModel's PackableQuantLinear.pack_original.) Both fill their nibbles in plain order; AWQ's
words interleave the columns (AWQ_COLUMN_OF_NIBBLE), and its qweight packs along N.

The zero points, by checkpoint_format:
- "gptq_v2" (GPTQModel's own): z as is.
- "gptq" (v1, the default where config.json names none): z - 1. AutoGPTQ subtracts one from each
  zero point before packing, and its dequantization adds one to each nibble, as vLLM's gptq_gemm
  does (zero_offset 1 unless use_v2_format). GPTQModel, through which transformers reads GPTQ,
  writes v1 by subtracting 0x11111111 from each int32 word of v2 zero points and reads it by
  adding 0x11111111 (gptqmodel/utils/model.py: convert_gptq_v2_to_v1_format_module,
  convert_gptq_v1_to_v2_format_module), so that a zero of 0 (asym: a group whose weights are all
  >= 0) is stored as nibble 15 with one borrowed from the next nibble up. Read here as GPTQModel
  reads it, the word plus 0x11111111 modulo 2^32: that undoes GPTQModel's writes exactly, and
  equals the per-nibble +1 of AutoGPTQ and vLLM on every word without a stored 15 (all of a
  symmetric checkpoint's, whose nibbles are 7). On a stored 15 the readings part: the per-nibble
  +1 makes a zero of 16, which no 4-bit zero point is, and +1 modulo 16 gets the 0 back but leaves
  the borrow in the next column's zero. (AutoGPTQ cannot store a zero of 0 at all: its -1, cast
  to uint32, fills the word's higher nibbles too.)

g_idx: arange(K) // group, unless the checkpoint was quantized in act-order (desc_act) without
static groups (AutoGPTQ's and GPTQModel's fasterquant: g_idx[invperm], which static groups make
arange(K) // group again); any other order would need each projection's input permuted, and is
refused.
"""
import torch

from mini_engine.kernels.awq_linear import AWQ_BITS, AWQ_COLUMN_OF_NIBBLE, AWQ_MAX, PACK, pack_awq_ref
from mini_engine.quantization import GptqConfig

# GPTQModel's v1 <-> v2 offset for 4 bits: one in every nibble of an int32 word.
V1_ZERO_OFFSET = 0x11111111


def plain_nibbles(words: torch.Tensor) -> torch.Tensor:
    """int words [..., C] -> [..., C, 8] values 0..15, nibble j of each word at index j."""
    shifts = torch.arange(PACK, dtype=words.dtype, device=words.device) * AWQ_BITS
    return (words.unsqueeze(-1) >> shifts) & AWQ_MAX


def repack_qweight(qweight: torch.Tensor) -> torch.Tensor:
    """GPTQ's qweight [K / 8, N], packed along K, -> AWQ's [K, N / 8], packed along N: AWQ's row
    8i + r gathers nibble r of GPTQ's row i, eight columns a word in AWQ's order. One pass a
    nibble r over all the rows: 2-5x faster on the CPU than unpacking every value and packing
    them again (pack_awq_ref), and its temporaries are qweight's size, not eight times it."""
    k8, n = qweight.shape
    words = qweight.reshape(k8, n // PACK, PACK)[..., list(AWQ_COLUMN_OF_NIBBLE)]  # [i, c, j]: AWQ's nibble j
    shifts = torch.arange(PACK, dtype=torch.int32, device=qweight.device) * AWQ_BITS
    awq = torch.empty(k8, PACK, n // PACK, dtype=torch.int32, device=qweight.device)
    for r in range(PACK):
        # disjoint nibbles: their sum is their OR (int32 wraps where nibble 7 sets the sign bit)
        awq[:, r] = (((words >> (AWQ_BITS * r)) & AWQ_MAX) << shifts).sum(-1, dtype=torch.int32)
    return awq.view(k8 * PACK, n // PACK)


def repack_qzeros(qzeros: torch.Tensor, stored_less_one: bool) -> torch.Tensor:
    """GPTQ's qzeros [K / group, N / 8], columns in plain order, -> AWQ's, the zero points
    themselves in AWQ's order."""
    if stored_less_one:     # in int64, where the sum's carries beyond bit 31 fall outside every nibble
        qzeros = qzeros.to(torch.int64) + V1_ZERO_OFFSET
    return pack_awq_ref(plain_nibbles(qzeros).flatten(-2))


def as_awq_tensor(param_name: str, tensor: torch.Tensor, config: GptqConfig) -> torch.Tensor:
    """The AWQ tensor that GPTQ's `tensor` for our parameter `param_name` ("...qkv_proj.qweight")
    becomes; scales and anything else as they are. On the tensor's own device."""
    attr = param_name.rpartition(".")[2]
    if attr == "qweight":
        return repack_qweight(tensor)
    if attr == "qzeros":
        return repack_qzeros(tensor, config.zeros_stored_less_one)
    return tensor


def stored_shape(param_name: str, awq_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape GPTQ stores the tensor of AWQ's shape awq_shape in: qweight [K, N / 8] as [K / 8, N]."""
    if param_name.endswith(".qweight"):
        k, words = awq_shape
        return k // PACK, words * PACK
    return awq_shape


def check_g_idx(file: str, ckpt_name: str, g_idx: torch.Tensor, group_size: int) -> None:
    """A projection's g_idx (ckpt_name "...q_proj.g_idx", read from `file`): each input row in its
    group in order, which AWQ's layout assumes; an act-order one is refused by name. group_size 0:
    one group."""
    group = group_size or g_idx.numel()
    in_order = torch.arange(g_idx.numel(), device=g_idx.device) // group
    if not torch.equal(g_idx.to(torch.int64), in_order):
        raise ValueError(f"{file}: tensor {ckpt_name!r}: the input rows are not in groups of {group} in order "
                         f"(act-order, desc_act true without static groups): mini_engine would have to permute "
                         f"this projection's input; not supported")
