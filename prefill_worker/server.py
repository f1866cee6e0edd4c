"""The prefill worker's gRPC service (``pdserve.v1.PrefillWorker``) and its process."""

from __future__ import annotations

import asyncio
import logging

from pdserve.cluster.wire import (
    kv_handle_to_proto,
    logprob_to_proto,
    prompt_logprobs_to_proto,
    sampling_params_from_proto,
)
from pdserve.cluster.worker_config import WorkerConfig
from pdserve.cluster.worker_runtime import Worker, WorkerRuntime, grpc_error_code
from pdserve.kvtransfer import KVSender
from pdserve.prefill_worker.service import PrefillService, kv_consumer
from pdserve.proto import common_pb2, prefill_pb2, prefill_pb2_grpc

logger = logging.getLogger(__name__)


class PrefillWorkerServicer(prefill_pb2_grpc.PrefillWorkerServicer):
    """Maps RPCs onto ``PrefillService``; errors become gRPC status codes with the
    exception's message (INVALID_ARGUMENT for bad input, NOT_FOUND for an unknown lease,
    PERMISSION_DENIED for a lease of another decode worker, UNAVAILABLE for a failed
    transfer)."""

    def __init__(self, service: PrefillService, runtime: WorkerRuntime) -> None:
        self.service = service
        self.runtime = runtime

    async def Prefill(self, request, context):
        try:
            self.runtime.check_admitting()
            if not request.decode_worker_id or not request.decode_kv_address:
                raise ValueError("decode_worker_id and decode_kv_address are required: the "
                                 "decode worker the KV lease is for")
            params = sampling_params_from_proto(request.sampling_params)
            result = await self.service.prefill(
                request.request_id, list(request.prompt_token_ids), params,
                request.cache_salt if request.HasField("cache_salt") else None,
                kv_consumer(request.decode_worker_id, request.decode_kv_address),
                request.priority)
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            await context.abort(grpc_error_code(exc), str(exc))
        response = prefill_pb2.PrefillResponse(
            first_token_id=result.first_token, num_cached_tokens=result.num_cached_tokens,
            finish_reason=result.finish_reason or "")
        if result.first_logprob is not None:
            response.first_logprob.CopyFrom(logprob_to_proto(result.first_logprob))
        if result.kv_handle is not None:
            response.kv_handle.CopyFrom(kv_handle_to_proto(result.kv_handle))
        if result.prompt_logprobs is not None:
            response.prompt_logprobs.extend(prompt_logprobs_to_proto(result.prompt_logprobs))
        return response

    async def SendKV(self, request, context):
        try:
            num_blocks, num_bytes = await self.service.send_kv(
                request.request_id, request.decode_worker_id, request.decode_kv_address,
                list(request.block_indices), request.kv_ticket or None)
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            # NOTE: nothing is sent to the decode worker's address for an unknown lease or
            # another worker's: its pull fails when this RPC does
            await context.abort(grpc_error_code(exc), str(exc))
        return prefill_pb2.SendKVResponse(num_blocks=num_blocks, num_bytes=num_bytes)

    async def GrantKV(self, request, context):
        granted = await self.service.grant(request.request_id, request.decode_worker_id,
                                           request.decode_kv_address)
        return prefill_pb2.GrantKVResponse(granted=granted)

    async def Release(self, request, context):
        released = await self.service.release(request.request_id)
        return prefill_pb2.ReleaseResponse(released=released)

    async def Health(self, request, context):
        return self.runtime.health(self.service.sender.counters().num_in_flight,
                                   self.service.kv_address)


class PrefillWorker(Worker):
    """One prefill worker: engine (which owns the KV leases), KV sender, gRPC server,
    registry entry.

    ``await start()`` then ``grpc_address`` / ``kv_address``; ``await stop()``.
    """

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.service: PrefillService | None = None

    @property
    def kv_address(self) -> str:
        return self.config.kv_host

    async def start(self) -> None:
        engine = await asyncio.to_thread(self.runtime.build_engine)
        runner = engine.engine.model_runner
        cache = runner.transfer_cache()  # NOTE: every rank's heads under TP
        sender = KVSender(self.worker_id, cache, kv_key=self.config.kv_key,
                          kv_scales=runner.kv_scales if cache is runner.kv_cache else None,
                          host=self.config.kv_host, timeout_s=self.config.kv_transfer_timeout_s,
                          connect_timeout_s=self.config.kv_connect_timeout_s)
        self.service = PrefillService(engine, sender, self.worker_id, self.config.kv_host,
                                      self.config.lease_s, self.config.kv_transfer_timeout_s)
        servicer = PrefillWorkerServicer(self.service, self.runtime)
        self.runtime.start_metrics(sender.counters)
        self.service.grpc_address = await self.runtime.start_server(
            lambda server: prefill_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, server))
        await self.runtime.register(self.kv_address)
        logger.info("prefill worker %s serving gRPC on %s, metrics on %s", self.worker_id,
                    self.grpc_address, self.runtime.metrics_server.address
                    if self.runtime.metrics_server else "none")

    async def stop(self, grace_s: float = 2.0) -> None:
        """Stop serving: RPCs in flight get ``grace_s`` seconds, then are cancelled."""
        await self.runtime.stop(grace_s)
        if self.service is not None:
            self.service.sender.close()


__all__ = ["PrefillWorker", "PrefillWorkerServicer", "common_pb2"]
