"""What a prefill and a decode worker share: the engine and its thread, the gRPC server,
the Redis registry entry and the prefix-index publisher, and an orderly stop.

Each worker adds its servicer (``prefill_worker/server.py``, ``decode_worker/server.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from pdserve.cluster.worker_config import WorkerConfig
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.llm_engine import LLMEngine
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

    def build_engine(self) -> AsyncEngine:
        if self.config.redis_url:
            from pdserve.cluster.prefix_index import KVEventPublisher

            self.publisher = KVEventPublisher(self.config.redis_url, self.worker_id)
        engine = LLMEngine(self.config.engine, kv_event_callback=self.publisher)
        self.engine = AsyncEngine(engine, name=f"engine-{self.worker_id}")
        self.engine.start()
        return self.engine

    async def start_server(self, add_servicer: Callable[[grpc.aio.Server], None]) -> str:
        """Bind and start the gRPC server; returns ``host:port``.

        Raises:
            RuntimeError: the port could not be bound.
        """
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        add_servicer(self.server)
        port = self.server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        if port == 0:
            raise RuntimeError(f"cannot bind gRPC to {self.config.host}:{self.config.port}")
        await self.server.start()
        self.grpc_address = f"{self.config.advertise_host or self.config.host}:{port}"
        return self.grpc_address

    def register(self, kv_address: str) -> None:
        """Announce this worker in the Redis registry (heartbeat with a short TTL)."""
        if not self.config.redis_url:
            return
        from pdserve.cluster.registry import WorkerRecord, WorkerRegistry

        self.registry = WorkerRegistry(self.config.redis_url,
                                       heartbeat_ttl_s=self.config.heartbeat_ttl_s)
        self.registry.register(WorkerRecord(
            worker_id=self.worker_id, role=self.config.role, grpc_address=self.grpc_address,
            kv_address=kv_address, epoch=self.epoch,
            model=self.engine.engine.served_model_name, started_at=time.time()))

    def health(self, num_kv_transfers_in_flight: int = 0) -> common_pb2.HealthResponse:
        """Load figures read without stopping the engine (ints and floats are atomic);
        ``num_kv_transfers_in_flight`` comes from the worker's KV sender or receiver."""
        engine = self.engine.engine
        scheduler = engine.scheduler
        return common_pb2.HealthResponse(
            worker_id=self.worker_id, role=self.config.role,
            status="ok" if self.engine.alive else "stopped",
            num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
            kv_cache_usage=engine.kv_cache_manager.usage,
            num_free_blocks=engine.num_free_blocks(), num_total_blocks=engine.num_blocks,
            model=engine.served_model_name, epoch=self.epoch,
            num_kv_transfers_in_flight=num_kv_transfers_in_flight)

    async def stop(self, grace_s: float = 2.0) -> None:
        if self.registry is not None:
            self.registry.deregister()
        if self.server is not None:
            await self.server.stop(grace_s)
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)
        if self.publisher is not None:
            self.publisher.close(purge=True)


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


def grpc_error_code(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status for an exception raised while serving a request."""
    from pdserve.engine.async_engine import EngineDeadError
    from pdserve.kvtransfer import KVTransferError

    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, KeyError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(exc, (KVTransferError, EngineDeadError)):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.INTERNAL
