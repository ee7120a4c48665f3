"""Tensor parallelism, Megatron-LM's split as vLLM and nano-vllm make it: with
tensor_parallel_size N, N processes (one a GPU) each hold 1/N of every layer: a share of the
attention heads and their KV cache, of the MLP's columns and of the vocabulary's rows.

Each layer's two row-parallel products (o_proj, down_proj) leave every rank a partial sum of the
residual stream's update, which one all-reduce adds up; the embedding's rows are summed the same
way, and the logits' shares gathered, so every rank samples the same tokens from the same logits.
Rank 0 is the engine's own process: it schedules, and sends each step's rows to the other ranks
(runner/tensor_parallel_workers.py), which run the same step on their shares."""
import datetime
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This process's place among the ranks."""
    rank: int = 0
    size: int = 1

    def shard(self, total: int) -> int:
        """This rank's share of `total` heads, columns or rows, rounded up: heads and columns
        divide (EngineConfig checks), and a vocabulary that does not is padded (layers/embed_head.py)."""
        return -(-total // self.size)


def check_divisible(sizes: dict[str, int], tensor_parallel_size: int) -> None:
    """The heads and the MLP's columns must divide evenly: no rank holds a ragged share of them
    (a vocabulary the ranks do not divide is padded instead: layers/embed_head.py)."""
    for name, size in sizes.items():
        if size % tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} must divide the model's {name} ({size})")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_no_process_group() -> None:
    """A process holds one process group: one tensor-parallel engine at a time."""
    if dist.is_initialized():
        raise RuntimeError("this process already holds a tensor-parallel engine: shut it down first "
                           "(LLM.shutdown())")


def init_process_group(tp: TensorParallel, port: int, device: torch.device) -> None:
    """Joins the N ranks (blocks until all have): NCCL between GPUs, gloo between CPU processes."""
    # A rank that never comes (it failed to start) or a collective that never ends is an error after
    # the timeout, not a hang: no step of this engine waits on the other ranks for that long.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=tp.rank, world_size=tp.size, timeout=datetime.timedelta(minutes=5),
                            device_id=device if device.type == "cuda" else None)


def leave_process_group() -> None:
    dist.destroy_process_group()


def abandon_process_group() -> None:
    """Leaves the group alone, the other ranks being gone (a failed start): NCCL's communicators are
    aborted, since destroying them would wait for the others."""
    if dist.get_backend() == "nccl" and hasattr(dist.distributed_c10d, "_abort_process_group"):
        dist.distributed_c10d._abort_process_group()
    else:
        dist.destroy_process_group()


def all_reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The sum over ranks, in place."""
    if tp.size > 1:
        dist.all_reduce(x)
    return x


def all_gather_columns(x: torch.Tensor, tp: TensorParallel, out: torch.Tensor | None = None) -> torch.Tensor:
    """[T, C] on each rank -> [T, N*C], rank 0's columns first."""
    if tp.size == 1:
        return x if out is None else out.copy_(x)
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=1, out=out)


def min_over_ranks(value: int, tp: TensorParallel, device: torch.device) -> int:
    if tp.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
