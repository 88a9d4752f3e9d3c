"""Block pool, prefix cache and per-sequence block tables."""

from __future__ import annotations

import pytest

from engine.sampling import SamplingParams
from engine.sequence import Sequence
from kvstore.events import BlockRemoved, BlockStored
from kvstore.hashing import DEFAULT_HASH_KEY, block_hashes, hash_seed
from kvstore.manager import KVCacheManager
from kvstore.pool import BlockPool, NoFreeBlocks


def seq(tokens, bs=4, rid="r"):
    return Sequence(rid, list(tokens), SamplingParams(), block_size=bs, hash_seed=hash_seed(DEFAULT_HASH_KEY, "m"))


def test_allocate_and_free_round_trip():
    pool = BlockPool(4)
    ids = pool.allocate(3)
    assert len(set(ids)) == 3 and pool.num_free == 1
    with pytest.raises(NoFreeBlocks):
        pool.allocate(2)
    pool.free(ids)
    assert pool.num_free == 4
    with pytest.raises(RuntimeError):
        pool.free([ids[0]])


def test_cached_blocks_survive_free_and_are_evicted_lru():
    pool = BlockPool(3)
    a, b, _c = pool.allocate(3)
    pool.cache(a, 111, None)
    pool.cache(b, 222, 111)
    pool.free([b])  # b is least recently used
    pool.free([a])
    assert pool.match_prefix([111, 222]) == [a, b]  # freed but still cached
    (reused,) = pool.allocate(1)
    assert reused == b and pool.lookup(222) is None  # LRU evicted first
    assert pool.match_prefix([111, 222]) == [a]
    events = pool.events.drain()
    assert events == [BlockStored(111, None, "device"), BlockStored(222, 111, "device"), BlockRemoved(222, "device")]


def test_blocks_that_served_a_hit_outlive_blocks_seen_once():
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    for bid, h in ((a, 1), (b, 2), (c, 3)):
        pool.cache(bid, h, None)
    pool.free([a])
    pool.touch([a])  # a prefix hit on a
    pool.free([a, b, c])  # a is freed first, so plain LRU would evict it first
    pool.free([d])  # empty: nothing lost by reusing it
    assert pool.eviction_order() == [d, b, c, a]
    assert pool.allocate(3) == [d, b, c]
    assert pool.lookup(1) == a and pool.lookup(2) is None and pool.lookup(3) is None


def test_generated_blocks_are_the_first_cached_blocks_to_go_tail_first():
    pool = BlockPool(5)
    p1, p2, g1, g2, other = pool.allocate(5)
    pool.cache(other, 9, None)
    pool.free([other])  # an older prompt block
    pool.cache(p1, 1, None)
    pool.cache(p2, 2, 1)
    pool.cache(g1, 3, 2, generated=True)
    pool.cache(g2, 4, 3, generated=True)
    pool.free(reversed([p1, p2, g1, g2]))  # as the manager frees a finished sequence
    assert pool.eviction_order() == [g2, g1, other, p2, p1]


def test_protected_blocks_beyond_their_share_go_back_to_probation():
    pool = BlockPool(4, protected_share=0.5)  # at most 2 protected
    ids = pool.allocate(4)
    for h, bid in enumerate(ids):
        pool.cache(bid, 100 + h, None)
    pool.free(ids)
    pool.touch(ids)
    pool.free(ids)  # all four were hit; the two freed first are demoted, at the back of probation
    assert pool.eviction_order() == ids


def test_manager_marks_blocks_past_the_prompt_as_generated():
    pool = BlockPool(8)
    kv = KVCacheManager(pool, block_size=4)
    s = seq(range(6))  # block 0 is prompt, block 1 holds prompt tokens 4-5 and two generated ones
    assert kv.grow(s, 8)
    s.append_token(7)
    s.append_token(8)
    s.num_computed_tokens = 8
    kv.cache_computed(s)
    assert [pool._generated[b] for b in s.block_table] == [False, True]


def test_touch_takes_cached_block_off_the_free_queue():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache(a, 5, None)
    pool.free([a])
    assert pool.num_free == 2
    pool.touch([a])
    assert pool.num_free == 1 and pool.ref_count(a) == 1
    pool.allocate(1)  # takes the other block, not the touched one
    assert pool.lookup(5) == a


def test_duplicate_hash_keeps_the_first_block():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    assert pool.cache(a, 9, None)
    assert not pool.cache(b, 9, None)
    assert pool.block_hash(b) is None


def test_manager_matches_leaves_one_token_and_frees_tail_first():
    pool = BlockPool(8)
    kv = KVCacheManager(pool, block_size=4)
    s = seq(range(12))  # exactly three full blocks
    assert kv.grow(s, 12)
    s.num_computed_tokens = 12
    kv.cache_computed(s)
    assert s.num_cached_blocks == 3
    kv.free(s)
    s2 = seq(range(12), rid="r2")
    hits = kv.match_prefix(s2)
    assert len(hits) == 2  # the last block is recomputed so that its logits exist
    s3 = seq(range(13), rid="r3")
    assert len(kv.match_prefix(s3)) == 3
    # never-used blocks go first; then the tail block, which was freed first
    pool.allocate(5)
    tail = s3.block_hashes(3)[2]
    pool.allocate(1)
    assert pool.lookup(tail) is None
    assert len(kv.match_prefix(s3)) == 2


def test_can_admit_counts_reclaimed_cached_hits():
    pool = BlockPool(3)
    kv = KVCacheManager(pool, block_size=4)
    s = seq(range(9))
    kv.grow(s, 9)
    s.num_computed_tokens = 9
    kv.cache_computed(s)
    kv.free(s)  # 2 cached blocks + 1 empty, all free
    s2 = seq(range(9), rid="b")
    hits = kv.match_prefix(s2)
    assert len(hits) == 2
    assert kv.can_admit(s2, hits, 1)  # needs 1 new block; 3 free minus 2 reclaimed = 1
    assert not kv.can_admit(s2, hits, 5)


def test_sequence_hashes_are_the_chained_block_hashes():
    s = seq(range(10), bs=4)
    assert s.block_hashes() == block_hashes(list(range(10)), 4, hash_seed(DEFAULT_HASH_KEY, "m"))
    s.append_token(10)
    s.append_token(11)  # completes the third block
    full = block_hashes(list(range(12)), 4, hash_seed(DEFAULT_HASH_KEY, "m"))
    assert s.block_hashes() == full and len(full) == 3
