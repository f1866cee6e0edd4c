"""The Redis prefix index: which workers hold which prefix-cache blocks (docs/architecture.md,
Cluster state, Prefix index layout).

Layout (the durable copy; routers keep an in-memory copy, ``cluster/prefix_follower.py``):

- ``pdserve:kv:worker:<id>``: a set of the worker's block hashes, 16 binary bytes each
  (the snapshot);
- ``pdserve:kv:workers``: the ids that have such a set;
- ``pdserve:kv:events``: a stream of KV events, trimmed to about ``EVENTS_MAXLEN``
  entries, fields ``w`` (worker id), ``k`` (``s`` stored, ``r`` removed, ``a`` all: the
  worker holds exactly these), ``n`` (the worker's sequence number, +1 per entry, from
  ``pdserve:kv:seq``) and
  ``h`` (the hashes, packed, 16 bytes each);
- ``pdserve:kv:seq``: worker id -> the ``n`` of its last entry, so a router reading a set
  knows which of the worker's entries it already holds.

Each write is one MULTI/EXEC: the set changes and their stream entry land together, so
a router that notes the stream's last id, then reads the sets, then follows the stream
after that id is exact (adds and removes of a hash are last-writer-wins; replaying one
already in the snapshot changes nothing). A gap in a worker's sequence numbers (entries
trimmed before a router read them) makes the router read that worker's set again.

Workers publish their block pool's KV events through a ``KVEventPublisher``. Every write
also answers the size of the worker's set: when it differs from what the worker caches
(Redis restarted empty, or a router forgot the worker while its heartbeat lapsed) the
publisher republishes its whole set (``a``).

Restarts: ``pdserve:prefix_index:epoch`` holds a random token, created by the first writer
that finds it missing. A Redis that restarted empty has lost it, so each publisher sees a
new epoch on its next write and republishes every hash its worker still caches, and each
router reloads; a Redis that restarted from its own snapshot kept the epoch and the sets.

Needs Redis 6.2 or later (streams, SMISMEMBER). Every Redis call has a socket timeout and
at most one reconnect; when Redis is unreachable the router's lookups raise ``PrefixIndexUnavailable`` (it then routes by load alone) and
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

WORKER_KEY_PREFIX = "pdserve:kv:worker:"
WORKERS_KEY = "pdserve:kv:workers"
EVENTS_KEY = "pdserve:kv:events"
EPOCH_KEY = "pdserve:prefix_index:epoch"
SEQ_KEY = "pdserve:kv:seq"  # worker id -> the ``n`` of its last stream entry
EVENTS_MAXLEN = 20_000  # stream entries kept (approximately); a router behind re-reads sets
_CHUNK = 1024  # hashes per stream entry (16 KiB at most) and per SADD


# NOTE: the sequence number comes from Redis (HINCRBY), so every writer of a worker's
# entries (its publisher, a restarted one, a router forgetting it) continues one sequence
_ADD_EVENT = """
local n = redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[4], '*', 'w', ARGV[1], 'k', ARGV[2],
           'n', n, 'h', ARGV[3])
return n
"""


class PrefixIndexUnavailable(RuntimeError):
    """Redis did not answer (refused, reset or timed out); route by load alone."""


def worker_key(worker_id: str) -> str:
    """The Redis key of one worker's set of block hashes: ``pdserve:kv:worker:<id>``."""
    return WORKER_KEY_PREFIX + worker_id


