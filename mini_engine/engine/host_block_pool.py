"""The prefix cache's second tier in host memory (vLLM's native KV offloading, `kv_offloading_size`).

A full block that the device pool evicts (hands out again while it still holds a cached prefix)
is first copied to a slot here, under its hash; a prefix lookup that misses on the device but
finds the hash here loads the slot back into a fresh device block instead of computing it again.
Only the bookkeeping lives here: the block manager decides the copies, and the runner makes them
(ModelRunner.move_kv), before the step that reads or overwrites the blocks.
"""
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class HostEntry:
    slot: int
    key: tuple          # (parent hash, token ids[, extra]): compared on a hit, as the device pool's


@dataclass(slots=True)
class HostHit:
    """A block of a cached prefix that only the host tier holds: a fresh device block takes its
    slot's K and V, and its hash and key."""
    slot: int
    hash: int
    key: tuple


class HostBlockPool:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.entries: OrderedDict[int, HostEntry] = OrderedDict()   # by hash, least recently used first
        self.free_slots = list(range(num_slots - 1, -1, -1))
        # Slots that a load of this step reads: no store of the same step may overwrite them
        # (a step's stores are copied before its loads). Cleared once the step's copies are made.
        self.pinned: set[int] = set()

    def lookup(self, h: int, key: tuple) -> HostHit | None:
        entry = self.entries.get(h)
        return None if entry is None or entry.key != key else HostHit(entry.slot, h, key)

    def pin(self, hit: HostHit) -> None:
        """A load of hit's slot is decided: it becomes the most recently used, and stays until the
        step's copies are made."""
        self.entries.move_to_end(hit.hash)
        self.pinned.add(hit.slot)

    def store(self, h: int, key: tuple) -> int | None:
        """The slot that block h's K and V go to, taken from the least recently used entry when
        none is free; None when the tier holds h already, or every slot is pinned."""
        if h in self.entries:
            self.entries.move_to_end(h)
            return None
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            victim = next((v for v, e in self.entries.items() if e.slot not in self.pinned), None)
            if victim is None:
                return None
            slot = self.entries.pop(victim).slot
        self.entries[h] = HostEntry(slot, key)
        return slot

    def clear(self) -> None:
        self.entries.clear()
        self.free_slots = list(range(self.num_slots - 1, -1, -1))
        self.pinned.clear()
