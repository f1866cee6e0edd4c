"""A router's in-memory copy of the prefix index (docs/architecture.md, Prefix index layout):
the native ``BlockIndex`` (``cluster/block_index.py``), loaded from the Redis snapshot and
kept current by following the KV event stream (``cluster/prefix_index.py``) on a thread.

Lookups never touch Redis: they cost O(chain length x capacity / 64) in C++, however many
workers hold a block. Workers are small-integer slots, given on first sight and taken
back when a worker is forgotten (``forget``, ``retain``).

Catching up: ``snapshot`` (the stream's last id, then every worker's set), then the
stream after that id (``XREAD BLOCK``, bounded). An entry ``a`` replaces a worker's
blocks; a gap in a worker's sequence numbers re-reads its set. A new epoch (Redis
restarted empty), or an outage (entries may have been trimmed meanwhile), reloads all.
While Redis is unreachable, or before the first load, lookups raise
``PrefixIndexUnavailable`` (the router routes by load alone), as ``PrefixIndex`` does.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Collection, Sequence

import numpy as np

from pdserve.cluster import block_index
from pdserve.cluster.prefix_index import PrefixIndex, PrefixIndexUnavailable

logger = logging.getLogger(__name__)

DEFAULT_CAPACITY = 4096  # worker slots; more workers than this are not indexed (logged)


class LocalPrefixIndex:
    """The router's prefix index: an in-memory copy that follows Redis.

    Args:
        redis_url: the index's Redis.
        capacity: worker slots (a bitmap of a popular block is ``capacity / 8`` bytes).
        block_s: longest wait of one stream read, seconds (also how often the epoch is
            checked while idle).
        retry_interval_s: wait between tries while Redis is unreachable, seconds.
        socket_timeout_s: limit on each other Redis reply, seconds.
        start: start the follower thread now (else call ``start()``).

    Raises:
        RuntimeError, OSError, ImportError: the native extension could not be built.
    """

    _instances = itertools.count()

    def __init__(self, redis_url: str, *, capacity: int = DEFAULT_CAPACITY,
                 block_s: float = 0.5, retry_interval_s: float = 0.5,
                 socket_timeout_s: float = 0.5, start: bool = True) -> None:
        self.redis_url = redis_url
        self.capacity = capacity
        self.block_s = block_s
        self.retry_interval_s = retry_interval_s
        self.available = False
        self.num_reloads = 0
        # NOTE: bumped whenever a worker gets or gives back a slot; routers re-read
        # their workers' slots (slot_of) when it changed, not on a timer. The instance
        # number tells two indexes apart where id() may not (a freed one's address reused)
        self.slots_version = 0
        self.instance = next(LocalPrefixIndex._instances)
        self._client = PrefixIndex(redis_url, socket_timeout_s=socket_timeout_s + block_s)
        self._index = block_index.new_block_index(capacity)
        self._slots: dict[str, int] = {}
        self._ids: list[str | None] = [None] * capacity
        self._free = list(range(capacity - 1, -1, -1))
        self._seq: dict[str, int] = {}
        self._absent_since: dict[str, float] = {}
        self._to_forget: list[str] = []
        self._epoch: str | None = None
        self._last_id = b"0-0"
        self._lock = threading.Lock()  # the slot maps; the native index holds the GIL
        self._closed = threading.Event()
        self._loaded = threading.Event()
        self._full_logged = False
        self._thread = threading.Thread(target=self._run, name="prefix-index-follower",
                                        daemon=True)
        if start:
            self.start()

    def start(self) -> None:
        """Start following Redis (idempotent)."""
        if not self._thread.is_alive() and not self._closed.is_set():
            self._thread.start()

    def wait_loaded(self, timeout_s: float = 5.0) -> bool:
        """Wait until the first snapshot is in; False on timeout."""
        return self._loaded.wait(timeout_s)

    def close(self) -> None:
        """Stop the follower thread (within ``block_s``) and close the client."""
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join(self.block_s + 2 * self.retry_interval_s + 1.0)
        self._client.close()

    def slot_of(self, worker_id: str) -> int | None:
        """The worker's slot, None when it has no blocks indexed. A slot given or freed
        bumps ``slots_version`` (read it first, then the slots)."""
        return self._slots.get(worker_id)

    def lookup_slots(self, packed_hashes: bytes) -> np.ndarray:
        """Leading blocks of the chain held per slot, int32 ``[capacity]``.

        Raises:
            PrefixIndexUnavailable: Redis is unreachable or the copy is not loaded yet.
        """
        if not self.available:
            raise PrefixIndexUnavailable(f"prefix index at {self.redis_url} not followed")
        return self._index.lookup(packed_hashes)

    def lookup_prompt(self, token_ids, block_size: int, root_hash: bytes,
                      cache_salt: str | None = None) -> tuple[int, np.ndarray]:
        """``lookup_slots`` of a prompt's chain from its tokens (ints): (its full blocks,
        leading blocks held per slot, int32 ``[capacity]``), hashing at most one block past
        the first that no slot continues to.

        Raises:
            PrefixIndexUnavailable: Redis is unreachable or the copy is not loaded yet.
        """
        if not self.available:
            raise PrefixIndexUnavailable(f"prefix index at {self.redis_url} not followed")
        salt = cache_salt.encode() if cache_salt else b""
        return self._index.lookup_tokens(token_ids, block_size, root_hash, salt)

    def longest_prefix(self, hashes: Sequence[bytes] | bytes,
                       live_worker_ids: Collection[str], *, clean_stale: bool = True
                       ) -> dict[str, int]:
        """As ``PrefixIndex.longest_prefix``, from memory: live worker id -> leading blocks
        of ``hashes`` (a list of 16-byte hashes, or them packed) it holds; workers with
        none are left out. With ``clean_stale``, workers missing from a non-empty
        ``live_worker_ids`` are forgotten (``retain``).

        Raises:
            PrefixIndexUnavailable: Redis is unreachable or the copy is not loaded yet.
        """
        packed = hashes if isinstance(hashes, bytes) else b"".join(hashes)
        if not packed:
            return {}
        counts = self.lookup_slots(packed)
        if clean_stale and live_worker_ids:
            self.retain(live_worker_ids)
        live = live_worker_ids if isinstance(live_worker_ids, (set, frozenset, dict)) \
            else set(live_worker_ids)
        ids = self._ids
        return {ids[s]: int(counts[s]) for s in np.flatnonzero(counts) if ids[s] in live}

    def retain(self, live_worker_ids: Collection[str], grace_s: float = 0.0) -> list[str]:
        """Forget the workers not in ``live_worker_ids`` for ``grace_s`` seconds or more
        (a worker gone from the registry); returns those forgotten."""
        now = time.monotonic()
        gone = []
        with self._lock:
            known = list(self._slots)
        for worker_id in known:
            if worker_id in live_worker_ids:
                self._absent_since.pop(worker_id, None)
            elif now - self._absent_since.setdefault(worker_id, now) >= grace_s:
                gone.append(worker_id)
        for worker_id in gone:
            self.forget(worker_id)
        return gone

    def forget(self, worker_id: str) -> None:
        """Drop ``worker_id``'s blocks here now, and its set in Redis from the follower
        thread (within ``block_s``; best effort: a worker still alive republishes at its
        next probe). Never blocks on Redis."""
        self._drop(worker_id)
        self._absent_since.pop(worker_id, None)
        with self._lock:
            self._to_forget.append(worker_id)

    def _forget_in_redis(self) -> None:
        with self._lock:
            workers, self._to_forget = self._to_forget, []
        for worker_id in workers:
            try:
                self._client.forget_worker(worker_id)
            except PrefixIndexUnavailable as exc:
                logger.debug("prefix index: %s not forgotten in Redis: %s", worker_id, exc)

    def num_blocks(self, worker_id: str) -> int:
        """Blocks indexed for ``worker_id``."""
        slot = self._slots.get(worker_id)
        return 0 if slot is None else int(self._index.num_blocks(slot))

    def _slot(self, worker_id: str) -> int | None:
        with self._lock:
            slot = self._slots.get(worker_id)
            if slot is None and self._free:
                slot = self._slots[worker_id] = self._free.pop()
                self._ids[slot] = worker_id
                self.slots_version += 1
            elif slot is None and not self._full_logged:
                self._full_logged = True
                logger.warning("prefix index: more than %d workers; %s is not indexed",
                               self.capacity, worker_id)
            return slot

    def _drop(self, worker_id: str) -> None:
        with self._lock:
            if worker_id in self._slots:
                self._drop_locked(worker_id)

    def _run(self) -> None:
        reload = True
        last_epoch_check = 0.0
        while not self._closed.is_set():
            try:
                if reload:
                    self._reload()
                    reload, last_epoch_check = False, time.monotonic()
                if self._to_forget:
                    self._forget_in_redis()
                for entry_id, fields in self._client.read_events(
                        self._last_id, int(self.block_s * 1000)):
                    self._apply(fields)
                    self._last_id = entry_id
                if time.monotonic() - last_epoch_check >= self.block_s:
                    last_epoch_check = time.monotonic()
                    reload = self._client.epoch() != self._epoch
            except PrefixIndexUnavailable as exc:
                if self.available:
                    logger.warning("prefix index unreachable, routing by load: %s", exc)
                self.available, reload = False, True
                self._closed.wait(self.retry_interval_s)
            except Exception:  # NOTE: a bad entry must not stop the follower
                logger.exception("prefix index follower failed; reloading")
                self.available, reload = False, True
                self._closed.wait(self.retry_interval_s)

    def _reload(self) -> None:
        """Replace the copy by Redis's snapshot (the sets read a few workers at a time)."""
        epoch, last_id, workers = self._client.snapshot()
        listed = set(workers)
        with self._lock:
            for worker_id in list(self._slots):
                if worker_id not in listed:
                    self._drop_locked(worker_id)
        for start in range(0, len(workers), 16):
            for worker_id, (hashes, seq) in self._client.worker_sets(
                    workers[start:start + 16]).items():
                self._replace(worker_id, hashes)
                self._seq[worker_id] = seq
        self._epoch, self._last_id = epoch, last_id
        self.num_reloads += 1
        self.available = True
        self._loaded.set()
        logger.info("prefix index loaded: %d workers, %d block hashes", len(workers),
                    self._index.num_hashes())

    def _drop_locked(self, worker_id: str) -> None:
        slot = self._slots.pop(worker_id)
        self._seq.pop(worker_id, None)
        self._index.remove_slot(slot)
        self._ids[slot] = None
        self._free.append(slot)
        self.slots_version += 1

    def _replace(self, worker_id: str, hashes) -> None:
        slot = self._slot(worker_id)
        if slot is not None:
            self._index.replace(slot, b"".join(hashes))

    def _apply(self, fields: dict[bytes, bytes]) -> None:
        """One stream entry: ``w`` worker, ``k`` kind, ``n`` sequence, ``h`` hashes."""
        worker_id, kind = fields[b"w"].decode(), fields[b"k"]
        seq, packed = int(fields[b"n"]), fields[b"h"]
        last = self._seq.get(worker_id, 0)
        if seq <= last:
            return  # NOTE: already in the set this copy read with ``last``
        if kind == b"a" and not packed:
            self._drop(worker_id)  # forgotten: its slot is free again
            return
        if kind == b"r" and worker_id not in self._slots:
            return
        if kind == b"a":
            self._replace(worker_id, [packed])
        elif seq != last + 1:
            # NOTE: entries of this worker were missed (trimmed, or a writer that failed
            # midway): its set now, then the stream on from there, is exact
            hashes, seq = self._client.worker_hashes(worker_id)
            self._replace(worker_id, hashes)
            self._seq[worker_id] = seq
            return
        slot = self._slot(worker_id)
        if slot is None:
            return
        if kind == b"s":
            self._index.add(slot, packed)
        elif kind == b"r":
            self._index.remove(slot, packed)
        self._seq[worker_id] = seq
