"""Exact allocation behaviour of the block pool and the per-request KV manager."""
from __future__ import annotations

import pytest

from pdd.api import SamplingParams
from pdd.engine.request import Request
from pdd.kv.block_pool import NULL_BLOCK, BlockPool
from pdd.kv.hashing import ROOT_HASH, block_hashes, hash_block
from pdd.kv.manager import KVCacheManager


def assert_pool_empty(pool: BlockPool) -> None:
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert pool.ref_counts == [1] + [0] * (pool.num_blocks - 1)


def test_allocate_in_order_and_free_to_tail():
    pool = BlockPool(6)
    assert pool.allocate(3) == [1, 2, 3]
    assert pool.ref_counts == [1, 1, 1, 1, 0, 0]
    pool.free([3, 1])                       # tail-first, as a request frees
    assert list(pool.free_queue) == [4, 5, 3, 1]
    assert pool.allocate(3) == [4, 5, 3]
    pool.free([4, 5, 3, 2])
    assert list(pool.free_queue) == [1, 4, 5, 3, 2]
    assert_pool_empty(pool)


def test_restore_puts_the_free_order_and_step_counts_back():
    pool = BlockPool(6)
    pool.free(pool.allocate(2))
    snap = pool.snapshot()
    pool.steps_launched = 7
    blocks = pool.allocate(4)
    pool.free(blocks[::-1])
    assert list(pool.free_queue) != list(snap.free_order) and pool.freed_at != list(snap.freed_at)
    pool.restore(snap)
    assert pool.snapshot() == snap and list(pool.free_queue) == [3, 4, 5, 1, 2]


def test_restore_refuses_while_a_block_free_then_is_held():
    pool = BlockPool(4)
    snap = pool.snapshot()
    pool.allocate(1)
    with pytest.raises(RuntimeError, match="pool restore: 3 blocks were free, 2 are now"):
        pool.restore(snap)


def test_null_block_is_never_handed_out_or_freed():
    pool = BlockPool(3)
    assert NULL_BLOCK not in pool.allocate(2)
    pool.free([NULL_BLOCK])
    assert pool.ref_counts[NULL_BLOCK] == 1
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    with pytest.raises(ValueError):
        BlockPool(1)


def test_double_free_is_detected():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([b])


def test_cached_block_survives_free_until_reused():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache_block(a, 111)
    pool.free([b, a])
    assert pool.get_cached_block(111) == a
    pool.touch([a])                          # a prefix hit revives it
    assert pool.ref_counts[a] == 1 and a not in pool.free_queue
    pool.touch([a])                          # shared by a second request
    assert pool.ref_counts[a] == 2
    pool.free([a])
    pool.free([a])
    assert list(pool.free_queue) == [3, b, a]
    # Reuse order: 3, then b, then a; only when a is handed out is its hash forgotten.
    assert pool.allocate(2) == [3, b]
    assert pool.get_cached_block(111) == a
    assert pool.allocate(1) == [a]
    assert pool.get_cached_block(111) is None
    pool.free([a, b, 3])
    assert_pool_empty(pool)


def test_first_block_with_a_hash_stays_the_cached_copy():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache_block(a, 7)
    pool.cache_block(b, 7)
    assert pool.get_cached_block(7) == a and pool.block_hash[b] is None
    pool.free([a, b])
    assert pool.reset_prefix_cache() == 1
    assert pool.get_cached_block(7) is None


def test_hash_chain_is_stable_and_prefix_sensitive():
    h = block_hashes(list(range(40)), 16)
    assert len(h) == 2                       # only full blocks
    assert h[0] == hash_block(ROOT_HASH, list(range(16)))
    assert h[1] == hash_block(h[0], list(range(16, 32)))
    # Same block tokens after a different prefix: different hash.
    assert block_hashes([9] + list(range(1, 32)), 16)[1] != h[1]
    # Fixed value: identical in every process and on every host.
    assert hash_block(ROOT_HASH, [1, 2, 3]) == hash_block(0, (1, 2, 3))
    assert block_hashes(list(range(40)), 16, start=16, parent=h[0]) == [h[1]]


def _req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=4).validate())


def test_manager_prefix_hits_and_exact_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = _req("a", range(10))                 # 2 full blocks + 2 tokens
    assert kv.get_computed_blocks(a) == ([], 0)
    assert kv.allocate_slots(a, 10) == [1, 2, 3]
    a.num_computed_tokens = 10
    kv.cache_blocks(a, 10)
    assert kv.pool.block_hash[1] is not None and kv.pool.block_hash[3] is None

    b = _req("b", list(range(8)) + [99, 98, 97])
    hit, n = kv.get_computed_blocks(b)
    assert (hit, n) == ([1, 2], 8)
    assert kv.allocate_slots(b, 3, hit) == [1, 2, 4]
    assert kv.pool.ref_counts[1:5] == [2, 2, 1, 1]

    kv.free(a)
    assert kv.pool.ref_counts[1:5] == [1, 1, 0, 1]
    assert list(kv.pool.free_queue)[-1] == 3
    kv.free(b)
    # b freed tail-first: 4, then its shared prefix 2, 1.
    assert list(kv.pool.free_queue)[-3:] == [4, 2, 1]
    assert_pool_empty(kv.pool)


def test_manager_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = _req("a", range(8))
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.cache_blocks(a, 8)
    kv.free(a)
    again = _req("a2", range(8))             # identical 2-block prompt
    assert kv.get_computed_blocks(again)[1] == 4


def test_manager_refuses_without_side_effects_when_full():
    kv = KVCacheManager(num_blocks=4, block_size=4)   # 3 usable blocks
    a = _req("a", range(8))
    assert kv.allocate_slots(a, 8) == [1, 2]
    b = _req("b", range(100, 108))
    assert kv.allocate_slots(b, 8) is None
    assert kv.block_ids(b) == [] and kv.num_free_blocks == 1
    kv.free(a)
    assert_pool_empty(kv.pool)


def test_hit_on_free_cached_blocks_counts_against_free_space():
    kv = KVCacheManager(num_blocks=4, block_size=4)   # 3 usable
    a = _req("a", range(9))
    kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    kv.cache_blocks(a, 9)
    kv.free(a)                                # 3 free, 2 of them cached
    b = _req("b", list(range(8)) + [5, 6, 7, 8, 9])   # needs 4 blocks, 2 hit
    hit, n = kv.get_computed_blocks(b)
    assert n == 8
    assert kv.allocate_slots(b, 5, hit) is None
    assert_pool_empty(kv.pool)
