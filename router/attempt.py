"""One attempt of a request on the workers (docs/architecture.md, Lifecycle and failure): the
Prefill call, the Decode stream, what a failed RPC means for the request, and the
clean-up RPCs that give back what an attempt held.

``Progress`` is what a request keeps across attempts (the tokens already sent to the
client, the prefill's leased KV); ``WorkerCalls`` runs one attempt's RPCs and raises
``AttemptFailed`` when a worker fails, after which ``ModelService.generate`` tries again.

Clean-up RPCs (``Abort`` to a decode worker, ``Release`` to a prefill worker) run in the
background. A failed one is retried (``CLEANUP_ATTEMPTS`` in all, ``control_timeout_s``
each, ``CLEANUP_BACKOFF_S`` doubling between them); every failure is logged at WARNING
with the request id and counted (``pdserve:cleanup_rpc_retries``, and
``pdserve:cleanup_rpc_failures`` once given up). None is needed for the blocks to be
freed: a cancelled decode stream aborts its request on the worker by itself, a pull ends
at its transfer timeout, and a lease expires after ``--kv-lease-s``; the RPCs make that
happen at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import grpc

from pdserve.cluster.wire import (
    logprob_from_proto,
    prompt_logprobs_from_proto,
    sampling_params_to_proto,
)
from pdserve.proto import decode_pb2, prefill_pb2
from pdserve.router.metrics import RouterMetrics
from pdserve.router.output import GenerationChunk, SequenceOutput, stop_reason_of
from pdserve.router.protocol import RequestError
from pdserve.router.workers import WorkerHandle, WorkerPool

if TYPE_CHECKING:
    from pdserve.router.config import RouterConfig
    from pdserve.router.generate_request import GenerateRequest

logger = logging.getLogger(__name__)
MAX_HANDLE_ATTEMPTS = 2  # decode workers that try to pull one prefill's KV
CLEANUP_ATTEMPTS = 3  # tries of one clean-up RPC
CLEANUP_BACKOFF_S = 0.2  # before the first retry; doubled before each next one
# NOTE: codes a later try may not get; the others (bad credentials, the router's own
# channel closed, an unknown method) would fail the same way again
_RETRIED_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED, grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL})


@dataclass(slots=True)
class LeasedKV:
    """A prefill's answer whose KV a prefill worker holds under a lease for the decode
    worker ``consumer_id`` (only it may have the KV sent)."""

    worker: WorkerHandle
    reply: prefill_pb2.PrefillResponse
    consumer_id: str
    num_handle_attempts: int = 0


@dataclass(slots=True)
class Progress:
    """What one request has across its attempts: the tokens already sent to the client,
    and the leased KV of its prefill until a decode worker takes it (or it is given up)."""

    generated: list[int] = field(default_factory=list)
    kv: LeasedKV | None = None
    num_attempts: int = 0


class AttemptFailed(Exception):
    """One attempt failed on a worker; the request goes on with another attempt."""

    def __init__(self, role: str, worker_id: str, reason: str) -> None:
        super().__init__(f"{role} worker {worker_id}: {reason}")
        self.role = role
        self.worker_id = worker_id
        self.reason = reason


class WorkerCalls:
    """The RPCs of one attempt, and background clean-up RPCs (``Release``, ``Abort``),
    retried as the module docstring says and kept until they end (``wait_idle``).
    ``Prefill`` and the decode stream have no deadline while their worker is alive
    (``WorkerPool.watched``, ``router/session.py``); the control RPCs (``GrantKV``,
    ``Abort``, ``Release``) have ``control_timeout_s`` a try."""

    def __init__(self, config: RouterConfig, pool: WorkerPool, metrics: RouterMetrics) -> None:
        self.config = config
        self.pool = pool
        self.metrics = metrics
        self._tasks: set[asyncio.Task] = set()

    @property
    def cleanup_bound_s(self) -> float:
        """The longest one clean-up RPC takes with its retries, seconds."""
        backoff = sum(CLEANUP_BACKOFF_S * 2 ** i for i in range(CLEANUP_ATTEMPTS - 1))
        return CLEANUP_ATTEMPTS * self.config.control_timeout_s + backoff

    async def wait_idle(self, timeout_s: float) -> None:
        """Wait at most ``timeout_s`` seconds for the clean-up RPCs under way."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)

    async def prefill(self, request: GenerateRequest, worker: WorkerHandle,
                      decode: WorkerHandle, progress: Progress, output: SequenceOutput,
                      exclude: set[str]) -> GenerationChunk:
        """Prefill on ``worker`` for the decode worker ``decode``; returns the first
        token's chunk and leaves the KV leased to ``decode`` in ``progress.kv``.
        Cancelled, it releases whatever the worker may hold."""
        salt = {"cache_salt": request.cache_salt} if request.cache_salt else {}
        try:
            message = prefill_pb2.PrefillRequest(
                request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                sampling_params=sampling_params_to_proto(request.params),
                decode_worker_id=decode.worker_id, decode_kv_address=decode.record.kv_address,
                priority=request.priority, **salt)
            # NOTE: no deadline: a long prefill is not a failure while the worker is alive
            reply = await self.pool.watched(worker, worker.stub.Prefill(
                message, metadata=self.pool.credentials(worker, "Prefill", message)))
        except grpc.aio.AioRpcError as exc:
            self.release(worker, request.request_id)  # it may have finished meanwhile
            raise self.failure("prefill", worker, exc, exclude) from exc
        except BaseException:
            self.release(worker, request.request_id)
            raise
        finally:
            worker.num_inflight -= 1
        if reply.HasField("kv_handle"):
            progress.kv = LeasedKV(worker, reply, decode.worker_id)
        output.num_cached_tokens = reply.num_cached_tokens
        self.metrics.record_prefix_cache(len(request.prompt_token_ids), reply.num_cached_tokens)
        first_lp = reply.first_logprob if reply.HasField("first_logprob") else None
        chunk = output.add([reply.first_token_id],
                           [logprob_from_proto(first_lp)] if first_lp else [],
                           reply.finish_reason, stop_reason_of(reply))
        if request.params.prompt_logprobs is not None:
            chunk.prompt_logprobs = prompt_logprobs_from_proto(reply.prompt_logprobs)
        progress.generated.append(reply.first_token_id)
        return chunk

    def decode_request(self, request: GenerateRequest, progress: Progress
                      ) -> decode_pb2.DecodeRequest:
        """The Decode call of this attempt: with the leased KV while it may still be
        pulled, else resuming after the tokens generated so far (or from the prompt).
        Attempts after the first use their own request id on the decode worker. Only a
        decode worker that prefills the prompt from its start computes ``prompt_logprobs``
        (once the first token is out, the client has them)."""
        salt = {"cache_salt": request.cache_salt} if request.cache_salt else {}
        request_id = request.request_id if progress.num_attempts == 1 else \
            f"{request.request_id}.{progress.num_attempts - 1}"
        kv = progress.kv
        with_kv = kv is not None and kv.num_handle_attempts < MAX_HANDLE_ATTEMPTS
        params = request.params
        if params.prompt_logprobs is not None and (with_kv or progress.generated):
            params = replace(params, prompt_logprobs=None)
        message = decode_pb2.DecodeRequest(
            request_id=request_id, prompt_token_ids=request.prompt_token_ids,
            sampling_params=sampling_params_to_proto(params), priority=request.priority,
            **salt)
        if with_kv:
            kv.num_handle_attempts += 1
            message.first_token_id = kv.reply.first_token_id
            if kv.reply.HasField("first_logprob"):
                message.first_logprob.CopyFrom(kv.reply.first_logprob)
            message.kv_handle.CopyFrom(kv.reply.kv_handle)
        else:
            self.release_kv(request, progress)
            message.resume_token_ids.extend(progress.generated)
        return message

    async def decode(self, request: GenerateRequest, worker: WorkerHandle,
                     progress: Progress, output: SequenceOutput, exclude: set[str]
                    ) -> AsyncIterator[GenerationChunk]:
        """Stream the request's decode on ``worker`` (on this router's decode session to
        it); every token sent on is recorded in ``progress.generated``, so a failure later
        resumes right after it."""
        message = self.decode_request(request, progress)
        if message.HasField("kv_handle") and progress.kv.consumer_id != worker.worker_id \
                and not await self.grant_kv(progress.kv, worker, request.request_id):
            self.release_kv(request, progress)
            message = self.decode_request(request, progress)  # resumes without the KV
        with_handle = message.HasField("kv_handle")
        # The decode worker prefills the whole prompt: its first tokens report the hit.
        local_prefill = not with_handle and not progress.generated
        want_prompt_logprobs = local_prefill and request.params.prompt_logprobs is not None
        call = self.pool.session(worker).start(message)  # no deadline while it is alive
        worker_done = False
        try:
            async for reply in call:
                if with_handle:
                    progress.kv, with_handle = None, False  # it pulled the KV (or had it)
                if not progress.generated and reply.num_cached_tokens:
                    output.num_cached_tokens = reply.num_cached_tokens
                if local_prefill and reply.token_ids:
                    local_prefill = False
                    self.metrics.record_prefix_cache(len(request.prompt_token_ids),
                                                     reply.num_cached_tokens)
                if not reply.token_ids and not reply.finish_reason:
                    continue
                worker_done = bool(reply.finish_reason)
                if reply.finish_reason == "abort":  # the worker gave up on it: migrate
                    raise AttemptFailed("decode", worker.worker_id, "the worker aborted it")
                chunk = output.add(list(reply.token_ids),
                                   [logprob_from_proto(lp) for lp in reply.logprobs],
                                   reply.finish_reason, stop_reason_of(reply))
                if want_prompt_logprobs:
                    want_prompt_logprobs = False
                    chunk.prompt_logprobs = prompt_logprobs_from_proto(reply.prompt_logprobs)
                progress.generated.extend(reply.token_ids)
                yield chunk
                if chunk.finish_reason:
                    return
            raise AttemptFailed("decode", worker.worker_id, "the stream ended unfinished")
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:  # the pull failed
                self.release_kv(request, progress)
                raise AttemptFailed("decode", worker.worker_id, exc.details()) from exc
            raise self.failure("decode", worker, exc, exclude) from exc
        finally:
            call.cancel()  # the worker aborts the request when it is cancelled
            if not worker_done:
                self.cleanup(worker, "Abort", message.request_id,
                             decode_pb2.AbortRequest(request_id=message.request_id))

    async def grant_kv(self, kv: LeasedKV, decode: WorkerHandle, request_id: str) -> bool:
        """Have the prefill worker lease ``kv`` to ``decode`` instead (a retry on another
        decode worker); False if the lease is gone or the prefill worker does not answer."""
        try:
            message = prefill_pb2.GrantKVRequest(request_id=request_id,
                                                 decode_worker_id=decode.worker_id,
                                                 decode_kv_address=decode.record.kv_address)
            reply = await kv.worker.stub.GrantKV(
                message, timeout=self.config.control_timeout_s,
                metadata=self.pool.credentials(kv.worker, "GrantKV", message))
        except grpc.aio.AioRpcError as exc:
            logger.info("GrantKV of %s failed: %s", request_id, exc.details())
            return False
        if reply.granted:
            kv.consumer_id = decode.worker_id
        return reply.granted

    def failure(self, role: str, worker: WorkerHandle, exc: grpc.aio.AioRpcError,
                exclude: set[str]) -> Exception:
        """What a failed RPC means: the client's error (400), or an ``AttemptFailed``
        after which ``worker`` is left out (and marked unhealthy until it answers)."""
        code = exc.code()
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return RequestError(exc.details() or "invalid request")
        exclude.add(worker.worker_id)
        if code != grpc.StatusCode.RESOURCE_EXHAUSTED:
            self.pool.mark_unhealthy(worker.worker_id)
        return AttemptFailed(role, worker.worker_id, f"{code.name}: {exc.details()}")

    def release_kv(self, request: GenerateRequest, progress: Progress) -> None:
        """Give up the prefill's leased KV, if this request still holds it."""
        if progress.kv is not None:
            self.release(progress.kv.worker, request.request_id)
            progress.kv = None

    def release(self, worker: WorkerHandle, request_id: str) -> None:
        """Have the prefill worker ``worker`` stop ``request_id``'s prefill or unpin its
        lease (in the background)."""
        self.cleanup(worker, "Release", request_id,
                     prefill_pb2.ReleaseRequest(request_id=request_id))

    def cleanup(self, worker: WorkerHandle, method: str, request_id: str, message) -> None:
        """Call the clean-up RPC ``method`` (``"Abort"``, ``"Release"``) of ``worker``
        with ``message`` in the background, retried on failure (module docstring); kept
        until it ends (``wait_idle``). ``request_id`` names it in logs."""
        task = asyncio.get_running_loop().create_task(
            self._cleanup(worker, method, request_id, message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _cleanup(self, worker: WorkerHandle, method: str, request_id: str,
                       message) -> None:
        rpc = getattr(worker.stub, method)
        where = f"{worker.record.role} worker {worker.worker_id}"
        delay_s = CLEANUP_BACKOFF_S
        for attempt in range(1, CLEANUP_ATTEMPTS + 1):
            try:
                # NOTE: credentials per try: a token is good for one call
                await rpc(message, timeout=self.config.control_timeout_s,
                          metadata=self.pool.credentials(worker, method, message))
                return
            except grpc.aio.AioRpcError as exc:
                error = f"{exc.code().name}: {exc.details()}"
                if exc.code() not in _RETRIED_CODES or attempt == CLEANUP_ATTEMPTS:
                    break
            self.metrics.record_cleanup(method, retried=True)
            logger.warning("%s of request %s on %s failed (%s); try %d of %d in %.1f s",
                           method, request_id, where, error, attempt + 1, CLEANUP_ATTEMPTS,
                           delay_s)
            await asyncio.sleep(delay_s)
            delay_s *= 2
        self.metrics.record_cleanup(method, retried=False)
        logger.warning("%s of request %s on %s failed after %d tries (%s); the worker frees "
                       "it by itself: %s", method, request_id, where, attempt, error,
                       _FREED_BY_WORKER[method])


_FREED_BY_WORKER = {
    "Abort": "the request is aborted when its decode stream is cancelled, and a KV pull "
             "ends at its transfer timeout (--kv-transfer-timeout-s)",
    "Release": "a prefill whose call was cancelled is aborted, and its KV lease expires "
               "(--kv-lease-s)",
}
