"""Input tokens that the previous step sampled. With async scheduling the host builds step n+1
before step n's tokens reach it: such a token is a placeholder on the host, and step n+1 takes
its value on the device, from the buffer step n's sampler wrote. Inside a decode step's CUDA graph
this is the graph's first kernel, so one launch a step; the reference takes four."""
import torch

from mini_engine.kernels.triton_utils import tl, triton


def take_prev_tokens_ref(input_ids: torch.Tensor, prev_index: torch.Tensor, prev_tokens: torch.Tensor) -> None:
    """In place: input_ids[i] = prev_tokens[prev_index[i]] where prev_index[i] >= 0, else unchanged."""
    taken = prev_tokens[prev_index.clamp(min=0)]
    torch.where(prev_index >= 0, taken, input_ids, out=input_ids)


@triton.jit
def _take_prev_tokens_kernel(input_ids_ptr, prev_index_ptr, prev_tokens_ptr, num_tokens, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    index = tl.load(prev_index_ptr + offsets, mask=offsets < num_tokens, other=-1)
    taken = index >= 0
    token = tl.load(prev_tokens_ptr + index, mask=taken)
    tl.store(input_ids_ptr + offsets, token, mask=taken)


_BLOCK = 1024


def take_prev_tokens(input_ids: torch.Tensor, prev_index: torch.Tensor, prev_tokens: torch.Tensor) -> None:
    """take_prev_tokens_ref in one launch: input_ids, prev_index and prev_tokens int64, contiguous."""
    num_tokens = input_ids.shape[0]
    if num_tokens:
        _take_prev_tokens_kernel[(triton.cdiv(num_tokens, _BLOCK),)](input_ids, prev_index, prev_tokens, num_tokens,
                                                                    BLOCK=_BLOCK)
