"""The KV block pool: allocation, reference counts, and prefix caching.

A full block is identified by a hash chained with its parent's, so equal hashes mean equal
prefixes (the stored key is compared on a hit to rule out collisions). Free blocks sit in LRU
order; a free block keeps its cached contents until it is actually handed out again. With a host
tier (kv_offloading_size, engine/host_block_pool.py) it is then copied there first, and a prefix
the device pool lost is loaded back from there.
"""
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from mini_engine.engine.host_block_pool import HostBlockPool, HostHit
from mini_engine.engine.sequence import PENDING_TOKEN, Sequence


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    key: tuple | None = None        # (parent hash, token ids): what the hash stands for
    # Neighbours in the FreeBlockQueue while the block is free (ref_count 0), else None.
    prev_free: "Block | None" = None
    next_free: "Block | None" = None


class FreeBlockQueue:
    """The free blocks, least recently used first: a doubly linked list threaded through the
    blocks themselves, between two sentinel blocks. Taking the head, adding at either end and
    unlinking a block from the middle (a cached block revived by a prefix hit) are O(1), with no
    container to grow or rehash. (An OrderedDict of block ids did the same in amortised O(1): on
    the H200 its table of ~70,000 ids was rebuilt once its deleted slots ran out, ~17,000 frees
    into the benchmark, and held the step loop for ~4 ms: benchmarks/NOTES.md, entry 36.)"""

    def __init__(self, blocks: list[Block]):
        self.head, self.tail = Block(-1), Block(-1)
        self.head.next_free, self.tail.prev_free = self.tail, self.head
        self.size = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[Block]:
        block = self.head.next_free
        while block is not self.tail:
            yield block
            block = block.next_free

    def _insert(self, block: Block, prev: Block, next_: Block) -> None:
        block.prev_free, block.next_free = prev, next_
        prev.next_free = next_.prev_free = block
        self.size += 1

    def append(self, block: Block) -> None:
        """Most recently used: handed out last."""
        self._insert(block, self.tail.prev_free, self.tail)

    def appendleft(self, block: Block) -> None:
        """Handed out next."""
        self._insert(block, self.head, self.head.next_free)

    def remove(self, block: Block) -> None:
        block.prev_free.next_free, block.next_free.prev_free = block.next_free, block.prev_free
        block.prev_free = block.next_free = None
        self.size -= 1

    def popleft(self) -> Block:
        block = self.head.next_free
        if block is self.tail:
            raise IndexError("no free block")
        self.remove(block)
        return block


def block_key(parent_hash: int | None, token_ids: list[int], extra: str | None = None) -> tuple:
    return (parent_hash, tuple(token_ids)) if extra is None else (parent_hash, tuple(token_ids), extra)


