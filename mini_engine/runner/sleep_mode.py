"""Sleep mode, vLLM's (LLM(..., enable_sleep_mode=True); sleep(level), wake_up(tags)): the device
memory of the weights and of the KV pool given back between generations, for a trainer that shares
the GPU (RL: generate, train, update the weights, generate again). Level 1 keeps a host copy of the
weights; level 2 keeps nothing, and load_weights must give every weight again.

vLLM keeps the weights' and the KV pool's virtual addresses and unmaps the physical memory behind
them (its CuMemAllocator), so that its CUDA graphs stay valid. Here the memory goes back through the
tensors' storages (storage.resize_(0), as PyTorch's FSDP frees its parameters between uses): every
tensor object stays, the parameters, the pool and each layer's views of it, and waking allocates
each storage again at its size, so nothing that holds a tensor changes. A storage allocated again
may lie elsewhere, though, and a CUDA graph holds raw addresses: the runner drops its graphs when it
sleeps (which frees their memory pool too) and captures them again once the weights and the KV
pool are both awake, as at start-up (ModelRunner.capture_cuda_graphs)."""
from dataclasses import dataclass, field

import torch

# What sleeps and wakes, by vLLM's names.
SLEEP_TAGS = ("weights", "kv_cache")


@dataclass(slots=True)
class ReleasedStorage:
    storage: torch.UntypedStorage
    nbytes: int                            # its size before, to allocate again
    host: torch.Tensor | None = None       # its contents (level 1's weights), else None: zeros on waking


@dataclass
class SleepState:
    # Each sleeping tag's storages, released (empty: awake).
    released: dict[str, list[ReleasedStorage]] = field(default_factory=dict)

    @property
    def sleeping_tags(self) -> set[str]:
        return set(self.released)


def distinct_storages(tensors) -> list[torch.UntypedStorage]:
    """The storages under tensors, each once (a tied lm_head is the embedding's; a LoRA-joined
    projection's weight is a view of the buffer that holds its adapters' A too)."""
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages.setdefault(storage.data_ptr(), storage)
    return list(storages.values())


def release(storages: list[torch.UntypedStorage], keep_contents: bool) -> list[ReleasedStorage]:
    """Gives the storages' memory back (to PyTorch's allocator: the caller empties its cache),
    copying their contents to the host first if keep_contents (pinned, for a fast copy back). All
    are copied before any is released: a host allocation that fails leaves every one as it was."""
    released = []
    for storage in storages:
        host = None
        if keep_contents:
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
            host.untyped_storage().copy_(storage)
        released.append(ReleasedStorage(storage, storage.nbytes(), host))
    for r in released:
        r.storage.resize_(0)
    return released


def restore(released: list[ReleasedStorage]) -> None:
    """Allocates each storage again at its size, with its host copy's contents, or zeros: the KV
    pool must hold no NaN (attention reads whole blocks; ModelRunner.allocate_kv_cache), nor may
    discarded weights until they are loaded again."""
    for r in released:
        r.storage.resize_(r.nbytes)
        if r.host is not None:
            r.storage.copy_(r.host.untyped_storage())
        else:
            r.storage.fill_(0)
