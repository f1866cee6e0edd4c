"""The Redis worker registry: who serves, where, and whether it is alive (docs/architecture.md,
Cluster state).

Layout, per worker id:

- ``pdserve:worker:<id>``: the ``WorkerRecord`` as JSON (expires after ``record_ttl_s``
  unless refreshed, so records of workers that vanished are cleaned up eventually);
- ``pdserve:heartbeat:<id>``: the worker's epoch, with a short TTL (``heartbeat_ttl_s``)
  that a daemon thread refreshes every ``heartbeat_interval_s``;
- ``pdserve:workers``: the set of registered ids.

A worker is live while its heartbeat key exists. The heartbeat thread refreshes with
``SET ... XX`` (only if present); when the key or the record has gone (Redis restarted
empty, or the worker's heartbeats lapsed while Redis was unreachable) it registers again.
Every Redis call has socket timeouts and at most one reconnect.

With a ``ClusterAuth``, a record is stored signed (``{"record": <canonical JSON>,
"signature": <hex HMAC>}``) and ``list_live`` ignores, with a warning, every record it
cannot verify: one written by someone without the cluster secret gets no traffic.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pdserve.cluster.auth import redact_url

if TYPE_CHECKING:
    from pdserve.cluster.auth import ClusterAuth

logger = logging.getLogger(__name__)

WORKERS_KEY = "pdserve:workers"
ROLES = ("prefill", "decode")


def record_key(worker_id: str) -> str:
    return f"pdserve:worker:{worker_id}"


def heartbeat_key(worker_id: str) -> str:
    return f"pdserve:heartbeat:{worker_id}"


class RegistryUnavailable(RuntimeError):
    """Redis did not answer (refused, reset or timed out)."""


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """One worker incarnation.

    ``epoch`` grows with each start of a worker id (``new`` uses unix microseconds), so a
    record with a higher epoch belongs to a newer incarnation; ``started_at`` is unix
    seconds. Addresses are ``host:port``. ``compute`` says what the worker computes on
    (``compute_placement``), so the router can tell whether a prefill worker and a decode
    worker share hardware; "" when unknown. ``metrics_address`` is where its Prometheus
    ``/metrics`` answers ("" when it serves none).
    """

    worker_id: str
    role: str
    grpc_address: str
    kv_address: str
    epoch: int
    model: str
    started_at: float
    compute: str = ""
    metrics_address: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role={self.role!r} must be one of {ROLES}")

    @classmethod
    def new(cls, worker_id: str, role: str, grpc_address: str, kv_address: str,
            model: str) -> WorkerRecord:
        """A record for a worker starting now."""
        now = time.time()
        return cls(worker_id, role, grpc_address, kv_address, int(now * 1e6), model, now)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerRecord:
        """Raises ValueError (or TypeError) on a malformed record."""
        return cls(**json.loads(text))


class WorkerRegistry:
    """A client of the registry: a worker registers itself, the router lists live ones.

    Args:
        redis_url: e.g. ``redis://127.0.0.1:6379/0``.
        heartbeat_ttl_s: seconds a heartbeat lives without a refresh.
        heartbeat_interval_s: seconds between refreshes (well under the TTL).
        record_ttl_s: seconds a record outlives its last refresh.
        socket_timeout_s: limit on each connect and each reply, seconds.
        auth: the cluster's secret: records are written signed and only verified ones
            are listed. None: plain records (a cluster without authentication).

    Raises (``list_live``):
        RegistryUnavailable: Redis is unreachable or timed out.
    """

    def __init__(self, redis_url: str, *, heartbeat_ttl_s: float = 3.0,
                 heartbeat_interval_s: float = 1.0, record_ttl_s: float = 86400.0,
                 socket_timeout_s: float = 0.5, auth: ClusterAuth | None = None) -> None:
        if not 0 < heartbeat_interval_s < heartbeat_ttl_s:
            raise ValueError("heartbeat_interval_s must be in (0, heartbeat_ttl_s)")
        self.redis_url = redis_url
        self.auth = auth
        self.rejected_ids: set[str] = set()  # ids whose record the last listing ignored
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.record_ttl_s = record_ttl_s
        self._redis = redis.Redis.from_url(
            redis_url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 1), retry_on_timeout=False)
        self._lock = threading.Lock()
        self._record: WorkerRecord | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.num_registrations = 0  # writes of the whole record (first and re-registrations)
        self.heartbeat_ok = False  # did the last heartbeat reach Redis

    @property
    def record(self) -> WorkerRecord | None:
        """The record this registry keeps alive, if any."""
        return self._record

    def register(self, record: WorkerRecord) -> None:
        """Write ``record`` and keep its heartbeat alive from a daemon thread until
        ``deregister`` / ``stop_heartbeat`` / ``close``. If Redis is down now, the thread
        registers once it answers.

        Raises:
            RuntimeError: this registry already keeps another record alive.
        """
        with self._lock:
            if self._thread is not None:
                raise RuntimeError(f"already registered as {self._record.worker_id}")
            self._record = record
            self._stop.clear()
            self._beat()
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name=f"registry-heartbeat-{record.worker_id}")
            self._thread.start()

    def update(self, record: WorkerRecord) -> None:
        """Keep ``record`` alive instead of the one registered (the same worker id and
        epoch, a field changed: its ``compute`` after its CPUs were re-split) and write it
        now.

        Raises:
            RuntimeError: no record is kept alive, or ``record`` is another worker's.
            redis.RedisError: Redis did not take it (the old record stays there).
        """
        with self._lock:
            if self._record is None or self._record.worker_id != record.worker_id:
                raise RuntimeError(f"{record.worker_id} is not the worker registered here")
            self._record = record
            self._write(record, int(self.heartbeat_ttl_s * 1000), int(self.record_ttl_s * 1000))

    def stop_heartbeat(self) -> None:
        """Stop refreshing the heartbeat (the worker lapses within ``heartbeat_ttl_s``)
        but leave the record; e.g. a worker draining before exit."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join(timeout=self.heartbeat_interval_s + 5.0)

    def deregister(self) -> None:
        """Stop the heartbeat and delete the record now (best effort if Redis is down)."""
        self.stop_heartbeat()
        record, self._record = self._record, None
        if record is None:
            return
        try:
            pipe = self._redis.pipeline(transaction=False)
            pipe.delete(heartbeat_key(record.worker_id), record_key(record.worker_id))
            pipe.srem(WORKERS_KEY, record.worker_id)
            pipe.execute()
        except redis.RedisError as exc:
            logger.warning("registry: %s not deregistered (its heartbeat lapses): %s",
                           record.worker_id, exc)

    def list_live(self, role: str | None = None) -> list[WorkerRecord]:
        """Records of workers whose heartbeat is alive, by worker id; only ``role``'s if
        given. Two pipelined round trips; ids whose record expired are dropped from
        the set.

        Raises:
            RegistryUnavailable: Redis is unreachable or timed out.
        """
        try:
            ids = sorted(m.decode() for m in self._redis.smembers(WORKERS_KEY))
            pipe = self._redis.pipeline(transaction=False)
            for worker_id in ids:
                pipe.exists(heartbeat_key(worker_id))
                pipe.get(record_key(worker_id))
            replies = pipe.execute()
        except redis.RedisError as exc:
            raise RegistryUnavailable(f"worker registry at {redact_url(self.redis_url)}: "
                                      f"{exc}") from exc
        live, gone, rejected = [], [], set()
        for worker_id, alive, raw in zip(ids, replies[::2], replies[1::2], strict=True):
            if raw is None:
                gone.append(worker_id)
                continue
            record = self._parse(worker_id, raw)
            if record is None:
                rejected.add(worker_id)
            elif alive and (role is None or record.role == role):
                live.append(record)
        self.rejected_ids = rejected
        if gone:
            with contextlib.suppress(redis.RedisError):  # the next listing tries again
                self._redis.srem(WORKERS_KEY, *gone)
        return live

    def close(self) -> None:
        """Stop the heartbeat (without deregistering) and close connections."""
        self.stop_heartbeat()
        self._redis.close()

    def _run(self) -> None:
        while not self._stop.wait(self.heartbeat_interval_s):
            self._beat()

    def _beat(self) -> None:
        """Refresh the heartbeat and the record's TTL; register again if either is gone."""
        record = self._record
        if record is None:
            return
        ttl_ms, record_ttl_ms = int(self.heartbeat_ttl_s * 1000), int(self.record_ttl_s * 1000)
        try:
            pipe = self._redis.pipeline(transaction=False)
            pipe.set(heartbeat_key(record.worker_id), record.epoch, px=ttl_ms, xx=True)
            pipe.pexpire(record_key(record.worker_id), record_ttl_ms)
            refreshed, kept = pipe.execute()
            if not (refreshed and kept):
                self._write(record, ttl_ms, record_ttl_ms)
        except redis.RedisError as exc:
            if self.heartbeat_ok:
                logger.warning("registry: heartbeat of %s failed, retrying: %s",
                               record.worker_id, exc)
            self.heartbeat_ok = False
            return
        self.heartbeat_ok = True

    def _write(self, record: WorkerRecord, ttl_ms: int, record_ttl_ms: int) -> None:
        pipe = self._redis.pipeline(transaction=True)
        pipe.set(record_key(record.worker_id), self._encode(record), px=record_ttl_ms)
        pipe.sadd(WORKERS_KEY, record.worker_id)
        pipe.set(heartbeat_key(record.worker_id), record.epoch, px=ttl_ms)
        pipe.execute()
        self.num_registrations += 1
        logger.info("registry: registered %s (%s, epoch %d)", record.worker_id, record.role,
                    record.epoch)


    def _encode(self, record: WorkerRecord) -> str:
        payload = record.to_json()
        if self.auth is None:
            return payload
        return json.dumps({"record": payload, "signature": self.auth.sign_record(payload)})

    def _parse(self, worker_id: str, raw: bytes) -> WorkerRecord | None:
        """The record stored for ``worker_id``; None (logged once per id) if it is
        malformed, unsigned or forged, or names another worker id."""
        try:
            if self.auth is None:
                record = WorkerRecord.from_json(raw)
            else:
                envelope = json.loads(raw)
                payload, signature = envelope["record"], envelope["signature"]
                if not isinstance(payload, str) or not isinstance(signature, str):
                    raise ValueError("malformed signed record")
                if not self.auth.verify_record(payload, signature):
                    raise ValueError("its signature does not verify with this cluster's "
                                     "secret (forged, or another cluster's)")
                record = WorkerRecord.from_json(payload)
            if record.worker_id != worker_id:
                raise ValueError(f"it names worker {record.worker_id!r}")
        except (ValueError, TypeError, KeyError) as exc:
            if worker_id not in self.rejected_ids:  # NOTE: once while it stays rejected
                logger.warning("registry: record of %s ignored: %s", worker_id,
                               str(exc) if not isinstance(exc, KeyError)
                               else f"not signed (no {exc})")
            return None
        return record
