"""The Redis prefix index: which workers hold which prefix-cache blocks (docs/architecture.md,
Cluster state).

Layout: one Redis set per block hash, ``pdserve:block:<32 hex digits>`` -> worker ids.
Workers publish their block pool's KV events (``stored`` -> SADD, ``removed`` -> SREM)
through a ``KVEventPublisher``; the router asks ``PrefixIndex.longest_prefix`` which
workers hold the longest run of a prompt's chained block hashes.

Restarts: ``pdserve:prefix_index:epoch`` holds a random token, created by the first writer
that finds it missing. A Redis that restarted empty has lost it, so each publisher sees a
new epoch on its next write and republishes every hash its worker still caches; a Redis
that restarted from its own snapshot kept both the epoch and the sets.

Every Redis call has a socket timeout and at most one reconnect; when Redis is unreachable
the router's lookups raise ``PrefixIndexUnavailable`` (it then routes by load alone) and
publishers keep their changes to send later.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Collection, Iterable, Iterator, Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pdserve.cluster.auth import redact_url
from pdserve.engine.block_pool import KVEvent, KVEventKind

logger = logging.getLogger(__name__)

BLOCK_KEY_PREFIX = "pdserve:block:"
EPOCH_KEY = "pdserve:prefix_index:epoch"
_CHUNK = 1000  # commands per pipeline when republishing or purging


class PrefixIndexUnavailable(RuntimeError):
    """Redis did not answer (refused, reset or timed out); route by load alone."""


def block_key(block_hash: bytes) -> str:
    """The Redis key of one block hash: ``pdserve:block:<hex>``."""
    return BLOCK_KEY_PREFIX + block_hash.hex()


class PrefixIndex:
    """Client of the prefix index, for the router and for workers' publishers.

    Args:
        redis_url: e.g. ``redis://127.0.0.1:6379/0``.
        socket_timeout_s: limit on each connect and each reply, seconds. A call fails
            after at most two attempts (one reconnect), so within ~2x this.

    Raises (every method):
        PrefixIndexUnavailable: Redis is unreachable or timed out.
    """

    def __init__(self, redis_url: str, *, socket_timeout_s: float = 0.5) -> None:
        self.redis_url = redis_url
        self._redis = redis.Redis.from_url(
            redis_url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 1), retry_on_timeout=False)

    def close(self) -> None:
        self._redis.close()

    def publish(self, worker_id: str, event: KVEvent) -> None:
        """Apply one KV event of ``worker_id`` (stored -> SADD, removed -> SREM), pipelined."""
        hashes = event.block_hashes
        if event.kind is KVEventKind.STORED:
            self.update(worker_id, added=hashes, removed=())
        else:
            self.update(worker_id, added=(), removed=hashes)

    def update(self, worker_id: str, added: Iterable[bytes], removed: Iterable[bytes]) -> str:
        """Add ``worker_id`` to the sets of ``added`` and remove it from those of
        ``removed``, in one pipelined round trip; return the index epoch (creating it if
        Redis has none: a new epoch means the index restarted empty)."""
        with self._unavailable_on_error():
            pipe = self._redis.pipeline(transaction=False)
            pipe.set(EPOCH_KEY, secrets.token_hex(8), nx=True)
            pipe.get(EPOCH_KEY)
            for h in added:
                pipe.sadd(block_key(h), worker_id)
            for h in removed:
                pipe.srem(block_key(h), worker_id)
            return pipe.execute()[1].decode()

    def republish(self, worker_id: str, hashes: Iterable[bytes]) -> None:
        """SADD ``worker_id`` for every hash it caches (after a Redis restart)."""
        self._in_chunks(worker_id, hashes, "sadd")

    def purge_worker(self, worker_id: str, hashes: Iterable[bytes]) -> None:
        """SREM ``worker_id`` from every given hash's set (a worker leaving cleanly)."""
        self._in_chunks(worker_id, hashes, "srem")

    def longest_prefix(self, hashes: Sequence[bytes], live_worker_ids: Collection[str], *,
                       clean_stale: bool = True) -> dict[str, int]:
        """For each live worker, how many leading blocks of the chain ``hashes`` it holds.

        One pipelined round trip of SMEMBERS over the chain. A worker's count stops at its
        first miss (block ``i`` is useless without blocks ``0..i-1``). Workers with no
        leading block are left out. Entries of workers not in ``live_worker_ids`` (lapsed
        heartbeats) are ignored and, with ``clean_stale``, removed (best effort, one more
        round trip). So pass every live worker of every role, read fresh from the registry
        (a worker missing from a stale list loses its entries until it republishes), and
        filter the result by role yourself. An empty live set cleans nothing.

        Example: sets ``h0:{A,B} h1:{A} h2:{A,B}`` -> ``{"A": 3, "B": 1}``.
        """
        if not hashes:
            return {}
        with self._unavailable_on_error():
            pipe = self._redis.pipeline(transaction=False)
            for h in hashes:
                pipe.smembers(block_key(h))
            members = [{m.decode() for m in found} for found in pipe.execute()]
        live = set(live_worker_ids)
        counts = _leading_runs(members, live)
        stale = [(h, found - live) for h, found in zip(hashes, members) if found - live]
        if stale and live and clean_stale:
            self._remove_stale(stale)
        return counts

    def _remove_stale(self, stale: list[tuple[bytes, set[str]]]) -> None:
        try:
            pipe = self._redis.pipeline(transaction=False)
            for h, workers in stale:
                pipe.srem(block_key(h), *workers)
            pipe.execute()
        except redis.RedisError as exc:  # the next lookup tries again
            logger.debug("prefix index: stale entries not removed: %s", exc)

    def _in_chunks(self, worker_id: str, hashes: Iterable[bytes], command: str) -> None:
        batch = list(hashes)
        with self._unavailable_on_error():
            for start in range(0, len(batch), _CHUNK):
                pipe = self._redis.pipeline(transaction=False)
                for h in batch[start:start + _CHUNK]:
                    getattr(pipe, command)(block_key(h), worker_id)
                pipe.execute()

    def _unavailable_on_error(self):
        return _unavailable_on_error(self.redis_url)


