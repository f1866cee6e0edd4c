"""The router's in-memory prefix index (``LocalPrefixIndex``) against a real redis-server:
it agrees with Redis's own answer, catches up from the snapshot and the stream, drops a
forgotten worker (which republishes), re-reads a worker after a gap, survives a Redis
that restarted empty, and lets a router count a worker's first blocks at once."""

from __future__ import annotations

import random

import polling
import pytest
import redis

from pdserve.cluster.prefix_follower import LocalPrefixIndex
from pdserve.cluster.prefix_index import (
    EVENTS_KEY,
    KVEventPublisher,
    PrefixIndex,
    PrefixIndexUnavailable,
    worker_key,
)
from pdserve.engine.block_hash import hash_block_chain, root_block_hash
from pdserve.engine.block_pool import KVEvent, KVEventKind
from pdserve.entrypoints.redis_server import RedisServer

TIMEOUT_S = 0.3


@pytest.fixture(scope="module")
def server():
    with RedisServer() as server:
        yield server


@pytest.fixture
def index(server):
    redis.Redis.from_url(server.url).flushall()
    index = PrefixIndex(server.url, socket_timeout_s=TIMEOUT_S)
    yield index
    index.close()


@pytest.fixture
def follower(server, index):
    follower = LocalPrefixIndex(server.url, capacity=70, block_s=0.1, retry_interval_s=0.05,
                                socket_timeout_s=TIMEOUT_S)
    yield follower
    follower.close()


def chain(num_blocks: int, offset: int = 0) -> list[bytes]:
    return hash_block_chain(list(range(offset, offset + 16 * num_blocks)), 16,
                            root_block_hash("test-model", 16))


def wait_until(predicate, timeout_s: float = 5.0) -> bool:
    """``polling.wait_until``, an unreachable index counting as not yet."""
    return polling.wait_until(predicate, timeout_s, ignore=(PrefixIndexUnavailable,))


def test_agrees_with_redis_on_random_events(index, server):
    rng = random.Random(0)
    chains = [chain(12, offset) for offset in range(4)]
    workers = [f"w{i}" for i in range(67)]  # more than one bitmap word
    for _ in range(400):
        worker, c = rng.choice(workers), rng.choice(chains)
        n = rng.randrange(1, 13)
        if rng.random() < 0.7:
            index.update(worker, c[:n], ())
        else:
            index.update(worker, (), rng.sample(c, n))
    late = LocalPrefixIndex(server.url, block_s=0.1)  # a router started now: the snapshot
    try:
        for _ in range(100):  # and more events while it follows
            worker, c = rng.choice(workers), rng.choice(chains)
            index.update(worker, c[:rng.randrange(1, 13)], ())
        for c in chains:
            expected = index.longest_prefix(c, workers, clean_stale=False)
            assert wait_until(lambda c=c, e=expected: late.longest_prefix(c, workers) == e)
    finally:
        late.close()
    assert late.num_reloads == 1


def test_forgotten_worker_republishes(server, follower):
    h = chain(4)
    publisher = KVEventPublisher(server.url, "A", socket_timeout_s=TIMEOUT_S,
                                 probe_interval_s=0.1)
    try:
        publisher(KVEvent(KVEventKind.STORED, tuple(h)))
        assert publisher.flush()
        assert wait_until(lambda: follower.longest_prefix(h, {"A", "B"}) == {"A": 4})
        assert follower.retain({"B"}, grace_s=60) == []  # within the grace period
        assert follower.retain({"B"}) == ["A"]  # gone from the registry: forgotten
        assert follower.num_blocks("A") == 0
        # Alive after all (a heartbeat blip): its next probe finds its set gone.
        assert wait_until(lambda: publisher.num_republishes == 1)
        assert wait_until(lambda: follower.longest_prefix(h, {"A"}) == {"A": 4})
    finally:
        publisher.close(purge=True)
    assert wait_until(lambda: follower.slot_of("A") is None)  # left cleanly


def test_a_router_sees_a_workers_first_blocks_at_once(index, follower):
    """A decode worker whose first blocks reach the copy just after the router read its
    workers' slots is credited with them by the next lookup (the router re-read slots
    at most every 50 ms, and routed such a prompt as if the worker held nothing)."""
    from pdserve.router.route import Router, RouteSettings

    prompt = list(range(16 * 6 + 6))
    h = hash_block_chain(prompt, 16, bytes(16))
    index.update("P", h[:5], ())
    assert wait_until(lambda: follower.longest_prefix(h, {"P"}) == {"P": 5})
    for decode_id in ("D0", "D1", "D2"):
        version = follower.slots_version
        router = Router(RouteSettings(block_size=16, local_prefill_threshold=16), follower,
                        bytes(16), {"P": "cpu@h:0"}, {decode_id: "cpu@h:1"})
        assert router.decode.slots[0] == -1  # no blocks yet: no slot
        index.update(decode_id, h[:6], ())
        assert wait_until(lambda d=decode_id: follower.num_blocks(d) == 6)
        assert follower.slots_version > version
        decision = router.route(prompt)
        assert (decision.decode_worker_id, decision.prefill_worker_id, decision.reason) == \
            (decode_id, None, "cached_on_decode")


