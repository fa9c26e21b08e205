"""BlockPool: exact block ids, ref counts, LRU eviction order and KV events."""

from __future__ import annotations

import pytest

from engine.kv.block_pool import BlockPool, NoFreeBlocksError
from vocabulary.block_hash import BlockHash, hash_chain, hash_extra
from vocabulary.kv_events import KVEvent, KVEventKind

EXTRA = hash_extra("tiny")


def hashes(n: int, first_token: int = 0) -> list[BlockHash]:
    """A chain of n block hashes (block size 4) over distinct tokens."""
    return hash_chain(list(range(first_token, first_token + 4 * n)), 4, EXTRA)


def test_allocate_hands_out_lowest_ids_first_with_ref_one() -> None:
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert [pool.ref_count(b) for b in range(4)] == [1, 1, 1, 0]
    assert (pool.num_free, pool.num_used) == (1, 3)
    assert pool.can_allocate(1) and not pool.can_allocate(2)


def test_allocate_beyond_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(2)
    pool.allocate(1)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    assert pool.num_free == 1


def test_freed_uncached_blocks_are_reused_in_ascending_id_order() -> None:
    pool = BlockPool(3)
    assert pool.allocate(3) == [0, 1, 2]
    pool.free([0, 1])  # released in reverse: 1, then 0
    assert pool.allocate(2) == [0, 1]  # one run again (one NIXL descriptor)


def test_a_freed_sequence_comes_back_as_one_run_from_the_free_and_the_lru_lists() -> None:
    pool = BlockPool(8)
    a, b = pool.allocate(4), pool.allocate(4)
    assert (a, b) == ([0, 1, 2, 3], [4, 5, 6, 7])
    pool.free(b)  # uncached: free list, tail first (7, 6, 5, 4)
    assert pool.allocate(4) == [4, 5, 6, 7]
    pool.cache_blocks(a, [BlockHash(bytes([i]) * 8) for i in range(4)])
    pool.free(a)  # cached: LRU list, tail first
    assert pool.allocate(3) == [1, 2, 3]  # evicts the tail (least likely shared) first
    assert pool.block_hash(0) is not None  # the head block stays cached


def test_free_below_zero_is_an_error() -> None:
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    pool.free([b])
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([b])


def test_cache_blocks_emits_stored_and_match_prefix_finds_longest_prefix() -> None:
    pool = BlockPool(8)
    chain = hashes(3)
    blocks = pool.allocate(3)
    pool.cache_blocks(blocks[:2], chain[:2])
    assert pool.take_events() == [KVEvent(0, KVEventKind.STORED, (chain[0], chain[1]))]
    assert pool.match_prefix(chain) == [0, 1]
    assert pool.match_prefix([chain[2], chain[0]]) == []  # stops at the first miss
    assert pool.block_hash(0) == chain[0] and pool.block_hash(2) is None
    assert pool.cached_hashes() == (chain[0], chain[1])


def test_cache_hit_takes_a_ref_and_pins_the_block_against_eviction() -> None:
    pool = BlockPool(2)
    chain = hashes(1)
    [b] = pool.allocate(1)
    pool.cache_blocks([b], chain)
    pool.touch(pool.match_prefix(chain))  # a second sequence shares it
    assert pool.ref_count(b) == 2
    pool.free([b])
    assert pool.ref_count(b) == 1
    assert pool.num_free == 1
    assert pool.allocate(1) == [1]
    assert not pool.can_allocate(1)  # the shared block is held: never evicted
    assert pool.match_prefix(chain) == [b]


def test_freed_cached_blocks_stay_matchable_until_evicted_lru_first() -> None:
    pool = BlockPool(4)
    a, b = hashes(1, first_token=0), hashes(1, first_token=100)
    [x] = pool.allocate(1)
    [y] = pool.allocate(1)
    pool.cache_blocks([x], a)
    pool.cache_blocks([y], b)
    pool.free([x])  # x freed first: least recently used
    pool.free([y])
    pool.take_events()
    assert pool.num_free == 4 and pool.num_cached == 2
    assert pool.allocate(2) == [2, 3]  # never-cached free blocks go first
    assert pool.allocate(1) == [x]  # then the LRU cached block is evicted
    assert pool.take_events() == [KVEvent(2, KVEventKind.REMOVED, (a[0],))]
    assert pool.match_prefix(a) == [] and pool.match_prefix(b) == [y]
    assert pool.num_evicted == 1


