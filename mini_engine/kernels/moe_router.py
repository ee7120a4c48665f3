"""A Qwen3-MoE layer's router (transformers' Qwen3MoeTopKRouter): each token's logits over the E
experts, their softmax, the k likeliest and their renormalised weights, in one launch.

One launch instead of six (the product, softmax, top-k, the sum, the division, the cast). A
token's experts do not depend on the batch around it by construction: a program takes 16 tokens
and walks the hidden dimension in a fixed order, whatever the number of rows. (It was written
because a CUDA graph's run and an eager run picked other experts for a token; cuBLAS's router
product turned out to give every row the same bits at 5-256 rows on the H200 too, and the
difference was elsewhere: decode attention's splits, benchmarks/NOTES.md, entry 55.)"""
import torch
import torch.nn.functional as F


def route_ref(hidden: torch.Tensor, router_weight: torch.Tensor, top_k: int, renormalize: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [T, H], router_weight [E, H] -> (weights [T, k] in hidden's dtype, expert ids [T, k]):
    the logits in the model's dtype, softmax in fp32, the k likeliest, renormalised to sum to 1
    when asked (norm_topk_prob), then rounded to the model's dtype, in transformers' order."""
    probs = torch.softmax(F.linear(hidden, router_weight), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(hidden.dtype), ids


# ---- Triton ----

from mini_engine.kernels.triton_utils import pdl_enter, pdl_options, tl, triton  # noqa: E402


@triton.jit
def _router_kernel(x_ptr, w_ptr, weights_ptr, ids_ptr, num_tokens, hidden_size, stride_x,
                   NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_TOP: tl.constexpr,
                   RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT_IN_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    """Program: BLOCK_T tokens. logits = x W^T accumulated in fp32 and rounded to the model's dtype
    (as transformers' bf16 product leaves them); softmax; then TOP_K rounds of taking each row's
    largest probability (the lowest expert id among equals) and masking it out."""
    pdl_enter(USE_PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_tokens
    experts = tl.arange(0, BLOCK_E)
    expert_ok = experts < NUM_EXPERTS
    acc = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    for k in range(0, hidden_size, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        col_ok = cols < hidden_size
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :],
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        w = tl.load(w_ptr + experts[:, None] * hidden_size + cols[None, :],
                    mask=expert_ok[:, None] & col_ok[None, :], other=0.0)
        if DOT_IN_FP32:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=INPUT_PRECISION)
    logits = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    logits = tl.where(expert_ok[None, :], logits, float("-inf"))
    probs = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = probs / tl.sum(probs, axis=1)[:, None]
    probs = tl.where(expert_ok[None, :], probs, -1.0)
    slots = tl.arange(0, BLOCK_TOP)
    top = tl.zeros([BLOCK_T, BLOCK_TOP], tl.float32)
    top_ids = tl.zeros([BLOCK_T, BLOCK_TOP], tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(probs, axis=1)
        # Clamped: a row of NaN (a CUDA graph's padding row may hold anything) matches no expert,
        # and its ids must still index the experts' weights.
        best_id = tl.minimum(tl.min(tl.where(probs == best[:, None], experts[None, :], BLOCK_E), axis=1),
                             NUM_EXPERTS - 1)
        top = tl.where(slots[None, :] == i, best[:, None], top)
        top_ids = tl.where(slots[None, :] == i, best_id[:, None], top_ids)
        probs = tl.where(experts[None, :] == best_id[:, None], -1.0, probs)
    if RENORMALIZE:
        top = top / tl.sum(top, axis=1)[:, None]
    out = rows.to(tl.int64)[:, None] * TOP_K + slots[None, :]
    mask = row_ok[:, None] & (slots[None, :] < TOP_K)
    tl.store(weights_ptr + out, top.to(weights_ptr.dtype.element_ty), mask=mask)
    tl.store(ids_ptr + out, top_ids, mask=mask)


def route(hidden: torch.Tensor, router_weight: torch.Tensor, top_k: int, renormalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """route_ref's result (ids as int32), from one launch whose rows do not depend on each other."""
    assert hidden.stride(-1) == 1 and router_weight.is_contiguous()
    num_tokens, hidden_size = hidden.shape
    num_experts = router_weight.shape[0]
    weights = torch.empty(num_tokens, top_k, dtype=hidden.dtype, device=hidden.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=hidden.device)
    if num_tokens:
        block_t = 16
        # fp32 tiles of the same width need twice the shared memory: halve their K step.
        block_k = 64 * 2 // hidden.element_size()
        _router_kernel[(triton.cdiv(num_tokens, block_t),)](
            hidden, router_weight, weights, ids, num_tokens, hidden_size, hidden.stride(0),
            NUM_EXPERTS=num_experts, BLOCK_E=max(16, triton.next_power_of_2(num_experts)), TOP_K=top_k,
            BLOCK_TOP=triton.next_power_of_2(top_k), RENORMALIZE=renormalize, BLOCK_T=block_t,
            BLOCK_K=max(16, block_k), DOT_IN_FP32=hidden.device.type == "cpu",
            INPUT_PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32", num_warps=4,
            **pdl_options(hidden.device))
    return weights, ids
