"""Token sampling: argmax at temperature 0, otherwise the exponential race.

argmax_i p_i / E_i with E_i ~ Exp(1) draws i with probability p_i (the smallest of independent
exponentials E_i / p_i is the one with index i with probability p_i / sum p). It needs no
cumulative sum and no host synchronisation, and since p = softmax(l / T), it equals
argmax_i (l_i / T - log E_i): the softmax's normaliser never has to be computed.
"""
import torch


def exponential_noise_ref(num_rows: int, vocab_size: int, seeds: list[int | None],
                          device: torch.device) -> torch.Tensor:
    """Exp(1) noise, [num_rows, vocab_size]. A row with a seed draws from its own generator, so its
    sample depends on nothing but its logits and its seed; the others share the global generator."""
    noise = torch.empty(num_rows, vocab_size, device=device, dtype=torch.float32).exponential_()
    for row, seed in enumerate(seeds):
        if seed is not None:
            gen = torch.Generator(device=device).manual_seed(seed)
            noise[row].exponential_(generator=gen)
    return noise


def apply_top_k_top_p_ref(logits: torch.Tensor, top_k: torch.Tensor | None,
                          top_p: torch.Tensor | None) -> torch.Tensor:
    """Sets to -inf every logit outside each row's top-k and nucleus (top-p) sets.
    top_k <= 0 and top_p >= 1 leave a row unrestricted."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k <= 0, vocab, top_k).clamp(max=vocab)
        remove |= torch.arange(vocab, device=logits.device)[None, :] >= k[:, None]
    if top_p is not None:
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        remove |= mass_before >= top_p[:, None]     # the top token always survives: its mass_before is 0
    mask = torch.zeros_like(remove).scatter_(-1, sorted_idx, remove)
    return logits.masked_fill(mask, float("-inf"))


def sample_ref(logits: torch.Tensor, temperatures: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """logits [B, V] fp32 (already restricted by top-k/top-p), temperatures [B], noise Exp(1) [B, V]."""
    greedy = logits.argmax(-1)
    safe_t = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
    probs = (logits / safe_t[:, None]).softmax(-1)
    raced = (probs / noise).argmax(-1)
    return torch.where(temperatures > 0, raced, greedy)
