"""The decode worker's gRPC service (``pdserve.v1.DecodeWorker``) and its process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc

from pdserve.cluster.auth import ClusterAuth
from pdserve.cluster.wire import (
    KVHandle,
    kv_handle_from_proto,
    logprob_from_proto,
    logprob_to_proto,
    prompt_logprobs_to_proto,
    sampling_params_from_proto,
)
from pdserve.cluster.worker_config import WorkerConfig
from pdserve.cluster.worker_runtime import Worker, WorkerRuntime, grpc_error_code
from pdserve.decode_worker.service import DecodeService, DecodeStart, KVPullFailed, NoFreeBlocks
from pdserve.kvtransfer import KVReceiver
from pdserve.proto import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

logger = logging.getLogger(__name__)
SEND_KV_METHOD = "/pdserve.v1.PrefillWorker/SendKV"


class PrefillClients:
    """Cached gRPC channels to prefill workers, for ``SendKV`` (keyed by address); with
    the cluster's ``auth``, over mutual TLS when it has certificates."""

    def __init__(self, timeout_s: float, auth: ClusterAuth | None = None) -> None:
        self.timeout_s = timeout_s
        self.auth = auth
        self._stubs: dict[str, prefill_pb2_grpc.PrefillWorkerStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    def metadata(self, method: str, request):
        """The cluster credentials for one call of ``method`` with ``request``, or None."""
        return None if self.auth is None else self.auth.rpc_metadata(method, request)

    def stub(self, address: str) -> prefill_pb2_grpc.PrefillWorkerStub:
        if address not in self._stubs:
            channel = grpc.aio.insecure_channel(address) if self.auth is None else \
                self.auth.channel(address)
            self._channels.append(channel)
            self._stubs[address] = prefill_pb2_grpc.PrefillWorkerStub(channel)
        return self._stubs[address]

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


class DecodeWorkerServicer(decode_pb2_grpc.DecodeWorkerServicer):
    """Maps RPCs onto ``DecodeService``. A cancelled ``Decode`` stream aborts the request
    and frees its blocks at once."""

    def __init__(self, service: DecodeService, runtime: WorkerRuntime) -> None:
        self.service = service
        self.runtime = runtime

    async def Decode(self, request, context):
        try:
            async for response in self._responses(request):
                yield response
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            await context.abort(_decode_error_code(exc), str(exc))

    async def DecodeSession(self, request_iterator, context):
        """Many requests on one stream (decode.proto): one message per engine step with
        every update of the session's requests. Ending the stream cancels them all."""
        session = _Session(self)
        reader = asyncio.ensure_future(session.read(request_iterator))
        try:
            while (updates := await session.next_updates()) is not None:
                yield decode_pb2.DecodeSessionResponse(updates=updates)
        finally:
            reader.cancel()
            await session.cancel_all()

    async def _responses(self, request) -> AsyncIterator[decode_pb2.DecodeResponse]:
        """One request's Decode responses; raises what ``DecodeService.decode`` raises."""
        handle = kv_handle_from_proto(request.kv_handle) if request.HasField("kv_handle") \
            else None
        self.runtime.check_admitting()
        params = sampling_params_from_proto(request.sampling_params)
        stream = self.service.decode(
            request.request_id, list(request.prompt_token_ids), params,
            request.cache_salt if request.HasField("cache_salt") else None,
            request.first_token_id if request.HasField("first_token_id") else None,
            logprob_from_proto(request.first_logprob)
            if request.HasField("first_logprob") else None,
            handle, list(request.resume_token_ids), request.priority)
        # Prefilled here (no KV handle): the first tokens report the prefix-cache hit;
        # with a handle the DecodeStart reports what was cached and not pulled.
        report_hit = handle is None
        async with contextlib.aclosing(stream):
            async for item in stream:
                response = _to_response(item)
                if report_hit and not isinstance(item, DecodeStart) and item.new_token_ids:
                    response.num_cached_tokens = item.num_cached_tokens
                    report_hit = False
                yield response

    async def Abort(self, request, context):
        aborted = await self.service.abort(request.request_id)
        return decode_pb2.AbortResponse(aborted=aborted)

    async def Health(self, request, context):
        return self.runtime.health(self.service.receiver.counters().num_in_flight,
                                   self.service.receiver.address)


class _Session:
    """The requests of one ``DecodeSession`` stream: a task per request, whose updates
    go to one queue that the stream drains into a message per wake-up (an engine step
    hands all its outputs to the event loop at once, so one step's tokens leave as one
    message)."""

    def __init__(self, servicer: DecodeWorkerServicer) -> None:
        self.servicer = servicer
        self.tasks: dict[str, asyncio.Task] = {}
        self.updates: asyncio.Queue = asyncio.Queue()
        self.reading = True

    async def read(self, request_iterator) -> None:
        """Start and cancel requests as the router asks, until it ends its side."""
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("kind")
                if kind == "decode":
                    self._start(message.decode)
                elif kind == "cancel_request_id":
                    task = self.tasks.get(message.cancel_request_id)
                    if task is not None:
                        task.cancel()
        finally:
            self.reading = False
            self.updates.put_nowait(None)  # wakes next_updates to see if the stream ends

    def _start(self, request) -> None:
        request_id = request.request_id
        if request_id in self.tasks:
            self._fail(request_id, grpc.StatusCode.INVALID_ARGUMENT,
                       f"request {request_id} is already running in this session")
            return
        self.tasks[request_id] = asyncio.ensure_future(self._run(request))

    async def _run(self, request) -> None:
        request_id = request.request_id
        try:
            async for response in self.servicer._responses(request):
                self.updates.put_nowait(decode_pb2.DecodeSessionUpdate(
                    request_id=request_id, response=response))
        except asyncio.CancelledError:  # the router cancelled it (or the stream ended)
            self._fail(request_id, grpc.StatusCode.CANCELLED, "cancelled")
        except Exception as exc:  # noqa: BLE001 - mapped to a status, as Decode does
            self._fail(request_id, _decode_error_code(exc), str(exc))
        finally:
            self.tasks.pop(request_id, None)
            self.updates.put_nowait(None)

    def _fail(self, request_id: str, code: grpc.StatusCode, details: str) -> None:
        self.updates.put_nowait(decode_pb2.DecodeSessionUpdate(
            request_id=request_id, error_code=code.value[0], error_details=details))

    async def next_updates(self) -> list | None:
        """Every update queued now (waiting for the first), or None once the router has
        ended its side and no request of the session is left."""
        while True:
            updates = [await self.updates.get()]
            while not self.updates.empty():
                updates.append(self.updates.get_nowait())
            updates = [u for u in updates if u is not None]
            if updates:
                return updates
            if not self.reading and not self.tasks:
                return None

    async def cancel_all(self) -> None:
        """Cancel every request still running (each aborts and frees its blocks)."""
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10.0)


