"""What a request asks of its logits besides temperature, top-k and top-p: its logit_bias, vLLM's
presence, frequency and repetition penalties, which depend on the tokens the sequence holds so
far, and min_p. Plain PyTorch: only requests that ask for them take this path (the benchmark's do not).

A step's rows reach the sampler as the host scheduled them, and with async scheduling the host
does not yet know a decode row's newest token: the step still in flight samples it, and the
device feeds it to this step as the row's input token. So the counts come in two parts: the
tokens the host holds (all but the newest), and the newest, read on the device from the step's
input tokens."""
import math
from dataclasses import dataclass

import numpy as np
import torch

from mini_engine.host_to_device import to_device


@dataclass
class PenaltyTensors:
    """The penalised rows of one step's sampling rows, on the device. A penalty changes only the
    logits of tokens a row has seen, so it is applied to those alone: (row, token) pairs, one for
    each time the token appears (so some twice or more), not over the whole vocabulary."""
    rows: torch.Tensor            # [P] int64: which sampling rows these are
    presence: torch.Tensor        # [P] fp32
    frequency: torch.Tensor       # [P] fp32
    repetition: torch.Tensor      # [P] fp32
    output_counts: torch.Tensor   # [P, V] fp32: how many times each token is in the row's output
    pair_rows: torch.Tensor       # [N] int64, an index into rows: the pairs (row, token) seen in
    pair_tokens: torch.Tensor     # [N] int64  the output, and in the prompt where the row has a
                                  # repetition penalty (the only one that reads the prompt)

    def seen(self) -> torch.Tensor:
        """[P, V] bool: the tokens each row has seen."""
        seen = torch.zeros(self.output_counts.shape, dtype=torch.bool, device=self.output_counts.device)
        seen[self.pair_rows, self.pair_tokens] = True
        return seen


def output_counts_ref(histories: list[list[int]], num_prompt_tokens: list[int],
                      vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(output counts [P, V], seen [P, V]) of whole token histories, newest included, a Python
    loop a token: the oracle of penalty_tensors' counts."""
    counts = torch.zeros(len(histories), vocab_size)
    seen = torch.zeros(len(histories), vocab_size, dtype=torch.bool)
    for row, (history, n) in enumerate(zip(histories, num_prompt_tokens)):
        for position, token in enumerate(history):
            seen[row, token] = True
            if position >= n:
                counts[row, token] += 1
    return counts, seen


def penalty_tensors(rows: list[int], histories: list[np.ndarray], num_prompt_tokens: list[int],
                    params: list, newest_tokens: torch.Tensor, vocab_size: int) -> PenaltyTensors:
    """rows: the penalised sampling rows; histories: each one's tokens before its newest, prompt
    then output (int64 arrays); params: their SamplingParams; newest_tokens: [S] every sampling
    row's newest token, on the device. Only rows with a repetition penalty send their prompt."""
    device = newest_tokens.device
    outputs = [h[n:] for h, n in zip(histories, num_prompt_tokens)]
    prompts = [h[:n] if p.repetition_penalty != 1.0 else h[:0]
               for h, n, p in zip(histories, num_prompt_tokens, params)]
    newest_is_output = [len(h) >= n for h, n in zip(histories, num_prompt_tokens)]
    # One copy for the integers: the rows, whether each newest token is an output's, then the
    # (row, token) pairs of the outputs and of the prompts.
    parts = [np.asarray(rows, dtype=np.int64), np.asarray(newest_is_output, dtype=np.int64)]
    for arrays in (outputs, prompts):
        parts += [np.repeat(np.arange(len(rows)), [len(a) for a in arrays]), np.concatenate(arrays)]
    ints = to_device(torch.from_numpy(np.concatenate(parts)), device)
    rows_d, newest_is_output_d, output_rows, output_tokens, prompt_rows, prompt_tokens = \
        ints.split([len(part) for part in parts])
    values = to_device(torch.tensor([[p.presence_penalty, p.frequency_penalty, p.repetition_penalty] for p in params],
                                    dtype=torch.float32), device)
    newest = newest_tokens[rows_d]
    index = torch.arange(len(rows), device=device)
    counts = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)
    counts.index_put_((output_rows, output_tokens), torch.ones(len(output_tokens), device=device), accumulate=True)
    counts.index_put_((index, newest), newest_is_output_d.float(), accumulate=True)
    presence, frequency, repetition = values.unbind(-1)
    return PenaltyTensors(rows_d, presence, frequency, repetition, counts, torch.cat([output_rows, prompt_rows, index]),
                          torch.cat([output_tokens, prompt_tokens, newest]))


