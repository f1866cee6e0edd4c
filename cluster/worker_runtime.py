"""What a prefill and a decode worker share: the engine and its thread, the gRPC server,
the Redis registry entry and the prefix-index publisher, and an orderly stop.

Each worker adds its servicer (``prefill_worker/server.py``, ``decode_worker/server.py``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable

import grpc

from pdserve.cluster.worker_config import WorkerConfig
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kvtransfer.protocol import KVTransferCounters
from pdserve.proto import common_pb2

logger = logging.getLogger(__name__)


class WorkerRuntime:
    """Builds and owns one worker's engine, gRPC server and cluster registration.

    ``start(add_servicer)`` loads the model, binds the gRPC server (``config.port`` 0
    takes a free port; ``grpc_address`` is the real one), then registers in Redis when a
    ``redis_url`` is set. ``stop`` undoes all of it.
    """

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.worker_id = config.worker_id
        self.publisher = None
        self.registry = None
        self.engine: AsyncEngine | None = None
        self.server: grpc.aio.Server | None = None
        self.grpc_address = ""
        self.epoch = time.time_ns()
        self.draining = False
        self.metrics_server = None

    def build_engine(self) -> AsyncEngine:
        if self.config.redis_url:
            from pdserve.cluster.prefix_index import KVEventPublisher

            self.publisher = KVEventPublisher(self.config.redis_url, self.worker_id)
        self.engine = AsyncEngine.build(
            lambda: LLMEngine(self.config.engine, kv_event_callback=self.publisher,
                              kv_lease_s=self.config.lease_s),
            name=f"engine-{self.worker_id}")
        return self.engine

    async def start_server(self, add_servicer: Callable[[grpc.aio.Server], None]) -> str:
        """Bind and start the gRPC server; returns ``host:port``. With ``config.auth``,
        every call needs the cluster's credentials (else UNAUTHENTICATED), over mutual TLS
        when it has certificates.

        Raises:
            RuntimeError: the port could not be bound.
        """
        auth = self.config.auth
        interceptors = [auth.server_interceptor()] if auth is not None else []
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)],
                                      interceptors=interceptors)
        add_servicer(self.server)
        address = f"{self.config.host}:{self.config.port}"
        port = auth.add_port(self.server, address) if auth is not None else \
            self.server.add_insecure_port(address)
        if port == 0:
            raise RuntimeError(f"cannot bind gRPC to {self.config.host}:{self.config.port}")
        await self.server.start()
        self.grpc_address = f"{self.config.advertise_host or self.config.host}:{port}"
        return self.grpc_address

    def start_metrics(self, kv_counters: Callable[[], KVTransferCounters]) -> str:
        """Serve this worker's Prometheus metrics (``cluster/worker_metrics.py``) on port
        ``config.metrics_port``; returns the address it serves at, "" when
        ``metrics_port`` is None. Call after ``build_engine``.

        With ``config.metrics_auth`` keys: on ``config.host``, every scrape needs one.
        Without: on ``config.host`` when that is loopback; else on 127.0.0.1 only, left
        out of the registry record, and a WARNING says so (once, here).

        Raises:
            OSError: the port cannot be bound.
        """
        if self.config.metrics_port is None:
            return ""
        from pdserve.cluster.metrics_auth import LOOPBACK_HOST, METRICS_KEY_ENV, is_loopback_host
        from pdserve.cluster.worker_metrics import MetricsServer, WorkerCollector

        config = self.config
        host, advertise, discoverable = config.host, config.advertise_host, True
        if not config.metrics_auth and not is_loopback_host(host):
            host, advertise, discoverable = LOOPBACK_HOST, None, False
        self.metrics_server = MetricsServer(WorkerCollector(self, kv_counters), host,
                                            config.metrics_port, advertise,
                                            config.metrics_auth, discoverable)
        if not discoverable:
            logger.warning("worker %s: no metrics API key (--metrics-api-key-file, %s, or "
                           "the router's admin key), so its /metrics is served on %s only, "
                           "not on %s, and not advertised for Prometheus discovery",
                           self.worker_id, METRICS_KEY_ENV, self.metrics_server.address,
                           config.host)
        return self.metrics_server.address

    async def register(self, kv_address: str) -> None:
        """Announce this worker in the Redis registry (heartbeat with a short TTL). The
        first write runs off the event loop; if Redis is down, the heartbeat thread
        registers once it answers."""
        if not self.config.redis_url:
            return
        from pdserve.cluster.registry import WorkerRecord, WorkerRegistry

        self.registry = WorkerRegistry(self.config.redis_url,
                                       heartbeat_ttl_s=self.config.heartbeat_ttl_s,
                                       auth=self.config.auth)
        record = WorkerRecord(
            worker_id=self.worker_id, role=self.config.role, grpc_address=self.grpc_address,
            kv_address=kv_address, epoch=self.epoch,
            model=self.engine.engine.served_model_name, started_at=time.time(),
            compute=compute_placement(self.engine.engine.model_runner.device),
            metrics_address=self.metrics_server.address
            if self.metrics_server and self.metrics_server.discoverable else "")
        await asyncio.to_thread(self.registry.register, record)

    async def resplit(self, cpus: list[int], num_threads: int) -> str:
        """Run this worker on ``cpus`` with ``num_threads`` intra-op threads from its next
        engine step on (``cpu_threads.apply_cpu_split`` on the engine thread, between two
        steps), and rewrite its registry record's ``compute`` to match, which the router's
        ``shares_compute`` reads. Returns the new ``compute``.

        Raises:
            ValueError: the engine does not compute on CPUs.
            OSError: ``cpus`` holds no CPU this process may have.
        """
        import dataclasses

        from pdserve.engine.cpu_threads import apply_cpu_split

        device = self.engine.engine.model_runner.device
        if device.type != "cpu":
            raise ValueError(f"worker {self.worker_id} computes on {device}, not on CPUs")
        bound = await self.engine.call(lambda e: apply_cpu_split(
            e.config.cpu_omp_threads_bind, cpus, num_threads))
        compute = compute_placement(device)
        if self.registry is not None and self.registry.record is not None:
            await asyncio.to_thread(self.registry.update, dataclasses.replace(
                self.registry.record, compute=compute))
        logger.info("worker %s now runs %d intra-op threads on CPUs %s (%d bound)",
                    self.worker_id, num_threads, ",".join(map(str, cpus)), bound)
        return compute

    def check_admitting(self) -> None:
        """Raises ``WorkerDraining`` (the servicers answer UNAVAILABLE, and the router
        sends the request elsewhere) once this worker drains or stops."""
        if self.draining:
            raise WorkerDraining(f"worker {self.worker_id} is draining and takes no new "
                                 "requests")

    def health(self, num_kv_transfers_in_flight: int = 0,
               kv_address: str = "") -> common_pb2.HealthResponse:
        """Load figures read without stopping the engine (ints and floats are atomic), and
        the engine thread's last ownership audit; ``num_kv_transfers_in_flight`` comes from
        the worker's KV sender or receiver."""
        engine = self.engine.engine
        scheduler = engine.scheduler
        ownership = self.engine.ownership
        status = "stopped" if not self.engine.alive else "draining" if self.draining else "ok"
        return common_pb2.HealthResponse(
            worker_id=self.worker_id, role=self.config.role, status=status,
            num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
            kv_cache_usage=engine.kv_cache_manager.usage,
            num_free_blocks=engine.num_free_blocks(), num_total_blocks=engine.num_blocks,
            model=engine.served_model_name, epoch=self.epoch,
            num_kv_transfers_in_flight=num_kv_transfers_in_flight,
            num_requests_waiting_for_kv=ownership.num_requests_waiting_for_kv,
            num_kv_leases=ownership.num_leases, num_leased_blocks=ownership.num_leased_blocks,
            num_unowned_blocks=ownership.num_unowned_blocks, kv_address=kv_address)

    async def drain(self, grace_s: float) -> bool:
        """Stop taking requests (Health says ``draining``; new ``Prefill``/``Decode`` calls
        get UNAVAILABLE), leave the registry, and wait up to ``grace_s`` seconds for the
        requests and KV leases here to end. Returns True if they all ended; the rest are
        cut by ``stop`` (the router migrates decodes and retries prefills elsewhere)."""
        self.draining = True
        if self.registry is not None:
            await asyncio.to_thread(self.registry.deregister)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            engine = self.engine.engine
            if not engine.has_unfinished_requests() and not engine.kv_cache_manager.leases():
                return True
            await asyncio.sleep(0.05)
        return False

    async def stop(self, grace_s: float = 2.0) -> None:
        self.draining = True
        if self.registry is not None:
            await asyncio.to_thread(self.registry.deregister)
        if self.server is not None:
            await self.server.stop(grace_s)
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)
        if self.publisher is not None:
            await asyncio.to_thread(self.publisher.close, purge=True)
        if self.metrics_server is not None:
            await asyncio.to_thread(self.metrics_server.close)
            self.metrics_server = None