def chained_blocks(token_ids: list[int], block_size: int, start: int, stop: int,
                   parent: int | None = None,
                   extra: Callable[[int], str | None] | None = None) -> Iterator[tuple[int, tuple, int]]:
    """(i, key, hash) of the full blocks start..stop-1 of token_ids, each key holding the hash
    before it (parent: block start-1's; for the first block, the sequence's Sequence.cache_root,
    None for the base model's without a cache salt). extra(i): what else block i's K and V depend
    on (a prompt given as embeddings: its rows' digest, Sequence.block_extra), or None."""
    for i in range(start, stop):
        key = block_key(parent, token_ids[i * block_size:(i + 1) * block_size], extra and extra(i))
        parent = hash(key)
        yield i, key, parent


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 max_blocks_per_seq: int | None = None, num_host_blocks: int = 0):
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq or num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[int, int] = {}     # hash -> block id
        # The prefix cache's device-pool hits, and those of the host tier (vLLM's "external" ones),
        # whose lookups are the tokens the device pool did not hold.
        self.prefix_cache_queried_tokens = 0
        self.prefix_cache_hit_tokens = 0
        self.host_cache_queried_tokens = 0
        self.host_cache_hit_tokens = 0
        self.host = HostBlockPool(num_host_blocks) if num_host_blocks and enable_prefix_caching else None
        # The copies the steps scheduled since the last take_kv_transfers: (device block, host slot)
        # stores of evicted blocks, and (host slot, device block) loads of host hits.
        self.kv_stores: list[tuple[int, int]] = []
        self.kv_loads: list[tuple[int, int]] = []

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def find_cached_prefix(self, seq: Sequence) -> list[int | HostHit]:
        """The longest chain of cached blocks that starts seq's tokens: a device block's id, or
        where only the host tier holds a block, a HostHit. The last token is never served from
        the cache, so that the step computes it and has logits to sample from."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for _, key, h in chained_blocks(seq.token_ids, self.block_size, 0, (seq.num_tokens - 1) // self.block_size,
                                        seq.cache_root, seq.block_extra):
            block_id = self.cached_blocks.get(h)
            if block_id is not None and self.blocks[block_id].key == key:
                hits.append(block_id)
            elif self.host is not None and (hit := self.host.lookup(h, key)) is not None:
                hits.append(hit)
            else:
                break
        return hits

    def prompt_cost(self, token_ids: list[int], shared: set[int], cache_root: int | None = None,
                    extra: Callable[[int], str | None] | None = None) -> int:
        """The tokens a new prompt will take from a step's budget: those past the longest chain of
        its full blocks that the cache holds or that `shared` holds, the hashes of the prompts
        waiting ahead of it, whose blocks are cached as they are admitted (first come, first
        served: before it, or in the same step). Adds its own hashes to shared. cache_root and
        extra: its sequence's (Sequence.cache_root, Sequence.block_extra)."""
        if not self.enable_prefix_caching:
            return len(token_ids)
        bs, covered = self.block_size, 0
        for i, _, h in chained_blocks(token_ids, bs, 0, (len(token_ids) - 1) // bs, cache_root, extra):   # the last is computed
            if covered == i * bs and (h in shared or h in self.cached_blocks
                                      or (self.host is not None and h in self.host.entries)):
                covered += bs
            shared.add(h)
        return len(token_ids) - covered

    def count_prefix_lookup(self, seq: Sequence, cached_prefix: list[int | HostHit]) -> None:
        """The hit-rate counters, for a lookup whose sequence was admitted: a request that waits for
        blocks is looked up again every step, and counting each attempt would make the rate
        depend on the queue. A preempted request's return is not counted either, as vLLM's
        counters leave it out (its own blocks, often still cached, would inflate the rate)."""
        if self.enable_prefix_caching and seq.num_preemptions == 0:
            from_host = sum(isinstance(b, HostHit) for b in cached_prefix) * self.block_size
            on_device = len(cached_prefix) * self.block_size - from_host
            self.prefix_cache_queried_tokens += seq.num_tokens
            self.prefix_cache_hit_tokens += on_device
            if self.host is not None:
                self.host_cache_queried_tokens += seq.num_tokens - on_device
                self.host_cache_hit_tokens += from_host

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached_prefix: list[int | HostHit] = ()) -> bool:
        """Give seq the cached prefix blocks (a host hit's loaded into a new block) and enough new
        blocks to hold num_new_tokens more tokens than it has computed (after the prefix), then
        cache the blocks this step fills. Returns False, changing nothing, when the free pool is
        too short."""
        bs = self.block_size
        total = seq.num_computed_tokens + len(cached_prefix) * bs + num_new_tokens
        num_before = len(seq.block_table)
        if not cached_prefix and self.blocks_for(total) <= num_before:
            # The common decode step: the token fits in the last block. Hash it if it fills it.
            if total // bs > len(seq.block_hashes):
                self.cache_full_blocks(seq, total)
            return True
        on_device = [b for b in cached_prefix if not isinstance(b, HostHit)]
        needed = self.blocks_for(total) - num_before - len(on_device)       # host hits' blocks too
        # Cached blocks that nobody holds are still in the free list: taking them shrinks it.
        revived = sum(1 for b in on_device if self.blocks[b].ref_count == 0)
        if needed > self.num_free_blocks - revived:
            return False
        # All of them before any new block is taken, which could evict one of them.
        for block_id in on_device:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self.free_blocks.remove(block)
            block.ref_count += 1
        for hit in cached_prefix:
            if isinstance(hit, HostHit):
                self.host.pin(hit)          # before the new blocks' evictions store over it
        for entry in cached_prefix:
            if isinstance(entry, HostHit):
                block_id = self.take_free_block()
                self.kv_loads.append((entry.slot, block_id))
                self.cache_block(self.blocks[block_id], entry.hash, entry.key)
                seq.block_hashes.append(entry.hash)
            else:
                block_id = entry
                seq.block_hashes.append(self.blocks[block_id].hash)
            seq.block_table.append(block_id)
        for _ in range(needed - (len(cached_prefix) - len(on_device))):
            seq.block_table.append(self.take_free_block())
        if seq.block_table_array is None:
            seq.block_table_array = np.full(self.max_blocks_per_seq, -1, dtype=np.int32)
        seq.block_table_array[num_before:len(seq.block_table)] = seq.block_table[num_before:]
        self.cache_full_blocks(seq, total)
        return True

    def take_free_block(self) -> int:
        block = self.free_blocks.popleft()                        # least recently used
        if block.hash is not None and self.cached_blocks.get(block.hash) == block.block_id:
            del self.cached_blocks[block.hash]                    # evicted only now, when reused
            if self.host is not None:
                self.offload(block)
        block.hash = block.key = None
        block.ref_count = 1
        return block.block_id

    def offload(self, block: Block) -> None:
        """A store of block's K and V into the host tier, unless it holds them already."""
        if (slot := self.host.store(block.hash, block.key)) is not None:
            self.kv_stores.append((block.block_id, slot))

    def cache_block(self, block: Block, h: int, key: tuple) -> None:
        if h not in self.cached_blocks:
            block.hash, block.key = h, key
            self.cached_blocks[h] = block.block_id

    def take_kv_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The stores and loads scheduled since the last call, which the runner must make before the
        step it launches next (stores first: a store's block may be a load's destination, and a
        load's slot may have been stored this step)."""
        transfers = self.kv_stores, self.kv_loads
        self.kv_stores, self.kv_loads = [], []
        if self.host is not None:
            self.host.pinned.clear()
        return transfers

    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Hash every block of seq that the first num_tokens tokens fill, before the step computes
        them. A sequence admitted later in the same step may then take these blocks as its cached
        prefix; it reads them correctly because every layer writes the step's K and V into the
        cache before its attention reads any (and later steps run after this one on the device)."""
        bs = self.block_size
        # Slots past the known tokens (a step's drafts, which may be rejected) are hashed once the
        # tokens they hold are known, and so is the token still in flight.
        num_tokens = min(num_tokens, seq.num_tokens - (seq.token_ids[-1] == PENDING_TOKEN))
        start = len(seq.block_hashes)
        parent = seq.block_hashes[-1] if start else seq.cache_root
        for i, key, h in chained_blocks(seq.token_ids, bs, start, num_tokens // bs, parent, seq.block_extra):
            seq.block_hashes.append(h)
            if self.enable_prefix_caching:
                self.cache_block(self.blocks[seq.block_table[i]], h, key)

    def forget_uncomputed(self, seq: Sequence) -> None:
        """Uncaches seq's blocks past its computed tokens: hashed when a step was scheduled
        (cache_full_blocks), for a request that ends before that step launches, so their K and V
        will never be written. (Blocks another sequence took as a cached prefix in the same step
        share seq's cache root, its adapter's, and end with it.)"""
        for i in range(seq.num_computed_tokens // self.block_size, len(seq.block_hashes)):
            block = self.blocks[seq.block_table[i]]
            h = seq.block_hashes[i]
            if block.hash == h and self.cached_blocks.get(h) == block.block_id:
                del self.cached_blocks[h]
                block.hash = block.key = None

    def reset_prefix_cache(self, host_tier: bool = True) -> None:
        """Forgets every cached block, and with host_tier those of the host tier too. After a step
        that failed, the blocks it hashed when it was scheduled may never have received their K
        and V, and a later prefix hit would read them (and a host slot whose store was never
        made); new weights make every block stale. Without host_tier, the cached blocks (no
        request holds any) are stored there first, least recently used first, as vLLM's
        connector keeps every block it has seen: take_kv_transfers then has their stores."""
        if self.host is not None and not host_tier:
            cached = [b for b in self.free_blocks if b.hash is not None and self.cached_blocks.get(b.hash) == b.block_id]
            for block in cached[-self.host.num_slots:]:      # what the tier holds of them: the newest
                self.offload(block)
        for block in self.blocks:
            block.hash = block.key = None
        self.cached_blocks.clear()
        if host_tier and self.host is not None:
            self.host.clear()
            self.kv_stores, self.kv_loads = [], []

    def free(self, seq: Sequence) -> None:
        # Tail blocks first, so that a sequence's prefix outlives its suffix in the LRU order.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:                 # holds nothing reusable: hand it out first
                    self.free_blocks.appendleft(block)
                else:
                    self.free_blocks.append(block)
        if seq.block_table_array is not None:
            seq.block_table_array[:len(seq.block_table)] = -1
        seq.block_table.clear()
        seq.block_hashes.clear()