def test_touch_makes_an_evictable_block_most_recently_used_again() -> None:
    pool = BlockPool(2)
    a, b = hashes(1, first_token=0), hashes(1, first_token=100)
    x, y = pool.allocate(2)
    pool.cache_blocks([x], a)
    pool.cache_blocks([y], b)
    pool.free([x])
    pool.free([y])
    pool.touch([x])  # hit on x: it leaves the evictable set
    pool.free([x])  # and comes back as the most recently used
    assert pool.allocate(1) == [y]


def test_sequence_blocks_are_evicted_tail_first() -> None:
    pool = BlockPool(3)
    chain = hashes(3)
    blocks = pool.allocate(3)
    pool.cache_blocks(blocks, chain)
    pool.free(blocks)
    pool.take_events()
    assert pool.allocate(2) == [1, 2]  # handed out ascending; evicted tail first:
    assert pool.take_events() == [KVEvent(1, KVEventKind.REMOVED, (chain[2], chain[1]))]
    assert pool.match_prefix(chain) == [0]


def test_duplicate_hash_is_not_cached_twice() -> None:
    pool = BlockPool(4)
    chain = hashes(1)
    x, y = pool.allocate(2)
    pool.cache_blocks([x], chain)
    pool.cache_blocks([y], chain)  # computed the same prefix concurrently
    assert pool.block_hash(y) is None
    assert [e.seq for e in pool.take_events()] == [0]
    pool.free([y])
    assert pool.allocate(1) == [2]  # y went back as a plain free block, behind 2 and 3
    assert pool.num_cached == 1


def test_cache_blocks_requires_held_blocks() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="not in use"):
        pool.cache_blocks([0], hashes(1))


def test_touch_of_a_free_uncached_block_is_an_error() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="is free"):
        pool.touch([0])


def test_reset_prefix_cache_emits_cleared_and_frees_evictable_blocks() -> None:
    pool = BlockPool(3)
    chain = hashes(2)
    x, y = pool.allocate(2)
    pool.cache_blocks([x, y], chain)
    pool.free([y])
    pool.reset_prefix_cache()
    events = pool.take_events()
    assert events == [
        KVEvent(0, KVEventKind.STORED, tuple(chain)),
        KVEvent(1, KVEventKind.CLEARED, ()),
    ]
    assert pool.cached_hashes() == ()
    assert pool.match_prefix(chain) == []
    assert (pool.ref_count(x), pool.num_free) == (1, 2)
    assert pool.allocate(2) == sorted([2, y])
    assert pool.take_events() == []  # nothing was evicted


def test_event_seq_numbers_grow_by_one_across_drains() -> None:
    pool = BlockPool(2)
    a, b = hashes(1, first_token=0), hashes(1, first_token=100)
    [x] = pool.allocate(1)
    pool.cache_blocks([x], a)
    assert [e.seq for e in pool.take_events()] == [0]
    [y] = pool.allocate(1)
    pool.cache_blocks([y], b)
    assert [e.seq for e in pool.take_events()] == [1]
    assert pool.last_seq == 1
    assert pool.take_events() == []


def test_undrained_events_are_bounded_leaving_a_seq_gap() -> None:
    pool = BlockPool(4, max_pending_events=2)
    for i, block in enumerate(pool.allocate(3)):
        pool.cache_blocks([block], hashes(1, first_token=100 * i))
    assert [e.seq for e in pool.take_events()] == [1, 2]


def test_caching_disabled_never_matches_or_emits() -> None:
    pool = BlockPool(2, enable_caching=False)
    chain = hashes(1)
    [x] = pool.allocate(1)
    pool.cache_blocks([x], chain)
    assert pool.match_prefix(chain) == []
    assert pool.take_events() == []
    pool.free([x])
    assert pool.num_free == 2
