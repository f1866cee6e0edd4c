"""The router's view of the workers: who is live (the Redis registry) and how loaded
each is (their ``Health`` RPC), refreshed in the background; and whether a worker whose
call has gone silent is alive (``WorkerPool.is_alive``, ``WorkerPool.watched``)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from pdserve.cluster.registry import RegistryUnavailable, WorkerRecord, WorkerRegistry
from pdserve.proto import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
from pdserve.router.route import RoleArrays, Router, RouteSettings
from pdserve.router.routing_policy import WorkerLoad
from pdserve.router.session import DecodeSession, rpc_error

if TYPE_CHECKING:
    from pdserve.router.config import RouterConfig
    from pdserve.router.metrics import RouterMetrics

logger = logging.getLogger(__name__)


class WorkerHandle:
    """A live worker: its record, gRPC stub, and the load its last Health gave.

    ``load``, ``healthy``, ``num_routed``, ``num_inflight`` and ``num_inflight_at_health``
    write through to the pool's routing arrays (``router/route.py``'s ``RoleArrays``)
    once the pool has placed the worker there (``bind``): the request path scores those
    arrays, never the handles. ``num_routed`` is read back from them (a decision counts
    itself there)."""

    __slots__ = ("_arrays", "_healthy", "_i", "_inflight_peak", "_load", "_num_inflight",
                 "_num_inflight_at_health", "_num_routed", "channel", "probe", "record",
                 "session", "stub")

    def __init__(self, record: WorkerRecord, channel: grpc.aio.Channel, stub: object,
                 load: WorkerLoad, healthy: bool = False, num_routed: int = 0,
                 num_inflight: int = 0, num_inflight_at_health: int = 0) -> None:
        self.record = record
        self.channel = channel
        self.stub = stub
        # a decode worker's stream of this router's requests
        self.session: DecodeSession | None = None
        self.probe: asyncio.Task | None = None  # the is_alive probe under way, shared
        self._arrays: RoleArrays | None = None
        self._i = 0
        self._load = load
        self._healthy = healthy  # False until its first Health answers "ok"
        self._num_routed = num_routed  # requests routed here since that Health answer
        self._num_inflight = num_inflight  # this router's calls on it now
        self._num_inflight_at_health = num_inflight_at_health  # the same at that Health
        self._inflight_peak = num_inflight  # the most in flight since start_health_window

    def bind(self, arrays: RoleArrays | None, i: int = 0) -> None:
        """Write through to position ``i`` of ``arrays`` from now on (None: to nothing),
        copying this worker's state there."""
        routed = self.num_routed
        self._arrays, self._i = arrays, i
        self.load, self.healthy, self.num_routed = self._load, self._healthy, routed
        self.num_inflight = self._num_inflight
        self.num_inflight_at_health = self._num_inflight_at_health

    @property
    def load(self) -> WorkerLoad:
        """The load its last Health gave."""
        return self._load

    @load.setter
    def load(self, load: WorkerLoad) -> None:
        self._load = load
        if self._arrays is not None:
            t, i = self._arrays.table, self._i
            t[RoleArrays.KV, i] = load.kv_cache_usage
            t[RoleArrays.RUNNING, i] = load.num_running
            t[RoleArrays.WAITING, i] = load.num_waiting
            self._arrays.update_others(i)

    @property
    def healthy(self) -> bool:
        """Routed to: its last Health answered "ok" and no call failed since."""
        return self._healthy

    @healthy.setter
    def healthy(self, healthy: bool) -> None:
        self._healthy = healthy
        if self._arrays is not None:
            self._arrays.healthy[self._i] = healthy

    @property
    def num_routed(self) -> int:
        """Requests routed here since its last Health answer."""
        if self._arrays is not None:
            return int(self._arrays.routed[self._i])
        return self._num_routed

    @num_routed.setter
    def num_routed(self, num_routed: int) -> None:
        self._num_routed = num_routed
        if self._arrays is not None:
            self._arrays.routed[self._i] = num_routed

    @property
    def num_inflight(self) -> int:
        """This router's Prefill calls (or Decode streams) on it now."""
        return self._num_inflight

    @num_inflight.setter
    def num_inflight(self, num_inflight: int) -> None:
        self._num_inflight = num_inflight
        self._inflight_peak = max(self._inflight_peak, num_inflight)
        if self._arrays is not None:
            self._arrays.inflight[self._i] = num_inflight

    def start_health_window(self) -> None:
        """A Health call to this worker starts: from now on ``health_window_peak`` is
        the most this router had in flight on it."""
        self._inflight_peak = self._num_inflight

    @property
    def health_window_peak(self) -> int:
        """The most Prefill calls (or Decode streams) this router had in flight on the
        worker since ``start_health_window``: the worker's running + waiting, read at
        any moment in between, holds at most that many of this router's sequences (each
        counted here before it is sent and until its reply is back)."""
        return self._inflight_peak

    @property
    def num_inflight_at_health(self) -> int:
        """The most ``num_inflight`` while its last Health call was under way."""
        return self._num_inflight_at_health

    @num_inflight_at_health.setter
    def num_inflight_at_health(self, value: int) -> None:
        self._num_inflight_at_health = value
        if self._arrays is not None:
            self._arrays.inflight_at_health[self._i] = value
            self._arrays.update_others(self._i)

    @property
    def worker_id(self) -> str:
        """The worker's id."""
        return self.record.worker_id

    def current_load(self) -> WorkerLoad:
        """The reported load, with requests routed since the report counted as waiting
        (so a burst between two polls is spread, not sent to one worker)."""
        return dataclasses.replace(self.load, num_waiting=self.load.num_waiting + self.num_routed)

    def admission_count(self) -> int:
        """Sequences that count against this worker's admission cap, in sequences: this
        router's in flight now (exact) plus the other routers' as its last Health saw them
        (its running + waiting less the most this router had in flight on it during that
        call, at least 0: with one router, never more than 0). Router
        replicas never talk to each other: what another admitted since that Health is
        unseen here for at most one health interval."""
        others = self.load.num_running + self.load.num_waiting - self.num_inflight_at_health
        return self.num_inflight + max(0, others)


