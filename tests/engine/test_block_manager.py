from mini_engine.engine.block_manager import BlockManager
from mini_engine.engine.sequence import Sequence
from mini_engine.sampling_params import SamplingParams


def seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=4))


def admit(bm: BlockManager, s: Sequence):
    """What the scheduler does for a waiting sequence: prefix lookup, then allocation."""
    cached = bm.find_cached_prefix(s)
    n = s.num_tokens - len(cached) * bm.block_size
    assert bm.allocate_slots(s, n, cached)
    s.num_computed_tokens = s.num_tokens
    return cached


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(range(10))
    admit(bm, s)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    bm.free(s)
    assert bm.num_free_blocks == 8 and s.block_table == []


def test_prefix_hit_shares_blocks_and_counts_references():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = seq(range(12), "a"), seq(list(range(8)) + [50, 51, 52], "b")
    admit(bm, a)
    cached = admit(bm, b)
    assert cached == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table[:2]] == [1, 1]
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_last_token_is_never_served_from_cache():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(8), "a")
    admit(bm, a)
    bm.free(a)
    again = seq(range(8), "b")
    # Both blocks are cached, but serving the second would leave no token to compute.
    assert len(bm.find_cached_prefix(again)) == 1


def test_collision_is_rejected_by_comparing_tokens():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = seq([1, 2, 3], "a")
    admit(bm, a)
    block = bm.blocks[a.block_table[0]]
    block.key = (None, (9, 9))           # as if another prefix had hashed to the same value
    assert bm.find_cached_prefix(seq([1, 2, 3], "b")) == []


def test_free_cached_blocks_are_evicted_lru_only_when_needed():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3, 4, 5], "a")        # 3 blocks, 2 of them full and cached
    admit(bm, a)
    bm.free(a)
    assert len(bm.cached_blocks) == 2 and bm.num_free_blocks == 4
    b = seq([7, 8, 9], "b")              # 2 blocks: a's uncached tail and the never-used block
    admit(bm, b)
    assert {bm.blocks[i].key for i in bm.cached_blocks.values()} >= {(None, (1, 2))}
    assert len(bm.cached_blocks) == 3    # nothing evicted, and b's full block added
    bm.free(b)
    c = seq([20, 21, 22, 23, 24], "c")   # 3 blocks: the pool is short, so cached ones go, LRU first
    admit(bm, c)
    # a's blocks were freed before b's, so they went first; b's cached block survives.
    assert len(bm.find_cached_prefix(seq([1, 2, 3], "d"))) == 0
    assert len(bm.find_cached_prefix(seq([7, 8, 9], "e"))) == 1


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    admit(bm, seq([1, 2, 3, 4, 5], "a"))
    assert bm.find_cached_prefix(seq([1, 2, 3, 4, 5], "b")) == [] and not bm.cached_blocks


def test_allocation_that_does_not_fit_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3, 4, 5], "a")
    admit(bm, a)                          # 3 of 4 blocks
    b = seq([1, 2, 9, 9, 9], "b")         # a's first block is shared, but 2 more are needed
    cached = bm.find_cached_prefix(b)
    assert cached == a.block_table[:1]
    assert not bm.allocate_slots(b, b.num_tokens - 2, cached)
    assert b.block_table == [] and bm.num_free_blocks == 1 and bm.blocks[cached[0]].ref_count == 1


def test_a_decode_token_that_fills_a_block_caches_it():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3], "a")
    admit(bm, a)
    a.token_ids.append(4)                 # sampled; computed in the next step
    assert bm.allocate_slots(a, 1)        # no new block: the token fits in the second one
    assert len(a.block_table) == 2 and len(a.block_hashes) == 2
    assert len(bm.find_cached_prefix(seq([1, 2, 3, 4, 7], "b"))) == 2
