"""LoRA in the projections: each projection layer holds max_loras adapter slots, and each token
of a step adds the low-rank product of its own request's slot (or none).

A slot's pair is A [R, in] and B [out, R] (R = max_lora_rank; an adapter of lower rank is padded
with zeros, and its scale is in B). A packed layer (q/k/v, gate/up) stacks its projections'
pairs: A's rows projection by projection, B block-diagonal, so that one product serves them all.
The slots lie side by side, A_all [L * R', in] and B_all [out, L * R'], and a step of T tokens
computes

    delta = ((x A_all^T) * mask) B_all^T,   mask[t, l * R' : (l + 1) * R'] = (slot of t == l)

two GEMMs whatever the mix of adapters: no per-adapter loop and nothing that depends on the
step's data, so a CUDA graph captures it as it is. The price is L times the low-rank work (vLLM's
punica kernels gather each token's own slot instead); at vLLM's default max_loras=1 it is none.
With the "lora" kernel (kernels/lora.py) the mask, the expand and the add are one launch.

A packed layer's product (q/k/v, gate/up: no residual to add into) computes the shrink itself:
its weight and A_all lie in one buffer, [W; A_all], so one GEMM gives [x W^T | x A_all^T] and
the shrink costs no launch of its own (LoRASlots.join_weight). On the H200 the extra rows cost
the product 0-1 us at decode (7-13% at 16k tokens), where a shrink of its own took ~3.5 us, and
padding them to 64 or 128 rows changed nothing measurable (benchmarks/lora_sweep.py, NOTES entry 59)."""
import torch

from mini_engine.kernels.lora import lora_expand_ref, lora_mask


class LoRAStep:
    """The step's token slots, shared by every LoRA layer of the model: set once a forward
    (Qwen3ForCausalLM.forward) from the step's lora_slots, [T] int32, -1 for no adapter. The
    PyTorch path's token-to-slot mask is made from them once, by the first layer that asks."""

    def __init__(self, max_loras: int, dtype: torch.dtype, device: torch.device, use_triton: bool = False):
        self.max_loras = max_loras
        self.dtype = dtype
        self.device = device
        self.use_triton = use_triton
        self.token_slots: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None

    def begin(self, token_slots: torch.Tensor) -> None:
        self.token_slots, self._mask = token_slots, None

    @property
    def mask(self) -> torch.Tensor:
        """[T, L] in the model's dtype."""
        if self._mask is None:
            self._mask = lora_mask(self.token_slots, self.max_loras, self.dtype)
        return self._mask


class LoRASlots:
    """One projection layer's slots: A_all and B_all, and the step whose mask picks among them."""

    def __init__(self, step: LoRAStep, in_features: int, output_sizes: list[int], max_rank: int):
        self.step, self.output_sizes, self.max_rank = step, output_sizes, max_rank
        self.width = len(output_sizes) * max_rank          # R': one slot's columns
        device, dtype = step.device, step.dtype
        self.a = torch.zeros(step.max_loras * self.width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(sum(output_sizes), step.max_loras * self.width, dtype=dtype, device=device)
        self.joined: torch.Tensor | None = None       # [W; A_all], once join_weight made it

    def join_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """Puts W [out, in] and A_all in one buffer, W's rows first; returns W's rows of it, a view
        the layer keeps as its weight, so that loading or changing W writes into the buffer. A_all
        is a view of it from now on."""
        out_features = weight.shape[0]
        self.joined = torch.cat([weight, self.a])
        self.a = self.joined[out_features:]
        return self.joined[:out_features]

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out += each token's delta (x: the rows the projection read, out: its product); returns out."""
        return self.expand_into(x @ self.a.t(), out)

    def expand(self, joined_product: torch.Tensor) -> torch.Tensor:
        """With a joined weight: the product x [W; A_all]^T -> x W^T plus each token's delta
        (a view of joined_product's first out columns, which take the delta in place)."""
        out_features = self.b.shape[0]
        return self.expand_into(joined_product[:, out_features:], joined_product[:, :out_features])

    def expand_into(self, shrunk: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out += (shrunk * each token's slot mask) B_all^T: the "lora" kernel's one launch, or PyTorch's."""
        num_tokens = out.shape[0]
        if self.step.use_triton:
            from mini_engine.kernels.lora import lora_expand
            return lora_expand(shrunk, self.b, self.step.token_slots[:num_tokens], out, self.width)
        return lora_expand_ref(shrunk, self.b, self.step.mask[:num_tokens], out)

    @torch.no_grad()
    def load(self, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Slot `slot` takes one pair a projection (None: the adapter leaves that projection alone),
        each already this rank's share; the rest of the slot is zeroed."""
        columns = slice(slot * self.width, (slot + 1) * self.width)
        a, b = self.a[columns], self.b[:, columns]
        a.zero_()
        b.zero_()
        row = 0
        for i, (size, pair) in enumerate(zip(self.output_sizes, pairs)):
            if pair is not None:
                pa, pb = pair
                rank = pa.shape[0]
                a[i * self.max_rank:i * self.max_rank + rank].copy_(pa)
                b[row:row + size, i * self.max_rank:i * self.max_rank + rank].copy_(pb)
            row += size

    def clear(self, slot: int) -> None:
        self.load(slot, [None] * len(self.output_sizes))


def lora_delta_ref(x: torch.Tensor, token_slots: list[int], pairs_by_slot: dict[int, tuple[torch.Tensor, torch.Tensor]]
                   ) -> torch.Tensor:
    """The definition, token by token: x_t A^T B^T for the pair of t's slot, zero for slot -1."""
    out = torch.zeros(x.shape[0], next(iter(pairs_by_slot.values()))[1].shape[0], dtype=torch.float64)
    for t, slot in enumerate(token_slots):
        if slot >= 0:
            a, b = pairs_by_slot[slot]
            out[t] = (x[t].double() @ a.double().t()) @ b.double().t()
    return out