_STUBS = {"prefill": prefill_pb2_grpc.PrefillWorkerStub,
          "decode": decode_pb2_grpc.DecodeWorkerStub}
_SERVICES = {"prefill": "/pdserve.v1.PrefillWorker/", "decode": "/pdserve.v1.DecodeWorker/"}
_ALIVE = ("ok", "draining")  # Health statuses of a worker that still runs its requests


class WorkerPool:
    """The live workers of each role (from the registry) and their loads (from Health).

    ``run()`` refreshes both until cancelled. The registry discovers workers; Health
    decides who stays: a worker leaves the pool once it is gone from the registry and its
    Health no longer answers "ok" (dead, draining). So while Redis is unreachable, or just
    restarted empty, the last known workers keep serving (logged once per outage). Only
    the workers of the router's model (their record's ``model``, the served model name)
    join: one registry serves every model of a cluster."""

    def __init__(self, registry: WorkerRegistry, config: RouterConfig,
                 metrics: RouterMetrics | None = None) -> None:
        self.registry = registry
        self.config = config
        self.metrics = metrics
        self.workers: dict[str, dict[str, WorkerHandle]] = {"prefill": {}, "decode": {}}
        self.registry_down = False
        self._retired: list[grpc.aio.Channel] = []
        # NOTE: called with a worker's id when it leaves the pool (the prefix index
        # forgets its blocks)
        self.on_worker_removed: Callable[[str], None] | None = None
        # NOTE: called with the ids of every live worker, all models, at each registry
        # read (the prefix index forgets workers that died before this router saw them)
        self.on_registry_read: Callable[[set[str]], None] | None = None
        self._refresh_lock = asyncio.Lock()
        # NOTE: the routing arrays of the members (router/route.py), rebuilt when they
        # change; slot_index gives their prefix index slots (None: route by load)
        self.slot_index = None
        self.root_hash = b""
        self._rotation = {"prefill": itertools.count(), "decode": itertools.count()}
        self.router = self._new_router()

    def _new_router(self) -> Router:
        """A ``Router`` over the current members, every handle bound to its arrays (the
        tie rotation goes on where the last one stopped)."""
        computes = {role: {i: w.record.compute for i, w in known.items()}
                    for role, known in self.workers.items()}
        router = Router(RouteSettings.from_config(self.config), self.slot_index,
                        self.root_hash, computes["prefill"], computes["decode"],
                        rotation=self._rotation)
        for role, known in self.workers.items():
            arrays = router.prefill if role == "prefill" else router.decode
            for worker_id, worker in known.items():
                worker.bind(arrays, arrays.position[worker_id])
        return router

    def members_changed(self) -> None:
        """Rebuild the routing arrays: a worker joined or left, or its record (its
        placement) changed. O(pool); the decisions after it are O(candidates)."""
        self.router = self._new_router()

    def credentials(self, worker: WorkerHandle, rpc: str, request):
        """gRPC metadata proving the cluster secret for one call of ``rpc`` ("Prefill")
        on ``worker`` with ``request`` (None for a stream of requests); None in a cluster
        without authentication. Single-use: mint one per call, retries included."""
        auth = self.config.auth
        if auth is None:
            return None
        return auth.rpc_metadata(_SERVICES[worker.record.role] + rpc, request)

    def session(self, worker: WorkerHandle) -> DecodeSession:
        """The decode session of this router to the decode worker ``worker``; its
        requests have no deadline while ``is_alive(worker)`` (``router/session.py``)."""
        if worker.session is None:
            worker.session = DecodeSession(
                worker.stub, lambda: self.credentials(worker, "DecodeSession", None),
                worker.worker_id, self.config.stall_interval_s, lambda: self.is_alive(worker))
        return worker.session

    async def is_alive(self, worker: WorkerHandle) -> bool:
        """Whether ``worker``, whose call has been silent for a stall interval, is alive:
        True at its first Health answer that says it still runs its requests (``ok`` or
        ``draining``); False, and the worker is marked unhealthy, when
        ``health_failure_threshold`` calls in a row (``health_timeout_s`` each, one
        ``health_interval_s`` apart) get no answer, or it answers ``stopped`` (its engine
        is gone). Bounded: a worker alive but never answering Health is dead. One probe
        per worker at a time: concurrent callers share it. Counted in
        ``pdserve:stall_probes`` (``role``, ``result``)."""
        if worker.probe is None or worker.probe.done():
            worker.probe = asyncio.get_running_loop().create_task(self._probe(worker))
        return await asyncio.shield(worker.probe)

    async def _probe(self, worker: WorkerHandle) -> bool:
        config = self.config
        for attempt in range(config.health_failure_threshold):
            if attempt:
                await asyncio.sleep(config.health_interval_s)
            try:
                health = common_pb2.HealthRequest()
                reply = await worker.stub.Health(
                    health, timeout=config.health_timeout_s,
                    metadata=self.credentials(worker, "Health", health))
            except grpc.aio.AioRpcError as exc:
                logger.info("%s worker %s: Health %d/%d failed: %s", worker.record.role,
                            worker.worker_id, attempt + 1, config.health_failure_threshold,
                            exc.code().name)
                continue
            alive = reply.status in _ALIVE
            break
        else:
            alive = False
        if self.metrics is not None:
            self.metrics.record_stall_probe(worker.record.role, alive)
        if not alive:
            self.mark_unhealthy(worker.worker_id)
        return alive

    async def watched(self, worker: WorkerHandle, call):
        """The answer of ``call``, a unary gRPC call to ``worker`` made without a
        deadline: each ``stall_interval_s`` without it, ``is_alive(worker)`` is asked;
        a dead worker's call is cancelled.

        Raises:
            grpc.aio.AioRpcError: the call's own error, or ``UNAVAILABLE`` when the
                worker is dead.
        """
        task = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.config.stall_interval_s)
                if done:
                    return task.result()
                if not await self.is_alive(worker):
                    raise rpc_error(grpc.StatusCode.UNAVAILABLE,
                                    f"{worker.record.role} worker {worker.worker_id} gave no "
                                    "answer and did not answer Health")
        finally:
            if not task.done():
                call.cancel()
                task.cancel()

    def mark_unhealthy(self, worker_id: str) -> None:
        """A call to ``worker_id`` failed: route elsewhere until its Health answers."""
        for role in self.workers.values():
            if worker_id in role:
                role[worker_id].healthy = False

    def live(self, role: str, exclude: set[str] = frozenset()) -> list[WorkerHandle]:
        """Workers of ``role`` not in ``exclude``; healthy ones when any are."""
        workers = [w for w in self.workers[role].values() if w.worker_id not in exclude]
        healthy = [w for w in workers if w.healthy]
        return healthy or workers

    def all_ids(self) -> list[str]:
        """Ids of every live worker, all roles."""
        return [i for role in self.workers.values() for i in role]

    async def refresh(self) -> None:
        """Read the live workers from the registry; open channels to new ones. One
        refresh at a time (the pool's loop and ``workers_changed`` both call it)."""
        async with self._refresh_lock:
            await self._refresh()

    async def _refresh(self) -> None:
        try:
            records = await asyncio.to_thread(self.registry.list_live)
        except RegistryUnavailable as exc:
            if not self.registry_down:
                logger.warning("worker registry unreachable, keeping the last workers: %s", exc)
                if self.metrics is not None:
                    self.metrics.record_registry(available=False)
            self.registry_down = True
            return
        if self.registry_down:
            logger.info("worker registry reachable again")
        self.registry_down = False
        if self.on_registry_read is not None:
            self.on_registry_read({r.worker_id for r in records})
        if self.metrics is not None:
            self.metrics.record_registry(available=True,
                                         num_rejected=len(self.registry.rejected_ids))
        model = self.config.served_model_name or self.config.model
        if self._update_members(records, model):
            self.members_changed()

    def _update_members(self, records: list[WorkerRecord], model: str) -> bool:
        """Apply a registry read to ``workers``; True when a member joined, left or has
        a new record (same epoch, a field changed: ``WorkerRegistry.update``)."""
        changed = False
        for role, known in self.workers.items():
            # NOTE: one registry serves several models; this pool is one model's
            fresh = {r.worker_id: r for r in records if r.role == role and r.model == model}
            for worker_id in list(known):
                record = fresh.get(worker_id)
                if record is None and known[worker_id].healthy:
                    # NOTE: a Redis that restarted empty lists no one until the workers
                    # register again; a worker whose Health still answers "ok" stays
                    continue
                worker = known[worker_id]
                if record is not None and record.epoch == worker.record.epoch and \
                        record.grpc_address == worker.record.grpc_address:
                    if record != worker.record:  # its compute after a CPU re-split
                        worker.record, changed = record, True
                    continue
                # NOTE: closed at close(), not now: a registry blip must not cancel
                # the streams in flight on it
                changed = True
                known.pop(worker_id).bind(None)
                self._retired.append(worker.channel)
                if self.metrics is not None:
                    self.metrics.forget_worker(role, worker_id)
                if self.on_worker_removed is not None:
                    self.on_worker_removed(worker_id)
            for worker_id, record in fresh.items():
                if worker_id not in known:
                    auth = self.config.auth
                    channel = grpc.aio.insecure_channel(record.grpc_address) \
                        if auth is None else auth.channel(record.grpc_address)
                    known[worker_id] = WorkerHandle(record, channel, _STUBS[role](channel),
                                                    WorkerLoad(worker_id))
                    changed = True
        return changed

    async def poll_health(self) -> None:
        """Ask every worker for its load (``health_timeout_s`` each, concurrently)."""
        handles = [w for role in self.workers.values() for w in role.values()]
        # NOTE: no slot re-read here: a lookup that credits a slot unknown to the routing
        # arrays re-reads them when the index gave one since (Router._check_slots)
        await asyncio.gather(*(self._poll(w) for w in handles))
        if self.metrics is not None:
            for role, known in self.workers.items():
                self.metrics.record_pool_size(role, sum(w.healthy for w in known.values()),
                                              len(known))

    async def workers_changed(self, added: list[str], removed: list[str]) -> None:
        """Workers were added to or are leaving a pool (``pdserve scale``): route nothing
        new to those leaving, and read the registry and the new workers' Health now, so
        they take traffic at once, not at the next refresh."""
        for worker_id in removed:
            self.mark_unhealthy(worker_id)
        if added:
            await self.refresh()
            await self.poll_health()

    def metrics_targets(self, model_name: str) -> list[dict]:
        """Every known worker that serves metrics, as Prometheus HTTP service discovery
        target groups (``http_sd_configs``): one group per worker, with its id, role and
        model as ``__meta_pdserve_*`` labels (for relabelling; the samples carry
        ``worker``, ``role`` and ``model_name`` labels of their own)."""
        return [{"targets": [w.record.metrics_address],
                 "labels": {"__meta_pdserve_worker": w.worker_id,
                            "__meta_pdserve_role": role,
                            "__meta_pdserve_model_name": model_name}}
                for role, known in sorted(self.workers.items())
                for w in sorted(known.values(), key=lambda w: w.worker_id)
                if w.record.metrics_address]

    async def _poll(self, worker: WorkerHandle) -> None:
        worker.start_health_window()
        try:
            request = common_pb2.HealthRequest()
            reply = await worker.stub.Health(request, timeout=self.config.health_timeout_s,
                                             metadata=self.credentials(worker, "Health",
                                                                       request))
        except grpc.aio.AioRpcError:
            worker.healthy = False
            return
        worker.healthy = reply.status == "ok"
        worker.num_routed = 0
        # NOTE: the peak over the call, not its ends: a burst that came and went while
        # the worker answered is in its counts, and would else read as another router's
        worker.num_inflight_at_health = worker.health_window_peak
        worker.load = WorkerLoad(worker.worker_id, reply.num_running, reply.num_waiting,
                                 reply.kv_cache_usage)
        if self.metrics is not None:
            self.metrics.record_worker_health(worker.record.role, reply)

    async def run(self) -> None:
        """Refresh the registry every ``registry_interval_s`` and loads every
        ``health_interval_s`` until cancelled."""
        loop = asyncio.get_running_loop()
        next_refresh = loop.time() + self.config.registry_interval_s
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            try:
                if loop.time() >= next_refresh:
                    next_refresh = loop.time() + self.config.registry_interval_s
                    await self.refresh()
                await self.poll_health()
            except Exception:
                logger.exception("worker pool refresh failed")

    async def close(self) -> None:
        """End every decode session and close every channel."""
        for channel in self._retired:
            await channel.close()
        for role in self.workers.values():
            for worker in role.values():
                if worker.session is not None:
                    worker.session.close()
                await worker.channel.close()
            role.clear()