def _decode_error_code(exc: BaseException) -> grpc.StatusCode:
    """FAILED_PRECONDITION: the KV could not be pulled (the router resumes the request
    without it); RESOURCE_EXHAUSTED: no free blocks (it tries another decode worker)."""
    if isinstance(exc, KVPullFailed):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, NoFreeBlocks):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    return grpc_error_code(exc)


def _to_response(item) -> decode_pb2.DecodeResponse:
    if isinstance(item, DecodeStart):
        return decode_pb2.DecodeResponse(num_cached_tokens=item.num_cached_tokens,
                                         num_transferred_blocks=item.num_transferred_blocks,
                                         num_transferred_bytes=item.num_transferred_bytes)
    response = decode_pb2.DecodeResponse(
        token_ids=item.new_token_ids, finish_reason=item.finish_reason or "",
        logprobs=[logprob_to_proto(lp) for lp in item.new_logprobs])
    if item.stop_reason is not None:
        response.stop_reason = item.stop_reason
    if item.prompt_logprobs is not None:
        response.prompt_logprobs.extend(prompt_logprobs_to_proto(item.prompt_logprobs))
    return response


class DecodeWorker(Worker):
    """One decode worker: engine, KV receiver (hosting the pair channels' store), gRPC
    server, registry entry. ``await start()``; ``await stop()``."""

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.receiver: KVReceiver | None = None
        self.service: DecodeService | None = None
        self.prefill_clients = PrefillClients(config.kv_transfer_timeout_s, config.auth)

    @property
    def kv_address(self) -> str:
        return self.receiver.address

    async def start(self) -> None:
        engine = await asyncio.to_thread(self.runtime.build_engine)
        runner = engine.engine.model_runner
        cache = runner.transfer_cache()  # NOTE: every rank's heads under TP
        self.receiver = KVReceiver(
            self.worker_id, cache, f"{self.config.kv_host}:{self.config.kv_port}",
            kv_key=self.config.kv_key, timeout_s=self.config.kv_transfer_timeout_s,
            connect_timeout_s=self.config.kv_connect_timeout_s,
            kv_scales=runner.kv_scales if cache is runner.kv_cache else None)
        self.service = DecodeService(engine, self.receiver, self.worker_id, self._request_kv,
                                     self.config.kv_transfer_timeout_s,
                                     self.config.kv_alloc_timeout_s)
        servicer = DecodeWorkerServicer(self.service, self.runtime)
        self.runtime.start_metrics(self.receiver.counters)
        await self.runtime.start_server(
            lambda server: decode_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server))
        await self.runtime.register(self.kv_address)
        logger.info("decode worker %s serving gRPC on %s, KV on %s", self.worker_id,
                    self.grpc_address, self.kv_address)

    async def _request_kv(self, handle: KVHandle, decode_worker_id: str, kv_address: str,
                          block_indices: list[int], ticket: str) -> tuple[int, int]:
        """Ask the prefill worker that holds ``handle`` (at its ``prefill_grpc_address``)
        to send ``block_indices`` for the pull whose ticket text is ``ticket`` ("" when
        nothing is pulled). Raises KeyError for a handle without that address."""
        if not handle.prefill_grpc_address:
            raise KeyError(f"the KV handle of {handle.request_id!r} has no prefill_grpc_address")
        request = prefill_pb2.SendKVRequest(request_id=handle.request_id,
                                            decode_worker_id=decode_worker_id,
                                            decode_kv_address=kv_address,
                                            block_indices=block_indices, kv_ticket=ticket)
        reply = await self.prefill_clients.stub(handle.prefill_grpc_address).SendKV(
            request, timeout=self.config.kv_transfer_timeout_s,
            metadata=self.prefill_clients.metadata(SEND_KV_METHOD, request))
        return reply.num_blocks, reply.num_bytes

    async def stop(self, grace_s: float = 2.0) -> None:
        """Stop serving: RPCs in flight get ``grace_s`` seconds, then are cancelled."""
        await self.runtime.stop(grace_s)
        await self.prefill_clients.close()
        if self.receiver is not None:
            self.receiver.close()
