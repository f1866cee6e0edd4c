"""The worker registry against a real private redis-server (entrypoints/redis_server.py):
workers register and are live, a stopped heartbeat lapses, Redis down and restarted."""

from __future__ import annotations

import time

import pytest
import redis
from polling import wait_until

from pdserve.cluster.registry import (
    WORKERS_KEY,
    RegistryUnavailable,
    WorkerRecord,
    WorkerRegistry,
    heartbeat_key,
)
from pdserve.entrypoints.redis_server import RedisServer

TTL_S, INTERVAL_S, TIMEOUT_S = 1.0, 0.2, 0.3


@pytest.fixture(scope="module")
def server():
    with RedisServer() as server:
        yield server


@pytest.fixture
def make_registry(server):
    """Registries on the (flushed, running) server with short heartbeats; closed after."""
    server.start()
    redis.Redis.from_url(server.url).flushall()
    made = []

    def make() -> WorkerRegistry:
        registry = WorkerRegistry(server.url, heartbeat_ttl_s=TTL_S,
                                  heartbeat_interval_s=INTERVAL_S, socket_timeout_s=TIMEOUT_S)
        made.append(registry)
        return registry

    yield make
    for registry in made:
        registry.close()


def record(worker_id: str, role: str) -> WorkerRecord:
    return WorkerRecord.new(worker_id, role, f"127.0.0.1:{5000 + len(worker_id)}",
                            f"127.0.0.1:{6000 + len(worker_id)}", "demo")


def live_ids(registry: WorkerRegistry, role: str | None = None) -> list[str]:
    return [r.worker_id for r in registry.list_live(role)]


def test_redis_server_restarts_empty_on_the_same_port(server):
    client = redis.Redis.from_url(server.url, socket_timeout=1)
    client.set("k", "v")
    url = server.url
    server.stop()
    with pytest.raises(redis.ConnectionError):
        client.ping()
    server.restart()
    assert server.url == url and client.ping() and client.get("k") is None


def test_registered_workers_are_live_with_their_records(make_registry):
    prefill, decode, router = make_registry(), make_registry(), make_registry()
    p, d = record("prefill-0", "prefill"), record("decode-0", "decode")
    prefill.register(p)
    decode.register(d)
    assert router.list_live() == [d, p]  # by worker id
    assert live_ids(router, "prefill") == ["prefill-0"]
    assert live_ids(router, "decode") == ["decode-0"]
    assert prefill.heartbeat_ok and prefill.num_registrations == 1


def test_a_stopped_heartbeat_lapses_and_the_other_stays(make_registry):
    a, b, router = make_registry(), make_registry(), make_registry()
    a.register(record("prefill-a", "prefill"))
    b.register(record("prefill-b", "prefill"))
    a.stop_heartbeat()
    stopped_at = time.monotonic()
    assert wait_until(lambda: live_ids(router) == ["prefill-b"], TTL_S + 1.0)
    assert time.monotonic() - stopped_at > TTL_S - INTERVAL_S - 0.05  # it lapsed, not vanished
    time.sleep(2 * INTERVAL_S)
    assert live_ids(router) == ["prefill-b"]


def test_deregister_removes_the_worker_at_once(make_registry, server):
    worker, router = make_registry(), make_registry()
    worker.register(record("decode-x", "decode"))
    worker.deregister()
    assert live_ids(router) == []
    assert not redis.Redis.from_url(server.url).sismember(WORKERS_KEY, "decode-x")


def test_workers_register_again_after_redis_restarts_empty(make_registry, server):
    worker, router = make_registry(), make_registry()
    worker.register(record("decode-r", "decode"))
    server.restart()
    assert wait_until(lambda: live_ids(router) == ["decode-r"], 5 * INTERVAL_S + 1.0)
    assert worker.num_registrations == 2


def test_redis_down_fails_fast_and_heartbeats_resume(make_registry, server):
    worker, router = make_registry(), make_registry()
    worker.register(record("prefill-d", "prefill"))
    server.stop()
    start = time.monotonic()
    with pytest.raises(RegistryUnavailable):
        router.list_live()
    assert time.monotonic() - start < 4 * TIMEOUT_S + 0.5
    time.sleep(TTL_S + INTERVAL_S)  # the heartbeat thread keeps failing, and keeps going
    assert not worker.heartbeat_ok
    server.start()
    assert wait_until(lambda: live_ids(router) == ["prefill-d"], 5 * INTERVAL_S + 1.0)
    assert worker.heartbeat_ok


def test_heartbeat_holds_the_epoch_and_records_round_trip(make_registry, server):
    worker = make_registry()
    rec = record("prefill-e", "prefill")
    worker.register(rec)
    client = redis.Redis.from_url(server.url)
    assert int(client.get(heartbeat_key("prefill-e"))) == rec.epoch
    assert 0 < client.pttl(heartbeat_key("prefill-e")) <= TTL_S * 1000
    assert WorkerRecord.from_json(rec.to_json()) == rec
    with pytest.raises(ValueError):
        WorkerRecord.new("w", "router", "a:1", "b:2", "m")