class PrefixIndex:
    """Client of the prefix index in Redis, for workers' publishers, routers' followers
    (``LocalPrefixIndex``) and tests.

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
        """Apply one KV event of ``worker_id`` (stored -> SADD, removed -> SREM)."""
        hashes = event.block_hashes
        if event.kind is KVEventKind.STORED:
            self.update(worker_id, added=hashes, removed=())
        else:
            self.update(worker_id, added=(), removed=hashes)

    def update(self, worker_id: str, added: Iterable[bytes], removed: Iterable[bytes]) -> str:
        """Add ``added`` to and remove ``removed`` from ``worker_id``'s set, with their
        stream entries, in one transaction; return the index epoch (creating it if Redis
        has none: a new epoch means the index restarted empty)."""
        return self.write(worker_id, added, removed)[0]

    def write(self, worker_id: str, added: Iterable[bytes], removed: Iterable[bytes]
              ) -> tuple[str, int]:
        """``update``, returning ``(epoch, hashes now in the worker's set)``."""
        added, removed = list(added), list(removed)
        with self._unavailable_on_error():
            pipe = self._redis.pipeline(transaction=True)
            pipe.set(EPOCH_KEY, secrets.token_hex(8), nx=True)
            pipe.get(EPOCH_KEY)
            key = worker_key(worker_id)
            if added or removed:
                pipe.sadd(WORKERS_KEY, worker_id)
            for kind, hashes, command in (("s", added, pipe.sadd), ("r", removed, pipe.srem)):
                for start in range(0, len(hashes), _CHUNK):
                    command(key, *hashes[start:start + _CHUNK])
                    self._event(pipe, worker_id, kind, hashes[start:start + _CHUNK])
            pipe.scard(key)
            replies = pipe.execute()
            return replies[1].decode(), int(replies[-1])

    def republish(self, worker_id: str, hashes: Iterable[bytes]) -> None:
        """Replace ``worker_id``'s set by ``hashes`` (after a Redis restart, or when its
        set was forgotten), with an ``a`` entry so routers replace their copy too."""
        hashes = list(hashes)
        with self._unavailable_on_error():
            pipe = self._redis.pipeline(transaction=True)
            key = worker_key(worker_id)
            pipe.delete(key)
            pipe.sadd(WORKERS_KEY, worker_id)
            self._event(pipe, worker_id, "a", hashes[:_CHUNK])
            for start in range(0, len(hashes), _CHUNK):
                pipe.sadd(key, *hashes[start:start + _CHUNK])
                if start:
                    self._event(pipe, worker_id, "s", hashes[start:start + _CHUNK])
            pipe.execute()

    def purge_worker(self, worker_id: str, hashes: Iterable[bytes] = ()) -> None:
        """Remove ``worker_id`` from the index: its whole set (a worker leaving cleanly or
        gone), whatever ``hashes`` says (kept for callers that pass its cached hashes)."""
        del hashes
        self.forget_worker(worker_id)

    def forget_worker(self, worker_id: str) -> None:
        """Delete ``worker_id``'s set and tell the routers (an empty ``a`` entry)."""
        with self._unavailable_on_error():
            pipe = self._redis.pipeline(transaction=True)
            pipe.delete(worker_key(worker_id))
            pipe.srem(WORKERS_KEY, worker_id)
            self._event(pipe, worker_id, "a", [])
            pipe.execute()

    def longest_prefix(self, hashes: Sequence[bytes], live_worker_ids: Collection[str], *,
                       clean_stale: bool = True) -> dict[str, int]:
        """For each live worker, how many leading blocks of the chain ``hashes`` it holds,
        asked of Redis (one SMISMEMBER per live worker; routers ask their in-memory copy,
        ``LocalPrefixIndex``, instead).

        A worker's count stops at its first miss (block ``i`` is useless without blocks
        ``0..i-1``). Workers with no leading block are left out. With ``clean_stale`` and a
        non-empty live set, the sets of workers not in ``live_worker_ids`` (lapsed
        heartbeats) are deleted (best effort, one more round trip). So pass every live
        worker of every role, and filter the result by role yourself.

        Example: ``A: {h0, h1, h2}``, ``B: {h0, h2}`` -> ``{"A": 3, "B": 1}``.
        """
        live = sorted(set(live_worker_ids))
        if not hashes or not live:
            return {}
        with self._unavailable_on_error():
            pipe = self._redis.pipeline(transaction=False)
            for worker_id in live:
                pipe.smismember(worker_key(worker_id), list(hashes))
            if clean_stale:
                pipe.smembers(WORKERS_KEY)
            replies = pipe.execute()
        counts = {}
        for worker_id, held in zip(live, replies):
            run = next((i for i, h in enumerate(held) if not h), len(hashes))
            if run:
                counts[worker_id] = run
        if clean_stale:
            for stale in {m.decode() for m in replies[-1]} - set(live):
                with contextlib.suppress(PrefixIndexUnavailable, redis.RedisError):
                    self.forget_worker(stale)
        return counts

    def snapshot(self) -> tuple[str | None, bytes, list[str]]:
        """``(epoch, last stream id, ids of the workers with a set)``; read the sets after
        (``worker_sets``): the stream id is read first, so following the stream after it
        from there is exact."""
        with self._unavailable_on_error():
            pipe = self._redis.pipeline(transaction=True)
            pipe.get(EPOCH_KEY)
            pipe.xrevrange(EVENTS_KEY, count=1)
            pipe.smembers(WORKERS_KEY)
            epoch, last, members = pipe.execute()
        return (epoch.decode() if epoch else None, last[0][0] if last else b"0-0",
                sorted(m.decode() for m in members))

    def worker_sets(self, worker_ids: Sequence[str]) -> dict[str, tuple[set[bytes], int]]:
        """Each worker's set of hashes and the ``n`` of its last stream entry (0: none)
        as of that set, in one transaction."""
        with self._unavailable_on_error():
            pipe = self._redis.pipeline(transaction=True)
            for worker_id in worker_ids:
                pipe.smembers(worker_key(worker_id))
            pipe.hmget(SEQ_KEY, list(worker_ids)) if worker_ids else None
            replies = pipe.execute()
        seqs = replies[-1] if worker_ids else []
        return {w: (found, int(seq or 0))
                for w, found, seq in zip(worker_ids, replies, seqs)}

    def worker_hashes(self, worker_id: str) -> tuple[set[bytes], int]:
        """The hashes in ``worker_id``'s set now, and the ``n`` of its last entry."""
        return self.worker_sets([worker_id]).get(worker_id, (set(), 0))

    def epoch(self) -> str | None:
        """The index epoch, None when no writer has set it yet."""
        with self._unavailable_on_error():
            epoch = self._redis.get(EPOCH_KEY)
        return epoch.decode() if epoch else None

    def read_events(self, after: bytes, block_ms: int, count: int = 1000
                    ) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """Stream entries after id ``after``, waiting up to ``block_ms`` for the first.
        The client's socket timeout must exceed ``block_ms``."""
        with self._unavailable_on_error():
            reply = self._redis.xread({EVENTS_KEY: after}, count=count, block=block_ms)
        return reply[0][1] if reply else []

    def used_memory(self) -> int:
        """Redis's ``used_memory``, bytes."""
        with self._unavailable_on_error():
            return int(self._redis.info("memory")["used_memory"])

    def _event(self, pipe, worker_id: str, kind: str, hashes: list[bytes]) -> None:
        pipe.eval(_ADD_EVENT, 2, EVENTS_KEY, SEQ_KEY, worker_id, kind, b"".join(hashes),
                  EVENTS_MAXLEN)

    def _unavailable_on_error(self):
        return _unavailable_on_error(self.redis_url)


@contextlib.contextmanager
def _unavailable_on_error(redis_url: str) -> Iterator[None]:
    """Turns redis-py's connection and timeout errors into ``PrefixIndexUnavailable``."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise PrefixIndexUnavailable(f"prefix index at {redact_url(redis_url)}: {exc}") from exc


class KVEventPublisher:
    """A worker's link to the prefix index: pass it as the block pool's
    ``kv_event_callback``.

    ``__call__`` only records the event (thread-safe, no I/O): it updates the worker's set
    of cached hashes and the pending changes, compacted per hash (a hash stored then
    removed before a flush sends one SREM). A daemon thread sends the pending changes in
    one write at most every ``flush_interval_s`` (a decode batch fills a block almost
    every step: one write per step cost the worker, Redis and every router's follower
    CPU beside the engine; ``flush`` sends at once), and with nothing to send still
    writes (an empty update that reads the epoch and the size
    of the worker's set) every ``probe_interval_s``, sleeping in between. While Redis is
    down, changes stay pending and the thread retries every ``retry_interval_s``; when a
    write reports a new epoch (Redis restarted empty) or a set whose size is not what the
    worker caches (a router forgot it while its heartbeat lapsed), it republishes every
    cached hash.

    Args:
        redis_url: the index's Redis.
        worker_id: this worker's id in the registry.
        flush_interval_s: least time between two writes of changes, and the poll while
            Redis is down, seconds.
        probe_interval_s, retry_interval_s, socket_timeout_s: seconds.
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
        self._flush_now = False
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
            self._flush_now = True
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
        last_contact_s = last_write_s = float("-inf")
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
                # NOTE: changes within flush_interval_s of the last write go in one write
                self._cond.wait_for(lambda: self._closed or self._flush_now,
                                    last_write_s + self.flush_interval_s - time.monotonic())
                if self._closed:
                    return
                self._flush_now = False
                due = time.monotonic() - last_contact_s >= self.probe_interval_s
                if not (self._to_add or self._to_remove or due or not self.available):
                    continue
                added, self._to_add = self._to_add, set()
                removed, self._to_remove = self._to_remove, set()
                num_cached = len(self._cached)  # the set's size once this batch is in
                self._busy = True
            ok = self._send(added, removed, num_cached)
            with self._cond:
                self._busy = False
                if ok:
                    last_contact_s = time.monotonic()
                    if added or removed:
                        last_write_s = last_contact_s
                else:
                    self._requeue(added, removed)
                self._cond.notify_all()
                if not ok:
                    self._cond.wait_for(lambda: self._closed, self.retry_interval_s)

    def _send(self, added: set[bytes], removed: set[bytes], num_cached: int) -> bool:
        """One write (which also reads the epoch and the set's size); republish all on a
        new epoch or a set that lost or kept hashes it should not have."""
        try:
            epoch, num_held = self.index.write(self.worker_id, added, removed)
            if (self.epoch is not None and epoch != self.epoch) or num_held != num_cached:
                self.index.republish(self.worker_id, self.cached_hashes)
                self.num_republishes += 1
                logger.info("prefix index: epoch %s -> %s, %d of %d hashes held: "
                            "republished %s's blocks", self.epoch, epoch, num_held,
                            num_cached, self.worker_id)
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
