"""What a request asks of its logits besides temperature, top-k and top-p: its logit_bias, vLLM's
presence, frequency and repetition penalties, which depend on the tokens the sequence holds so
far, and min_p. Only requests that ask for them take this path (the benchmark's do not).

The penalties read counts that live on the device across steps (PenaltyState), as vLLM's model
runner keeps them: the scheduler gives each running penalised request a row of them
(Sequence.penalty_row), filled from its tokens once, at the first step it samples in that row,
and each step adds the tokens it sampled. So a step's penalty work is per row, not per token of
history. The fill has one subtlety: with async scheduling the host does not yet know a decode
row's newest token (the step still in flight samples it, and the device feeds it to this step as
the row's input token), so the host sends the tokens before the newest, and the newest is read on
the device from the step's input tokens."""
import math
from dataclasses import dataclass

import numpy as np
import torch

from mini_engine.host_to_device import to_device
from mini_engine.kernels.penalties import apply_penalties as apply_penalties_triton
from mini_engine.kernels.penalties import apply_penalties_ref


@dataclass
class PenaltyState:
    """Per-request penalty counts on the device, a row for each request the scheduler may run
    at once (max_num_seqs rows: 194 MB for Qwen3's 151,936 tokens at 256, allocated before the KV
    pool is sized). A row belongs to one running request from its admission to its preemption or
    end; everything here is queued on the one stream, so a step still in flight that writes a
    released row does so before the next owner's fill clears it."""
    output_counts: torch.Tensor    # [R, V] int32: how many times each token is in the request's output
    prompt_seen: torch.Tensor      # [R, V] bool: the tokens of its prompt (the repetition penalty's)

    @classmethod
    def allocate(cls, num_rows: int, vocab_size: int, device: torch.device) -> "PenaltyState":
        return cls(torch.zeros(num_rows, vocab_size, dtype=torch.int32, device=device),
                   torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=device))

    def fill(self, state_rows: list[int], histories: list[np.ndarray], num_prompt_tokens: list[int],
             newest_tokens: torch.Tensor) -> None:
        """Sets state_rows[j] to the counts of histories[j] (a request's tokens before its
        newest, prompt then output, int64) and of newest_tokens[j], its newest token, on the
        device: an output token where the history already holds the whole prompt."""
        device = self.output_counts.device
        outputs = [h[n:] for h, n in zip(histories, num_prompt_tokens)]
        prompts = [h[:n] for h, n in zip(histories, num_prompt_tokens)]
        newest_is_output = [len(h) >= n for h, n in zip(histories, num_prompt_tokens)]
        # One copy for the integers: the rows, whether each newest token is an output's, then the
        # (row, token) pairs of the outputs and of the prompts.
        parts = [np.asarray(state_rows, dtype=np.int64), np.asarray(newest_is_output, dtype=np.int64)]
        for arrays in (outputs, prompts):
            parts += [np.repeat(np.asarray(state_rows, dtype=np.int64), [len(a) for a in arrays]),
                      np.concatenate(arrays).astype(np.int64)]
        ints = to_device(torch.from_numpy(np.concatenate(parts)), device)
        rows, newest_is_output_d, output_rows, output_tokens, prompt_rows, prompt_tokens = \
            ints.split([len(part) for part in parts])
        # Fills take their value as a number: `t[index] = 0` copies the 0 to the device from
        # pageable memory, and such a copy waits for everything queued (86 ms behind a mixed step).
        self.output_counts.index_fill_(0, rows, 0)
        self.prompt_seen.index_fill_(0, rows, False)
        self.output_counts.index_put_((output_rows, output_tokens), torch.ones_like(output_tokens, dtype=torch.int32),
                                      accumulate=True)
        self.prompt_seen.view(-1).index_fill_(0, prompt_rows * self.prompt_seen.shape[1] + prompt_tokens, True)
        self.output_counts[rows, newest_tokens] += newest_is_output_d.int()
        self.prompt_seen[rows, newest_tokens] |= newest_is_output_d == 0

    def record(self, state_rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Counts the tokens a step sampled (tokens[j] for state row state_rows[j]) as output."""
        self.output_counts[state_rows, tokens] += 1


def output_counts_ref(histories: list[list[int]], num_prompt_tokens: list[int],
                      vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(output counts [P, V], prompt tokens [P, V]) of whole token histories, newest included, a
    Python loop a token: the oracle of PenaltyState's rows."""
    counts = torch.zeros(len(histories), vocab_size, dtype=torch.int32)
    prompt = torch.zeros(len(histories), vocab_size, dtype=torch.bool)
    for row, (history, n) in enumerate(zip(histories, num_prompt_tokens)):
        for position, token in enumerate(history):
            if position >= n:
                counts[row, token] += 1
            else:
                prompt[row, token] = True
    return counts, prompt


@dataclass
class PenaltyTensors:
    """The penalised rows of one step's sampling rows, on the device, and where their counts are."""
    rows: torch.Tensor            # [P] int64: which sampling rows these are
    state_rows: torch.Tensor      # [P] int64: each one's row of state
    presence: torch.Tensor        # [P] fp32
    frequency: torch.Tensor       # [P] fp32
    repetition: torch.Tensor      # [P] fp32
    state: PenaltyState

    def record(self, tokens: torch.Tensor) -> None:
        """After sampling: counts each penalised row's token (tokens: [S], every sampling row's)."""
        self.state.record(self.state_rows, tokens[self.rows])


def penalty_tensors(rows: list[int], state_rows: list[int], params: list, state: PenaltyState) -> PenaltyTensors:
    """rows: the penalised sampling rows; state_rows: each one's row of state; params: their
    SamplingParams."""
    device, n = state.output_counts.device, len(rows)
    # Each array starts on a 16-byte boundary, whatever n: Triton specialises the kernel on its
    # pointers' alignment, and a view at an odd offset compiled a second variant mid-run.
    width = -(-n // 4) * 4
    ints = torch.zeros(2, width, dtype=torch.int64)
    ints[0, :n], ints[1, :n] = torch.tensor(rows), torch.tensor(state_rows)
    values = torch.zeros(3, width, dtype=torch.float32)
    values[:, :n] = torch.tensor([[p.presence_penalty, p.frequency_penalty, p.repetition_penalty] for p in params]).T
    ints, values = to_device(ints, device)[:, :n], to_device(values, device)[:, :n]
    return PenaltyTensors(ints[0], ints[1], *values, state)


def apply_penalties(logits: torch.Tensor, penalties: PenaltyTensors, use_triton: bool = False) -> None:
    """In place on fp32 logits [S, V]: each penalised row's penalties, from its counts
    (kernels/penalties.py: vLLM's formula and order)."""
    p = penalties
    apply = apply_penalties_triton if use_triton else apply_penalties_ref
    apply(logits, p.rows, p.state_rows, p.presence, p.frequency, p.repetition, p.state.output_counts,
          p.state.prompt_seen)


def allowed_token_tensors(params: list, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the restricted sampling rows, and the (row, token) pairs they allow), on the device."""
    arrays = [(row, p.allowed_token_ids_array) for row, p in enumerate(params) if p.allowed_token_ids_array is not None]
    rows = np.array([row for row, _ in arrays], dtype=np.int64)
    pair_rows = np.repeat(rows, [len(tokens) for _, tokens in arrays])
    ints = to_device(torch.from_numpy(np.concatenate([rows, pair_rows, *(tokens for _, tokens in arrays)])), device)
    return ints.split([len(rows), len(pair_rows), len(pair_rows)])


def keep_allowed_tokens(logits: torch.Tensor, allowed: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """In place on fp32 logits: -inf in the restricted rows except at their allowed tokens."""
    rows, pair_rows, tokens = allowed
    kept = logits[pair_rows, tokens]
    logits.index_fill_(0, rows, float("-inf"))        # a number, not a tensor the host copies (see fill)
    logits[pair_rows, tokens] = kept


def grammar_bitmask_tensors(rows: list, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the sampling rows with a grammar, and their bitmasks stacked [R, words] int32), on the device."""
    masked = [i for i, row in enumerate(rows) if row.grammar_bitmask is not None]
    bitmasks = torch.stack([rows[i].grammar_bitmask for i in masked])
    return to_device(torch.tensor(masked, dtype=torch.int64), device), to_device(bitmasks, device)


def apply_grammar_bitmask(logits: torch.Tensor, grammar: tuple[torch.Tensor, torch.Tensor]) -> None:
    """In place on fp32 logits: -inf in the grammar rows at every token their bitmask leaves out
    (bit t % 32 of word t // 32 of a row is token t's; the words' padding past the vocabulary is
    dropped)."""
    rows, bitmasks = grammar
    shifts = torch.arange(32, device=bitmasks.device, dtype=torch.int32)
    allowed = ((bitmasks.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, :logits.shape[1]].bool()
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def logit_bias_tensors(params: list, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sampling rows, token ids, biases) of every entry of the rows' logit_bias, on the device,
    from the arrays each SamplingParams made of its dict once."""
    arrays = [(row, *p.logit_bias_arrays) for row, p in enumerate(params) if p.logit_bias_arrays is not None]
    rows = np.repeat([row for row, _, _ in arrays], [len(tokens) for _, tokens, _ in arrays])
    ints = to_device(torch.from_numpy(np.stack([rows, np.concatenate([tokens for _, tokens, _ in arrays])])), device)
    return ints[0], ints[1], to_device(torch.from_numpy(np.concatenate([b for _, _, b in arrays])), device)


def apply_logit_bias(logits: torch.Tensor, bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """In place on fp32 logits: each (row, token, bias) added (a row's tokens are distinct). First
    of all, as vLLM applies it: the penalties see the biased logits."""
    rows, tokens, biases = bias
    logits[rows, tokens] += biases


def banned_token_tensors(rows: list, eos_token_ids: tuple[int, ...], vocab_size: int,
                         device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(sampling rows, token ids) of the tokens each row may not sample now: those that would end
    its output before its min_tokens (its stop_token_ids and EOS, even where it ignores EOS, as
    vLLM's min_tokens, which counts EOS among every request's stop tokens for it), and those that
    would complete a bad word (BatchRow.banned_tokens); None if none."""
    pairs = [(i, token) for i, row in enumerate(rows) if row.num_output_tokens < row.params.min_tokens
             for token in sorted(set(row.params.stop_token_ids) | set(eos_token_ids)) if token < vocab_size]
    pairs += [(i, token) for i, row in enumerate(rows) for token in row.banned_tokens or () if token < vocab_size]
    if not pairs:
        return None
    ints = to_device(torch.tensor(pairs, dtype=torch.int64).T.contiguous(), device)
    return ints[0], ints[1]


def ban_tokens(logits: torch.Tensor, banned: tuple[torch.Tensor, torch.Tensor]) -> None:
    """In place on contiguous fp32 logits: -inf at each (row, token) of banned."""
    rows, tokens = banned
    logits.view(-1).index_fill_(0, rows * logits.shape[1] + tokens, float("-inf"))     # as in fill


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor, temperatures: torch.Tensor) -> None:
    """In place: sets to -inf each logit whose probability at the row's temperature is below min_p times
    its row's largest: softmax(l / T)_i < min_p * max_j softmax(l / T)_j, i.e.
    l_i < max_j l_j + T log(min_p). Greedy rows and rows with min_p 0 are left alone."""
    active = (min_p > 0) & (temperatures > 0)
    log_min_p = torch.where(active, min_p, 1.0).log()
    threshold = logits.amax(-1) + torch.where(active, temperatures * log_min_p, -math.inf)
    logits.masked_fill_(logits < threshold[:, None], float("-inf"))
