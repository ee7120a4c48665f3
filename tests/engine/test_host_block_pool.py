"""The prefix cache's host tier (kv_offloading_size): the host pool's LRU and pins, and the copies
the block manager schedules: a store for each cached block it evicts, a load for each host hit."""
from mini_engine.engine.block_manager import BlockManager
from mini_engine.engine.host_block_pool import HostBlockPool, HostHit
from tests.engine.test_block_manager import admit, seq


def test_the_least_recently_used_entry_gives_its_slot_and_a_pinned_one_never_does():
    pool = HostBlockPool(2)
    assert pool.store(10, ("k10",)) == 0 and pool.store(11, ("k11",)) == 1
    assert pool.store(10, ("k10",)) is None          # held already: only made the most recent
    assert pool.store(12, ("k12",)) == 1             # 11 was the least recently used
    assert pool.lookup(11, ("k11",)) is None and pool.lookup(12, ("k12",)) == HostHit(1, 12, ("k12",))
    assert pool.lookup(12, ("other",)) is None       # a hash collision: the key differs
    pool.pin(pool.lookup(10, ("k10",)))
    assert pool.store(13, ("k13",)) == 1             # not slot 0: a load of this step reads it
    pool.pin(pool.lookup(13, ("k13",)))
    assert pool.store(14, ("k14",)) is None          # every slot pinned: the block is not kept
    pool.clear()
    assert not pool.entries and not pool.pinned and pool.store(15, ("k15",)) == 0


def evict_all(bm: BlockManager, rid: str = "filler") -> None:
    """Takes every free block (evicting what they cache), then frees them, hash-less."""
    filler = seq([200 + i % 50 for i in range(bm.num_free_blocks * bm.block_size - 1)], rid)
    bm.enable_prefix_caching, caching = False, bm.enable_prefix_caching
    assert bm.allocate_slots(filler, filler.num_tokens)
    bm.enable_prefix_caching = caching
    bm.free(filler)


def offload(bm: BlockManager, tokens) -> list[tuple[int, int]]:
    """Computes a sequence of tokens, frees it and evicts every block: the stores of its full blocks."""
    a = seq(tokens, "offloaded")
    admit(bm, a)
    bm.free(a)
    evict_all(bm)
    return bm.take_kv_transfers()[0]


def test_an_evicted_prefix_is_stored_then_loaded_back_into_new_blocks():
    bm = BlockManager(num_blocks=4, block_size=4, num_host_blocks=8)
    a = seq(range(13), "a")                         # 3 full blocks, hashed
    admit(bm, a)
    blocks, hashes = list(a.block_table), list(a.block_hashes)
    bm.free(a)
    assert bm.take_kv_transfers() == ([], [])
    evict_all(bm)
    stores, loads = bm.take_kv_transfers()
    assert sorted(b for b, _ in stores) == sorted(blocks[:3]) and loads == []
    slots = {b: s for b, s in stores}
    assert not bm.cached_blocks

    b = seq(range(13), "b")
    hits = bm.find_cached_prefix(b)
    assert [type(h) for h in hits] == [HostHit] * 3
    assert [h.slot for h in hits] == [slots[blocks[i]] for i in range(3)]
    admit(bm, b)
    stores, loads = bm.take_kv_transfers()
    assert loads == [(slots[blocks[i]], b.block_table[i]) for i in range(3)]
    # The loaded blocks are the device pool's cached blocks again, under the same hashes.
    assert b.block_hashes == hashes
    assert [bm.cached_blocks[h] for h in b.block_hashes[:3]] == b.block_table[:3]
    # Both lookups asked the host tier (a's found nothing there), and neither found a device block.
    assert bm.host_cache_hit_tokens == 12 and bm.host_cache_queried_tokens == 13 + 13
    assert bm.prefix_cache_hit_tokens == 0 and bm.prefix_cache_queried_tokens == 13 + 13
    bm.free(b)
    assert bm.num_free_blocks == 4