def apply_penalties(logits: torch.Tensor, penalties: PenaltyTensors) -> torch.Tensor:
    """fp32 logits with the penalised rows' penalties applied (a new tensor: the raw logits
    stay, for logprobs). vLLM's formula and order: the repetition penalty first, on the raw
    logit's sign, then frequency x count, then presence. Each pair reads the logit as it was and
    writes it penalised, so where a token appears twice both write the same value."""
    out = logits.float() if logits.dtype != torch.float32 else logits.clone()
    p, rows, tokens = penalties, penalties.rows[penalties.pair_rows], penalties.pair_tokens
    values, counts, repetition = out[rows, tokens], p.output_counts[p.pair_rows, tokens], p.repetition[p.pair_rows]
    values = torch.where(values > 0, values / repetition, values * repetition)
    values = values - p.frequency[p.pair_rows] * counts - p.presence[p.pair_rows] * (counts > 0)
    out[rows, tokens] = values
    return out


def logit_bias_tensors(params: list, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sampling rows, token ids, biases) of every entry of the rows' logit_bias, on the device,
    from the arrays each SamplingParams made of its dict once."""
    arrays = [(row, *p.logit_bias_arrays) for row, p in enumerate(params) if p.logit_bias_arrays is not None]
    rows = np.repeat([row for row, _, _ in arrays], [len(tokens) for _, tokens, _ in arrays])
    ints = to_device(torch.from_numpy(np.stack([rows, np.concatenate([tokens for _, tokens, _ in arrays])])), device)
    return ints[0], ints[1], to_device(torch.from_numpy(np.concatenate([b for _, _, b in arrays])), device)


def apply_logit_bias(logits: torch.Tensor, bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """fp32 logits with each (row, token, bias) added (a new tensor: the raw logits stay, for
    logprobs). First of all, as vLLM applies it: the penalties see the biased logits."""
    out = logits.float() if logits.dtype != torch.float32 else logits.clone()
    rows, tokens, biases = bias
    out[rows, tokens] += biases
    return out


def early_stop_tokens(params: list, num_output_tokens: list[int], eos_token_ids: tuple[int, ...], vocab_size: int,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(sampling rows, token ids) of the tokens that would end each row's output before its
    min_tokens: its stop_token_ids and EOS, even where it ignores EOS (as vLLM's min_tokens, which
    counts EOS among every request's stop tokens for it); None if none."""
    pairs = [(row, token) for row, (p, n) in enumerate(zip(params, num_output_tokens)) if n < p.min_tokens
             for token in sorted(set(p.stop_token_ids) | set(eos_token_ids)) if token < vocab_size]
    if not pairs:
        return None
    ints = to_device(torch.tensor(pairs, dtype=torch.int64).T.contiguous(), device)
    return ints[0], ints[1]


def ban_tokens(logits: torch.Tensor, banned: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """fp32 logits with -inf at each (row, token) of banned (a new tensor, as apply_logit_bias)."""
    out = logits.float() if logits.dtype != torch.float32 else logits.clone()
    out[banned] = float("-inf")
    return out


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """Sets to -inf each logit whose probability at the row's temperature is below min_p times
    its row's largest: softmax(l / T)_i < min_p * max_j softmax(l / T)_j, i.e.
    l_i < max_j l_j + T log(min_p). Greedy rows and rows with min_p 0 are left alone."""
    active = (min_p > 0) & (temperatures > 0)
    log_min_p = torch.where(active, min_p, 1.0).log()
    threshold = logits.amax(-1) + torch.where(active, temperatures * log_min_p, -math.inf)
    return logits.masked_fill(logits < threshold[:, None], float("-inf"))