def compute_placement(device) -> str:
    """What this process computes on, for the registry record: ``cpu@<host>:<cpus>``
    (the CPUs it may run on, e.g. ``0-1`` as ``0,1``) or ``cuda@<host>:<GPU UUID>``
    (``<index>`` when the UUID is unknown). The router's ``shares_compute`` compares them."""
    host = socket.gethostname()
    if device.type == "cuda":
        import torch

        props = torch.cuda.get_device_properties(device)
        uuid = getattr(props, "uuid", None)
        return f"cuda@{host}:{f'GPU-{uuid}' if uuid else device.index or 0}"
    return f"cpu@{host}:{','.join(str(c) for c in sorted(os.sched_getaffinity(0)))}"


class WorkerDraining(RuntimeError):
    """The worker is draining or stopping: it takes no new request (UNAVAILABLE)."""


class Worker:
    """Base of ``PrefillWorker`` and ``DecodeWorker``: a config and its runtime."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.runtime = WorkerRuntime(config)

    @property
    def worker_id(self) -> str:
        return self.runtime.worker_id

    @property
    def grpc_address(self) -> str:
        return self.runtime.grpc_address

    async def drain(self, grace_s: float) -> bool:
        """See ``WorkerRuntime.drain``."""
        return await self.runtime.drain(grace_s)


def grpc_error_code(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status for an exception raised while serving a request."""
    from pdserve.engine.async_engine import EngineDeadError
    from pdserve.kvtransfer import KVTransferError

    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, KeyError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, PermissionError):
        return grpc.StatusCode.PERMISSION_DENIED
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(exc, (KVTransferError, EngineDeadError, WorkerDraining)):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.INTERNAL
