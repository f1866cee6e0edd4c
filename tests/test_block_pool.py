"""Block pool, KV cache manager and block hashes: exact block ids, free-queue order, events."""

from __future__ import annotations

import pytest

from pdserve.engine.block_hash import hash_block_chain, hash_block_tokens, root_block_hash
from pdserve.engine.block_pool import BlockPool, KVEvent, KVEventKind, NoFreeBlocksError
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams

ROOT = root_block_hash("test-model", 4)


def make_request(request_id: str, prompt: list[int], cache_salt: str | None = None) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=8), frozenset(), 8, cache_salt)


def test_block_hash_chain_is_stable_and_chained():
    tokens = list(range(10))
    hashes = hash_block_chain(tokens, 4, ROOT)
    assert len(hashes) == 2  # the partial third block is not hashed
    assert hashes[0] == hash_block_tokens(ROOT, [0, 1, 2, 3])
    assert hashes[1] == hash_block_tokens(hashes[0], [4, 5, 6, 7])
    assert all(len(h) == 16 for h in hashes)
    # Same block content after a different prefix hashes differently.
    assert hash_block_chain([9, 9, 9, 9, 4, 5, 6, 7], 4, ROOT)[1] != hashes[1]
    # Salt, model and block size separate caches.
    assert hash_block_chain(tokens, 4, ROOT, "tenant-a")[0] != hashes[0]
    assert root_block_hash("other-model", 4) != ROOT
    assert root_block_hash("test-model", 16) != ROOT
    # Extending from known parents gives the same chain.
    assert hash_block_chain(tokens + [10, 11], 4, ROOT, parent_hashes=hashes[:1]) == \
        hash_block_chain(tokens + [10, 11], 4, ROOT)
    # Pinned values: the router and workers on other machines must agree forever.
    assert ROOT.hex() == "1cd9d3be52fd24bc92386bed8a0fbd82"
    assert hash_block_tokens(b"\0" * 16, [1, 2, 3, 4]).hex() == "33d30b46f4b3a556918daaa3647a9b00"


def test_new_blocks_come_from_free_queue_head_and_frees_go_to_tail():
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)
    assert [b.block_id for b in a] == [0, 1]
    assert [b.ref_cnt for b in a] == [1, 1]
    pool.free_blocks(reversed(a))  # tail first: block 1 is evicted before block 0
    assert pool.num_free_blocks == 4
    assert [b.block_id for b in pool.get_new_blocks(4)] == [0, 1, 2, 3]  # ascending ids
    with pytest.raises(NoFreeBlocksError):
        pool.get_new_blocks(1)


def test_blocks_freed_tail_first_come_back_as_one_ascending_run():
    """A request that reuses another's blocks holds consecutive ascending ids (KV
    transfer then moves them in place), and the LRU choice of which blocks is kept."""
    pool = BlockPool(12)
    first, second = pool.get_new_blocks(4), pool.get_new_blocks(5)  # ids 0-3, 4-8
    pool.free_blocks(reversed(second))  # queue: 9, 10, 11, 8, 7, 6, 5, 4
    pool.free_blocks(reversed(first))   # ... 3, 2, 1, 0
    assert [b.block_id for b in pool.get_new_blocks(3)] == [9, 10, 11]
    assert [b.block_id for b in pool.get_new_blocks(5)] == [4, 5, 6, 7, 8]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [2, 3]  # LRU: 3 and 2 first


def test_cached_block_is_reused_then_evicted_in_lru_order():
    events: list[KVEvent] = []
    pool = BlockPool(3, kv_event_callback=events.append)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"h0", b"h1"])
    assert events == [KVEvent(KVEventKind.STORED, (b"h0", b"h1"))]
    pool.free_blocks(reversed(blocks))
    assert pool.get_cached_block(b"h0") is blocks[0]  # still cached while free
    pool.touch([blocks[0]])  # a prefix hit takes it back out of the free queue
    assert blocks[0].ref_cnt == 1 and pool.num_free_blocks == 2
    # Two new blocks: the never-used block 2, then the LRU cached block 1 (evicted).
    assert [b.block_id for b in pool.get_new_blocks(2)] == [1, 2]
    assert events[-1] == KVEvent(KVEventKind.REMOVED, (b"h1",))
    assert pool.get_cached_block(b"h1") is None


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [b"same"])
    pool.cache_full_blocks([b], [b"same"])
    assert pool.get_cached_block(b"same") is a and b.block_hash is None


def test_manager_allocates_and_reuses_prefix():
    kv = KVCacheManager(num_blocks=8, block_size=4, root_hash=ROOT)
    first = make_request("a", list(range(10)))
    assert kv.get_computed_blocks(first) == ([], 0)
    assert kv.allocate_slots(first, 10)
    assert kv.block_ids("a") == [0, 1, 2]
    first.num_computed_tokens = 10
    kv.free(first)

    second = make_request("b", list(range(8)) + [50, 51, 52])
    hits, num_hit = kv.get_computed_blocks(second)
    assert [b.block_id for b in hits] == [0, 1] and num_hit == 8
    assert kv.allocate_slots(second, 3, hits)
    # The never-used block 3 comes before the freed (cached) block 2.
    assert kv.block_ids("b") == [0, 1, 3]
    assert kv.pool.num_free_blocks == 5


def test_full_hit_still_computes_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=4, root_hash=ROOT)
    first = make_request("a", list(range(8)))
    assert kv.allocate_slots(first, 8)
    kv.free(first)
    again = make_request("b", list(range(8)))
    _, num_hit = kv.get_computed_blocks(again)
    assert num_hit == 4  # at most num_tokens - 1 = 7 tokens, so one full block


def test_salt_isolates_prefix_cache():
    kv = KVCacheManager(num_blocks=8, block_size=4, root_hash=ROOT)
    first = make_request("a", list(range(9)), cache_salt="tenant-a")
    assert kv.allocate_slots(first, 9)
    kv.free(first)
    assert kv.get_computed_blocks(make_request("b", list(range(9)), "tenant-b"))[1] == 0
    assert kv.get_computed_blocks(make_request("c", list(range(9)), "tenant-a"))[1] == 8


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=4, root_hash=ROOT)
    request = make_request("a", list(range(12)))
    assert not kv.allocate_slots(request, 12)
    assert kv.pool.num_free_blocks == 2 and "a" not in kv.req_to_blocks
