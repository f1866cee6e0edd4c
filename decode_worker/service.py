"""The decode worker's logic, apart from its gRPC skin (``server.py``).

A request's life on the decode side (SGLang's queues, here as engine states):

1. prealloc: blocks are allocated, reusing any this worker caches for the prompt's block
   hashes; if too few are free it retries each step until ``alloc_timeout_s``.
2. transfer (``WAITING_FOR_KV``): a pull of only the missing blocks is opened on the pair
   channel, and the prefill worker is asked (``SendKV``) to send them.
3. waiting: the pull succeeded; the prompt counts as computed.
4. running: the first token's KV is computed and decoding continues in the batch.

A request with no KV handle is prefilled here instead (short prompts, no prefill pool),
and so is a request migrated from a decode worker that failed: it arrives with the tokens
it already generated (``resume_token_ids``) and goes on after them.

Failures, as the router sees them: a pull that fails (the prefill worker died, its lease
expired, the transfer timed out) raises ``KVPullFailed`` (gRPC FAILED_PRECONDITION: the
router resumes the request without that KV); no free blocks in time raises
``NoFreeBlocks`` (RESOURCE_EXHAUSTED: the router tries another decode worker).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc

from pdserve.cluster.wire import KVHandle
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.llm_engine import EngineOutput
from pdserve.engine.request import Logprob
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer import KVPollState, KVPull, KVReceiver, KVTransferError

logger = logging.getLogger(__name__)

# (handle, decode worker id, decode KV address, block indices, the pull's ticket text or
# "" when nothing is pulled) -> (blocks, bytes) sent
RequestKV = Callable[[KVHandle, str, str, list[int], str], Awaitable[tuple[int, int]]]


class KVPullFailed(RuntimeError):
    """The prompt's KV could not be pulled from its prefill worker; this request's blocks
    here are freed and the worker is fine (gRPC FAILED_PRECONDITION)."""


class NoFreeBlocks(TimeoutError):
    """Too few KV blocks were free for a request within ``alloc_timeout_s``
    (gRPC RESOURCE_EXHAUSTED)."""


@dataclass(slots=True)
class DecodeStart:
    """First item of a decode stream: how much of the prompt was already here and how
    much was pulled (blocks, bytes)."""

    num_cached_tokens: int
    num_transferred_blocks: int
    num_transferred_bytes: int


class DecodeService:
    """Decodes requests whose KV is pulled from prefill workers (or prefilled locally).

    Args:
        engine: the running engine.
        receiver: this worker's KV receiver (hosts the pair channels' store).
        worker_id: this worker's registry id.
        request_kv: asks a prefill worker to send blocks (its gRPC ``SendKV``).
        transfer_timeout_s: seconds a pull may take.
        alloc_timeout_s: seconds a request may wait for free blocks.
    """

    def __init__(self, engine: AsyncEngine, receiver: KVReceiver, worker_id: str,
                 request_kv: RequestKV, transfer_timeout_s: float = 30.0,
                 alloc_timeout_s: float = 30.0) -> None:
        self.engine = engine
        self.receiver = receiver
        self.worker_id = worker_id
        self.request_kv = request_kv
        self.transfer_timeout_s = transfer_timeout_s
        self.alloc_timeout_s = alloc_timeout_s
        self._pulls: dict[str, KVPull] = {}  # request id -> its pull in flight
        self._aborted_pulls: set[str] = set()

    async def abort(self, request_id: str) -> bool:
        """Abort a request wherever it is. A pull in flight is cancelled first, so the
        request's blocks are freed at once rather than when the transfer times out.
        Returns False if the request is not here."""
        pull = self._pulls.get(request_id)
        aborted = await self.engine.abort(request_id)
        if pull is not None:
            self._aborted_pulls.add(request_id)
            await asyncio.to_thread(pull.cancel)
        return aborted or pull is not None

    async def decode(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     cache_salt: str | None = None, first_token: int | None = None,
                     first_logprob: Logprob | None = None, kv_handle: KVHandle | None = None,
                     resume_token_ids: list[int] | None = None,
                     ) -> AsyncIterator[DecodeStart | EngineOutput]:
        """Yield a ``DecodeStart``, then the request's outputs until it finishes. Closing
        the stream at any point aborts the request and frees its blocks.

        Raises:
            ValueError: bad prompt/params, a KV handle without its first token, or a KV
                handle together with ``resume_token_ids``.
            KVPullFailed: the KV pull failed (the request's blocks are freed here; the
                prefill worker keeps its lease until it expires or is released).
            NoFreeBlocks: no free blocks within ``alloc_timeout_s``.
        """
        if kv_handle is None:
            yield DecodeStart(0, 0, 0)
            async for output in self.engine.generate(request_id, prompt_token_ids, params,
                                                     cache_salt,
                                                     resume_token_ids=resume_token_ids or ()):
                yield output
            return
        if first_token is None:
            raise ValueError("first_token is required with a kv_handle")
        if resume_token_ids:
            raise ValueError("resume_token_ids and kv_handle exclude each other")
        block_size = self.engine.engine.config.block_size
        if kv_handle.num_tokens != len(prompt_token_ids) or kv_handle.block_size != block_size:
            raise ValueError(
                f"kv_handle holds {kv_handle.num_tokens} tokens in blocks of "
                f"{kv_handle.block_size}, but the prompt has {len(prompt_token_ids)} tokens "
                f"and this worker's block_size is {block_size}")
        stream = self.engine.open_stream(request_id)
        try:
            start = await self._import_kv(request_id, prompt_token_ids, params, cache_salt,
                                          first_token, first_logprob, kv_handle)
        except BaseException:
            self.engine.close_stream(request_id)
            self.engine.post(lambda e: e.abort_request(request_id))  # if it got queued
            if request_id in self._aborted_pulls:  # Abort during the pull: a clean end
                self._aborted_pulls.discard(request_id)
                yield EngineOutput(request_id, [], [], True, "abort", None,
                                   len(prompt_token_ids), 0)
                return
            raise
        outputs = self.engine.stream_outputs(request_id, stream)
        streaming = False
        try:
            yield start
            streaming = True
            async for output in outputs:
                yield output
        finally:
            if streaming:
                await outputs.aclose()  # aborts the request unless it finished
            else:  # closed at the DecodeStart: the outputs stream never started
                self.engine.close_stream(request_id)
                self.engine.post(lambda e: e.abort_request(request_id))

    async def _import_kv(self, request_id, prompt, params, cache_salt, first_token,
                         first_logprob, handle: KVHandle) -> DecodeStart:
        alloc = await self._allocate(request_id, prompt, params, cache_salt, first_token,
                                     first_logprob)
        ok = False
        try:
            try:
                if alloc.block_indices:
                    num_bytes = await self._pull(request_id, handle, alloc.block_ids,
                                                 alloc.block_indices)
                else:  # everything was cached here: just end the prefill worker's lease
                    await self.request_kv(handle, self.worker_id, self.receiver.address, [],
                                          "")
                    num_bytes = 0
            except (KVTransferError, KeyError, TimeoutError, grpc.aio.AioRpcError) as exc:
                raise KVPullFailed(f"the KV of request {request_id} could not be pulled from "
                                   f"prefill worker {handle.prefill_worker_id}: "
                                   f"{_short(exc)}") from exc
            ok = True
        finally:
            going_on = await asyncio.shield(self.engine.call(
                lambda e: e.finish_kv_transfer(request_id, ok)))
        if not going_on:
            raise asyncio.CancelledError(f"request {request_id} was aborted during its KV pull")
        return DecodeStart(alloc.num_cached_tokens, len(alloc.block_indices), num_bytes)

    async def _allocate(self, request_id, prompt, params, cache_salt, first_token,
                        first_logprob):
        await self.engine.compile_grammar(params)  # off the engine thread
        deadline = time.monotonic() + self.alloc_timeout_s
        while True:
            alloc = await self.engine.call(
                lambda e: e.add_kv_transfer_request(request_id, prompt, first_token, params,
                                                    cache_salt, first_logprob),
                undo=_undo_kv_transfer_request)
            if alloc is not None:
                return alloc
            if time.monotonic() > deadline:
                raise NoFreeBlocks(f"no free KV blocks for request {request_id} within "
                                   f"{self.alloc_timeout_s} s")
            await asyncio.sleep(0.02)

    async def _pull(self, request_id: str, handle: KVHandle, block_ids: list[int],
                    block_indices: list[int]) -> int:
        """Receive the prompt blocks at ``block_indices`` into ``block_ids``; returns bytes.
        On any failure or cancellation the pull is cancelled first, so nothing writes into
        the blocks once this returns or raises."""
        pull = self.receiver.init(request_id, handle.prefill_worker_id, block_ids,
                                  self.transfer_timeout_s)
        self._pulls[request_id] = pull
        send = asyncio.ensure_future(self.request_kv(handle, self.worker_id,
                                                     self.receiver.address, block_indices,
                                                     pull.ticket_text))
        waiting = asyncio.ensure_future(asyncio.to_thread(pull.wait, self.transfer_timeout_s))
        try:
            await asyncio.wait({send, waiting}, return_when=asyncio.FIRST_COMPLETED)
            if send.done() and send.exception() is not None:
                raise KVTransferError(f"prefill worker {handle.prefill_worker_id} did not send "
                                      f"the KV of {request_id}: {_short(send.exception())}")
            state = await waiting
            if state != KVPollState.SUCCESS:
                raise pull.failure_exception() or KVTransferError(
                    f"KV pull of {request_id} timed out after {self.transfer_timeout_s} s")
            await asyncio.wait_for(send, self.transfer_timeout_s)
            return pull.stats.num_bytes
        except BaseException:
            await asyncio.shield(asyncio.to_thread(pull.cancel))
            send.cancel()
            raise
        finally:
            self._pulls.pop(request_id, None)


def _undo_kv_transfer_request(engine, alloc) -> None:
    """Undo an ``add_kv_transfer_request`` whose caller left: no pull will come, so the
    request is aborted and its blocks freed."""
    if alloc is not None:
        engine.abort_request(alloc.request_id)
        engine.finish_kv_transfer(alloc.request_id, False)


def _short(exc: BaseException) -> str:
    """An exception as one short sentence (gRPC errors: their details only)."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc) or type(exc).__name__


__all__ = ["DecodeService", "DecodeStart", "KVPullFailed", "NoFreeBlocks"]