@contextlib.contextmanager
def _unavailable_on_error(redis_url: str) -> Iterator[None]:
    """Turns redis-py's connection and timeout errors into ``PrefixIndexUnavailable``."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise PrefixIndexUnavailable(f"prefix index at {redact_url(redis_url)}: {exc}") from exc


def _leading_runs(members: list[set[str]], live: set[str]) -> dict[str, int]:
    """``members[i]`` holds block ``i``'s workers -> each live worker's leading run length."""
    counts: dict[str, int] = {}
    running = members[0] & live
    for i, found in enumerate(members):
        for worker in running - found:
            counts[worker] = i
        running &= found
        if not running:
            return counts
    counts.update(dict.fromkeys(running, len(members)))
    return counts


class KVEventPublisher:
    """A worker's link to the prefix index: pass it as the block pool's
    ``kv_event_callback``.

    ``__call__`` only records the event (thread-safe, no I/O): it updates the worker's set
    of cached hashes and the pending changes, compacted per hash (a hash stored then
    removed before a flush sends one SREM). A daemon thread flushes the pending changes
    as they come (one write at a time: what arrives during a write goes in the next), and
    with nothing to send still writes (an empty update that reads the epoch)
    every ``probe_interval_s``, sleeping in between. While Redis is down, changes stay pending
    and the thread retries every ``retry_interval_s``; when a write reports a new epoch
    (Redis restarted empty), it republishes every cached hash.

    Args:
        redis_url: the index's Redis.
        worker_id: this worker's id in the registry.
        flush_interval_s, probe_interval_s, retry_interval_s, socket_timeout_s: seconds.
    """

    def __init__(self, redis_url: str, worker_id: str, *, flush_interval_s: float = 0.05,
                 probe_interval_s: float = 1.0, retry_interval_s: float = 0.5,
                 socket_timeout_s: float = 0.5) -> None:
        self.worker_id = worker_id
        self.index = PrefixIndex(redis_url, socket_timeout_s=socket_timeout_s)
        self.flush_interval_s = flush_interval_s
        self.probe_interval_s = probe_interval_s
        self.retry_interval_s = retry_interval_s
        self.available = False
        self.epoch: str | None = None
        self.num_republishes = 0
        self._cached: set[bytes] = set()
        self._to_add: set[bytes] = set()
        self._to_remove: set[bytes] = set()
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{worker_id}",
                                        daemon=True)
        self._thread.start()

    def __call__(self, event: KVEvent) -> None:
        """Record one KV event from the block pool (returns at once)."""
        with self._cond:
            for h in event.block_hashes:
                if event.kind is KVEventKind.STORED:
                    self._cached.add(h)
                    self._to_add.add(h)
                    self._to_remove.discard(h)
                else:
                    self._cached.discard(h)
                    self._to_remove.add(h)
                    self._to_add.discard(h)
            self._cond.notify_all()

    @property
    def cached_hashes(self) -> set[bytes]:
        """A copy of the hashes this worker currently caches, as told by its events."""
        with self._cond:
            return set(self._cached)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every change recorded so far is in Redis; False on timeout."""
        with self._cond:
            self._cond.notify_all()
            return self._cond.wait_for(
                lambda: self.available and not (self._to_add or self._to_remove or self._busy),
                timeout_s)

    def close(self, *, purge: bool = False, timeout_s: float = 2.0) -> None:
        """Flush, optionally remove this worker from every set (a clean shutdown), stop."""
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        if purge:
            try:
                self.index.purge_worker(self.worker_id, self.cached_hashes)
            except PrefixIndexUnavailable as exc:
                logger.warning("prefix index: purge of %s failed: %s", self.worker_id, exc)
        self.index.close()

    def _run(self) -> None:
        last_contact_s = float("-inf")
        while True:
            with self._cond:
                # NOTE: an event wakes the thread at once; with nothing to send it sleeps
                # until the next probe is due while Redis answers (an idle worker's thread
                # woke 20 times a second), else it polls every flush_interval_s
                wait_s = self.flush_interval_s if not self.available else max(
                    self.flush_interval_s,
                    last_contact_s + self.probe_interval_s - time.monotonic())
                self._cond.wait_for(lambda: self._closed or self._to_add or self._to_remove,
                                    wait_s)
                if self._closed:
                    return
                due = time.monotonic() - last_contact_s >= self.probe_interval_s
                if not (self._to_add or self._to_remove or due or not self.available):
                    continue
                added, self._to_add = self._to_add, set()
                removed, self._to_remove = self._to_remove, set()
                self._busy = True
            ok = self._send(added, removed)
            with self._cond:
                self._busy = False
                if ok:
                    last_contact_s = time.monotonic()
                else:
                    self._requeue(added, removed)
                self._cond.notify_all()
                if not ok:
                    self._cond.wait_for(lambda: self._closed, self.retry_interval_s)

    def _send(self, added: set[bytes], removed: set[bytes]) -> bool:
        """One write (which also reads the epoch); republish all on a new epoch."""
        try:
            epoch = self.index.update(self.worker_id, added, removed)
            if self.epoch is not None and epoch != self.epoch:
                self.index.republish(self.worker_id, self.cached_hashes)
                self.num_republishes += 1
                logger.info("prefix index: epoch %s -> %s, republished %s's blocks",
                            self.epoch, epoch, self.worker_id)
            self.epoch = epoch
        except PrefixIndexUnavailable as exc:
            if self.available:
                logger.warning("prefix index unavailable, keeping changes: %s", exc)
            self.available = False
            return False
        self.available = True
        return True

    def _requeue(self, added: set[bytes], removed: set[bytes]) -> None:
        """Put back changes that failed to send, unless a newer event superseded them."""
        self._to_add |= {h for h in added if h not in self._to_remove}
        self._to_remove |= {h for h in removed if h not in self._to_add}
