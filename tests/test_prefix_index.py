"""The Redis prefix index against a real redis-server: publish, longest-prefix lookups,
lapsed workers, Redis down (bounded failure) and Redis restarted (publishers republish)."""

from __future__ import annotations

import socket
import time

import pytest
import redis
from polling import wait_until

from pdserve.cluster.prefix_index import (
    EPOCH_KEY,
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


def chain(num_blocks: int, model: str = "test-model") -> list[bytes]:
    return hash_block_chain(list(range(16 * num_blocks)), 16, root_block_hash(model, 16))


def stored(*hashes: bytes) -> KVEvent:
    return KVEvent(KVEventKind.STORED, tuple(hashes))


def removed(*hashes: bytes) -> KVEvent:
    return KVEvent(KVEventKind.REMOVED, tuple(hashes))


def test_publish_lookup_and_removal(index):
    h = chain(4)
    index.publish("A", stored(*h[:3]))
    index.publish("B", stored(h[0]))
    assert index.longest_prefix(h, {"A", "B"}) == {"A": 3, "B": 1}
    index.publish("A", removed(h[1]))
    assert index.longest_prefix(h, {"A", "B"}) == {"A": 1, "B": 1}
    index.purge_worker("A", h)
    assert index.longest_prefix(h, {"A", "B"}) == {"B": 1}
    assert index.longest_prefix([], {"A"}) == {}


def test_count_stops_at_the_first_miss(index):
    h = chain(4)
    index.publish("A", stored(h[0], h[2], h[3]))  # lacks block 1: blocks 2, 3 are useless
    index.publish("B", stored(h[1], h[2]))  # lacks block 0: nothing usable
    index.publish("C", stored(*h))
    assert index.longest_prefix(h, {"A", "B", "C"}) == {"A": 1, "C": 4}
    # Another prompt sharing only block 0 (then diverging) matches one block.
    other = hash_block_chain(list(range(16)) + [7] * 16, 16, root_block_hash("test-model", 16))
    assert other[0] == h[0] and other[1] != h[1]
    assert index.longest_prefix(other, {"A", "B", "C"}) == {"A": 1, "C": 1}


def test_lapsed_workers_are_ignored_and_cleaned(index, server):
    h = chain(2)
    index.publish("A", stored(*h))
    index.publish("dead", stored(*h))
    assert index.longest_prefix(h, set()) == {}  # no live workers: nothing is cleaned
    assert index.longest_prefix(h, {"A"}, clean_stale=False) == {"A": 2}
    client = redis.Redis.from_url(server.url)
    assert client.smembers(worker_key("dead")) == set(h)
    assert index.longest_prefix(h, {"A"}) == {"A": 2}
    assert client.exists(worker_key("dead")) == 0  # "dead" removed lazily
    assert client.smembers(worker_key("A")) == set(h)


def test_republish_restores_a_workers_entries(index, server):
    h = chain(3)
    index.republish("A", h)
    assert index.longest_prefix(h, {"A"}) == {"A": 3}
    assert redis.Redis.from_url(server.url).exists(EPOCH_KEY) == 0  # only writers set it
    assert index.update("A", [], []) == index.update("B", [], [])  # one epoch for all


def test_hung_redis_fails_within_the_timeout():
    # A listening socket that never answers: connects succeed, replies never come.
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)
        index = PrefixIndex(f"redis://127.0.0.1:{hung.getsockname()[1]}/0",
                            socket_timeout_s=TIMEOUT_S)
        start = time.monotonic()
        with pytest.raises(PrefixIndexUnavailable):
            index.longest_prefix(chain(2), {"A"})
        assert time.monotonic() - start < 2 * TIMEOUT_S + 0.5
        index.close()


def test_stopped_redis_fails_fast_then_recovers(server):
    index = PrefixIndex(server.url, socket_timeout_s=TIMEOUT_S)
    h = chain(2)
    index.publish("A", stored(*h))
    server.stop()  # refused: nothing listens
    try:
        start = time.monotonic()
        with pytest.raises(PrefixIndexUnavailable):
            index.longest_prefix(h, {"A"})
        with pytest.raises(PrefixIndexUnavailable):
            index.publish("A", removed(h[0]))
        assert time.monotonic() - start < 4 * TIMEOUT_S + 0.5
    finally:
        server.restart()
    index.publish("A", stored(*h))  # the same client reconnects
    assert index.longest_prefix(h, {"A"}) == {"A": 2}
    index.close()


def test_publisher_flushes_compacted_events(index):
    h = chain(3)
    publisher = KVEventPublisher(index.redis_url, "A", socket_timeout_s=TIMEOUT_S)
    try:
        publisher(stored(*h))
        publisher(removed(h[2]))
        publisher(stored(h[2]))
        publisher(removed(h[1]))
        assert publisher.flush()
        assert index.longest_prefix(h, {"A"}) == {"A": 1}
        assert publisher.cached_hashes == {h[0], h[2]}
    finally:
        publisher.close(purge=True)
    assert index.longest_prefix(h, {"A"}) == {}


def test_publisher_writes_a_steady_trickle_of_events_in_few_writes(index, server):
    """A block stored every 5 ms for 0.6 s (a decode batch fills one almost every step)
    reaches Redis in about one write per flush_interval_s (0.1 s here), not one each."""
    from pdserve.cluster.prefix_index import EVENTS_KEY

    h = chain(120)
    client = redis.Redis.from_url(server.url)
    publisher = KVEventPublisher(index.redis_url, "T", socket_timeout_s=TIMEOUT_S,
                                 flush_interval_s=0.1)
    try:
        assert wait_until(lambda: publisher.available)
        first = client.xinfo_stream(EVENTS_KEY)["last-generated-id"] \
            if client.exists(EVENTS_KEY) else b"0-0"
        start = time.monotonic()
        for block in h:
            publisher(stored(block))
            time.sleep(0.005)
        elapsed = time.monotonic() - start
        assert publisher.flush()
        entries = [e for _, e in client.xrange(EVENTS_KEY, min=f"({first.decode()}")
                   if e[b"w"] == b"T"]
        assert index.longest_prefix(h, {"T"}) == {"T": 120}
        assert len(entries) <= elapsed / 0.1 + 3, (len(entries), elapsed)
    finally:
        publisher.close(purge=True)


def test_publisher_survives_redis_restart_and_republishes(index, server):
    h = chain(4)
    publisher = KVEventPublisher(server.url, "A", socket_timeout_s=TIMEOUT_S,
                                 retry_interval_s=0.05, probe_interval_s=0.1)
    try:
        publisher(stored(*h[:2]))
        assert publisher.flush()
        server.stop()
        publisher(stored(*h[2:]))  # recorded while Redis is down
        publisher(removed(h[0]))
        assert wait_until(lambda: not publisher.available)
        server.restart()  # empty: the epoch and every set are gone
        assert publisher.flush(timeout_s=5.0)
        assert publisher.num_republishes == 1
        assert index.longest_prefix(h[1:], {"A"}) == {"A": 3}
        assert index.longest_prefix(h, {"A"}) == {}  # block 0 was removed meanwhile
        # Idle publishers notice a restart too (the periodic probe reads the epoch).
        server.restart()
        assert wait_until(lambda: publisher.num_republishes == 2)
        assert index.longest_prefix(h[1:], {"A"}) == {"A": 3}
    finally:
        publisher.close()
