import pytest

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
    bm.count_prefix_lookup(s, cached)
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


def test_free_block_queue_order():
    """popleft takes the least recently freed block; appendleft puts a block next in line;
    remove unlinks one from the middle; iteration and len follow the links."""
    from mini_engine.engine.block_manager import Block, FreeBlockQueue
    blocks = [Block(i) for i in range(5)]
    queue = FreeBlockQueue(blocks[:3])
    assert [b.block_id for b in queue] == [0, 1, 2] and len(queue) == 3
    queue.remove(blocks[1])
    assert blocks[1].prev_free is None and blocks[1].next_free is None
    queue.append(blocks[3])
    queue.appendleft(blocks[4])
    assert [b.block_id for b in queue] == [4, 0, 2, 3] and len(queue) == 4
    assert [queue.popleft().block_id for _ in range(4)] == [4, 0, 2, 3] and len(queue) == 0
    with pytest.raises(IndexError):
        queue.popleft()


def test_freed_blocks_queue_uncached_first_then_tail_first():
    """A freed sequence's blocks that hold no cached prefix go to the front of the queue (handed
    out next); its cached blocks go to the back, tail before prefix, so a prefix outlives its
    suffix."""
    bm = BlockManager(num_blocks=6, block_size=2)
    a = seq([1, 2, 3, 4, 5], "a")        # blocks: [1, 2] and [3, 4] cached, [5] not
    admit(bm, a)
    first, second, third = a.block_table
    bm.free(a)
    order = [b.block_id for b in bm.free_blocks]
    assert order[0] == third and order[-2:] == [second, first]


def test_free_queue_holds_exactly_the_unreferenced_blocks():
    """Across admissions with prefix hits (which revive cached free blocks out of the queue's
    middle), decode steps and frees in random order, the queue holds every block with no
    reference and no other, each once, its links consistent."""
    import random
    rng = random.Random(0)
    bm = BlockManager(num_blocks=40, block_size=2)
    prefixes = [[rng.randrange(5) for _ in range(6)] for _ in range(3)]
    live = []
    for step in range(300):
        if live and (rng.random() < 0.4 or bm.num_free_blocks < 8):
            bm.free(live.pop(rng.randrange(len(live))))
        elif rng.random() < 0.5 and live:
            s = rng.choice(live)
            s.token_ids.append(rng.randrange(5))
            if bm.allocate_slots(s, 1):
                s.num_computed_tokens += 1
            else:
                s.token_ids.pop()
        else:
            s = seq(rng.choice(prefixes) + [rng.randrange(5) for _ in range(rng.randrange(1, 5))], f"s{step}")
            cached = bm.find_cached_prefix(s)
            if bm.allocate_slots(s, s.num_tokens - len(cached) * bm.block_size, cached):
                bm.count_prefix_lookup(s, cached)
                s.num_computed_tokens = s.num_tokens
                live.append(s)
        queued = [b.block_id for b in bm.free_blocks]
        assert sorted(queued) == [b.block_id for b in bm.blocks if b.ref_count == 0]
        assert len(queued) == bm.num_free_blocks
        for b in bm.free_blocks:
            assert b.prev_free.next_free is b and b.next_free.prev_free is b
    assert bm.prefix_cache_hit_tokens > 0       # the prefixes were hit, so revivals happened
    for s in live:
        bm.free(s)
    assert bm.num_free_blocks == bm.num_blocks


def test_the_hit_rate_counts_a_waiting_request_once(tiny_checkpoint):
    """A request that waits for blocks is looked up again every step; the counters count the
    lookup that admits it, so tokens looked up are the two prompts', however long the wait."""
    from mini_engine.config import EngineConfig
    from mini_engine.engine.engine import LLMEngine
    engine = LLMEngine(EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=10, block_size=4,
                                    async_scheduling=False))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = engine.add_request(list(range(10, 30)), params)       # 5 blocks, growing to 7
    engine.step()
    second = engine.add_request(list(range(40, 60)), params)      # needs 5: waits for the first
    steps_waited = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps_waited += second.num_computed_tokens == 0
    assert steps_waited >= 3 and engine.num_preemptions == 0
    assert engine.block_manager.prefix_cache_queried_tokens == 20 + 20
    assert first.num_output_tokens == second.num_output_tokens == 8 and engine.num_free_blocks == 10