def test_a_gap_re_reads_the_worker(index, server, follower):
    h = chain(3)
    index.update("A", h[:1], ())
    assert wait_until(lambda: follower.longest_prefix(h, {"A"}) == {"A": 1})
    client = redis.Redis.from_url(server.url)
    client.sadd(worker_key("A"), *h[1:])  # written, but its entry was trimmed away
    client.xadd(EVENTS_KEY, {"w": "A", "k": "s", "n": 5, "h": b""})
    assert wait_until(lambda: follower.longest_prefix(h, {"A"}) == {"A": 3})


def test_redis_restart_reloads(server, follower):
    h = chain(3)
    publisher = KVEventPublisher(server.url, "A", socket_timeout_s=TIMEOUT_S,
                                 retry_interval_s=0.05, probe_interval_s=0.1)
    try:
        publisher(KVEvent(KVEventKind.STORED, tuple(h)))
        assert publisher.flush()
        assert wait_until(lambda: follower.longest_prefix(h, {"A"}) == {"A": 3})
        server.stop()
        assert wait_until(lambda: not follower.available)
        with pytest.raises(PrefixIndexUnavailable):
            follower.longest_prefix(h, {"A"})
        server.restart()  # empty
        assert wait_until(lambda: publisher.num_republishes == 1)
        assert wait_until(lambda: follower.longest_prefix(h, {"A"}) == {"A": 3})
        assert follower.num_reloads >= 2
    finally:
        publisher.close()


def test_a_router_follows_slots_given_anew_after_redis_restarted(index, server, follower):
    """Redis restarted empty: the copy drops every worker, and the workers' republished
    sets take their slots again in another order (here A takes B's old slot). The router
    re-reads the slots although every slot a lookup credits is one it knew (it re-read
    them only for a slot unknown to it, and routed A's prompt to B, with no cached
    tokens: test_serve's Redis-outage test)."""
    from pdserve.router.route import Router, RouteSettings

    held_by_a = list(range(16 * 6 + 6))
    h_a = hash_block_chain(held_by_a, 16, bytes(16))
    h_b = hash_block_chain(list(range(5000, 5000 + 16 * 6)), 16, bytes(16))
    for worker_id, hashes in (("A", h_a[:6]), ("B", h_b)):
        index.update(worker_id, hashes, ())
        assert wait_until(lambda w=worker_id: follower.num_blocks(w) == 6)
    router = Router(RouteSettings(block_size=16, local_prefill_threshold=16), follower,
                    bytes(16), {"P": "cpu@h:0"}, {"A": "cpu@h:1", "B": "cpu@h:2"})
    before = {w: follower.slot_of(w) for w in "AB"}
    assert router.route(held_by_a).decode_worker_id == "A"
    server.stop()
    assert wait_until(lambda: not follower.available)
    server.restart()  # empty
    assert wait_until(lambda: follower.available and follower.slot_of("A") is None)
    for worker_id, hashes in (("A", h_a[:6]), ("B", h_b)):  # freed A's, then B's: A gets B's
        index.update(worker_id, hashes, ())
        assert wait_until(lambda w=worker_id: follower.num_blocks(w) == 6)
    assert {w: follower.slot_of(w) for w in "AB"} != before
    decision = router.route(held_by_a)
    assert (decision.decode_worker_id, decision.reason) == ("A", "cached_on_decode")


def test_a_replaced_index_changes_the_slots_version_even_at_a_reused_address(server):
    """The routing arrays re-read slots when the index is replaced: in-memory indexes at
    the same slots_version differ by their instance number, also where a new one takes
    a freed one's address (CPython reuses it, so an id() repeats within a few tries);
    the Redis index differs from them all."""
    import gc
    from types import SimpleNamespace

    from pdserve.router.model_service import _IndexSlots

    routing = SimpleNamespace(index=None)
    slots = _IndexSlots(routing)
    url = f"redis://127.0.0.1:{server.port}/0"
    seen = set()
    for _ in range(20):
        routing.index = LocalPrefixIndex(url, start=False)
        assert slots.slots_version not in seen
        seen.add(slots.slots_version)
        routing.index.close()
        routing.index = None  # NOTE: freed, so that the next one may take its address
        gc.collect()
    routing.index = PrefixIndex(url)
    assert slots.slots_version not in seen and slots.slot_of("D0") is None