def test_a_chain_mixes_device_blocks_and_host_hits_in_order():
    bm = BlockManager(num_blocks=6, block_size=2, num_host_blocks=8)
    a = seq(range(7), "a")                          # blocks 0-2 hashed
    admit(bm, a)
    first, second, third = a.block_table[:3]
    bm.free(a)
    # Evict the middle block only: take it out of the free list and hand it out.
    bm.free_blocks.remove(bm.blocks[second])
    bm.free_blocks.appendleft(bm.blocks[second])
    other = seq([90, 91, 92], "other")
    bm.enable_prefix_caching = False
    assert bm.allocate_slots(other, 1)
    bm.enable_prefix_caching = True
    assert other.block_table == [second]
    (stored_block, slot), = bm.take_kv_transfers()[0]
    assert stored_block == second
    b = seq(range(7), "b")
    hits = bm.find_cached_prefix(b)
    assert hits[0] == first and hits[1] == HostHit(slot, hits[1].hash, hits[1].key) and hits[2] == third
    admit(bm, b)
    assert b.block_table[0] == first and b.block_table[2] == third
    assert bm.take_kv_transfers() == ([], [(slot, b.block_table[1])])
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1, 1, 1]


def test_a_host_hit_that_does_not_fit_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=4, num_host_blocks=8)
    offload(bm, range(13))
    holder = seq([300 + i for i in range(8)], "holder")
    assert bm.allocate_slots(holder, 8)              # 2 of the 4 blocks held
    b = seq(range(13), "b")
    hits = bm.find_cached_prefix(b)
    assert len(hits) == 3
    assert not bm.allocate_slots(b, 1, hits)         # 4 blocks needed, 2 free
    assert b.block_table == [] and not bm.host.pinned and bm.take_kv_transfers() == ([], [])


def test_a_load_is_never_overwritten_by_a_store_of_its_step():
    bm = BlockManager(num_blocks=2, block_size=2, num_host_blocks=1)
    (_, slot), = offload(bm, range(3))              # one full block
    c = seq([60, 61, 62], "c")                      # a second cached block, on the device
    admit(bm, c)
    bm.free(c)
    b = seq(range(3), "b")
    hits = bm.find_cached_prefix(b)
    assert hits == [HostHit(slot, hits[0].hash, hits[0].key)]
    # b's new blocks evict c's block: its store would take the only slot, which b's load reads.
    admit(bm, b)
    stores, loads = bm.take_kv_transfers()
    assert stores == [] and loads == [(slot, b.block_table[0])]


def test_reset_moves_the_newest_cached_blocks_to_the_host_tier_unless_asked():
    bm = BlockManager(num_blocks=8, block_size=4, num_host_blocks=2)
    a = seq(range(13), "a")
    admit(bm, a)
    blocks = list(a.block_table)
    bm.free(a)                                      # nothing evicted: the pool still caches 3 blocks
    bm.reset_prefix_cache(host_tier=False)
    stores, _ = bm.take_kv_transfers()
    # free() puts a's tail first, so its first two blocks are the newest: the tier's two slots take them.
    assert sorted(b for b, _ in stores) == sorted(blocks[:2]) and not bm.cached_blocks
    assert [type(h) for h in bm.find_cached_prefix(seq(range(13), "b"))] == [HostHit, HostHit]
    bm.reset_prefix_cache()
    assert bm.find_cached_prefix(seq(range(13), "b")) == []


def test_a_preempted_requests_return_is_not_counted():
    """As vLLM's counters: a preempted request's lookups (its own blocks, often) stay out of the rates."""
    bm = BlockManager(num_blocks=8, block_size=4, num_host_blocks=8)
    a = seq(range(13), "a")
    admit(bm, a)
    counts = (bm.prefix_cache_queried_tokens, bm.host_cache_queried_tokens)
    bm.free(a)
    back = seq(range(13), "a")
    back.num_preemptions = 1
    assert len(admit(bm, back)) == 3
    assert (bm.prefix_cache_queried_tokens, bm.host_cache_queried_tokens) == counts == (13, 13)
    assert bm.prefix_cache_hit_tokens == bm.host_cache_hit_tokens == 0


def test_no_host_tier_without_prefix_caching():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False, num_host_blocks=8)
    assert bm.host is None
