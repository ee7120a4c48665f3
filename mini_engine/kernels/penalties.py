"""vLLM's repetition, frequency and presence penalties, applied to a step's penalised rows from
counts that stay on the device between steps (layers/penalties.py's PenaltyState): row j of the
step's logits is rows[j], and its counts are row state_rows[j] of the state. The reference takes
about a dozen passes over [rows, vocabulary] tensors (gathers, a conversion, masks, `where`s);
the kernel takes one, reading each logit, count and flag once and writing the logit back."""
import torch

from mini_engine.kernels.triton_utils import tl, triton


def apply_penalties_ref(logits: torch.Tensor, rows: torch.Tensor, state_rows: torch.Tensor, presence: torch.Tensor,
                        frequency: torch.Tensor, repetition: torch.Tensor, output_counts: torch.Tensor,
                        prompt_seen: torch.Tensor) -> None:
    """In place on fp32 logits [S, V]. vLLM's formula and order: a token the row has seen (in its
    prompt or its output) has its logit divided by the repetition penalty when positive,
    multiplied when not; then frequency x its output count and presence (once, if counted) are
    subtracted. Unseen tokens pass unchanged (x - 0 - 0)."""
    counts = output_counts[state_rows].float()
    in_output = counts > 0
    seen = prompt_seen[state_rows] | in_output
    x, rep = logits[rows], repetition[:, None]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    logits[rows] = x - frequency[:, None] * counts - presence[:, None] * in_output


@triton.jit
def _apply_penalties_kernel(logits_ptr, rows_ptr, state_rows_ptr, presence_ptr, frequency_ptr, repetition_ptr,
                            counts_ptr, seen_ptr, vocab_size, stride_logits, stride_state, BLOCK_V: tl.constexpr):
    """Program (j, block) penalises columns [block * BLOCK_V, (block + 1) * BLOCK_V) of row rows[j]."""
    j = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    inside = cols < vocab_size
    row = tl.load(rows_ptr + j)
    state = tl.load(state_rows_ptr + j)
    presence = tl.load(presence_ptr + j)
    frequency = tl.load(frequency_ptr + j)
    repetition = tl.load(repetition_ptr + j)
    logits_row = logits_ptr + row * stride_logits
    x = tl.load(logits_row + cols, mask=inside)
    count = tl.load(counts_ptr + state * stride_state + cols, mask=inside, other=0).to(tl.float32)
    in_output = count > 0
    seen = (tl.load(seen_ptr + state * stride_state + cols, mask=inside, other=0) != 0) | in_output
    # div_rn: IEEE division, as the reference's (Triton's `/` on fp32 is the approximate one).
    x = tl.where(seen, tl.where(x > 0, tl.math.div_rn(x, repetition), x * repetition), x)
    x = x - frequency * count - presence * in_output.to(tl.float32)
    tl.store(logits_row + cols, x, mask=inside)


_BLOCK_V = 2048


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, state_rows: torch.Tensor, presence: torch.Tensor,
                    frequency: torch.Tensor, repetition: torch.Tensor, output_counts: torch.Tensor,
                    prompt_seen: torch.Tensor) -> None:
    """apply_penalties_ref in one launch: logits fp32 with unit column stride, counts int32 and
    prompt_seen bool, both [state rows, V] contiguous."""
    num_rows, vocab_size = rows.shape[0], logits.shape[1]
    if num_rows == 0:
        return
    grid = (num_rows, triton.cdiv(vocab_size, _BLOCK_V))
    _apply_penalties_kernel[grid](logits, rows, state_rows, presence, frequency, repetition, output_counts,
                                  prompt_seen.view(torch.uint8), vocab_size, logits.stride(0),
                                  output_counts.stride(0), BLOCK_V=_BLOCK_V)
