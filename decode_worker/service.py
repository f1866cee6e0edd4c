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

No thread waits for a pull: its end wakes the event loop (``KVTransfer.add_done_callback``),
and a cancel, which waits for a payload already moving, runs on threads of this service's
own. Pulls parked in the loop's default executor (a few threads: 6 on 2 CPUs) once held
every one of them while they waited for prefill workers that would never send, and the
cancels of abandoned requests queued behind them until the transfer timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc

from pdserve.cluster.wire import KVHandle
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.engine_outputs import EngineOutput
from pdserve.engine.request import Logprob
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer import KVPollState, KVPull, KVReceiver, KVTransferError
from pdserve.kvtransfer.protocol import MIN_TRANSFER_S
from pdserve.kvtransfer.threads import TransferThreads

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
        # request id -> the SendKV that ends the lease of a prompt cached here whole
        self._lease_ends: dict[str, asyncio.Future] = {}
        self._aborted_pulls: set[str] = set()
        # request id -> priority, of the requests whose blocks are being allocated: one
        # is not tried while another of a lower priority value waits (the scheduler's
        # order, at the door of the KV pull)
        self._allocating: dict[str, int] = {}
        self._cancels = TransferThreads(f"kv-cancel-{worker_id}")

    async def abort(self, request_id: str) -> bool:
        """Abort a request wherever it is; returns False if it is not here.

        Never waits on a KV transfer: a pull in flight is cancelled first (on a thread
        of this service's own) and the request's blocks are freed as soon as it has
        stopped, which is at once unless its payload is already moving into them (then
        once that has landed, within the transfer timeout); the SendKV that ends the
        lease of a prompt cached here whole is cancelled. The answer comes within one
        engine command (``AsyncEngine.abort``), so the router's Abort never times out
        behind a transfer."""
        pull = self._pulls.get(request_id)
        if pull is not None:
            self._aborted_pulls.add(request_id)
            self._cancels.submit(pull.cancel)
        lease_end = self._lease_ends.get(request_id)
        if lease_end is not None:
            self._aborted_pulls.add(request_id)
            lease_end.cancel()
        aborted = await self.engine.abort(request_id)
        return aborted or pull is not None or lease_end is not None

    async def decode(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     cache_salt: str | None = None, first_token: int | None = None,
                     first_logprob: Logprob | None = None, kv_handle: KVHandle | None = None,
                     resume_token_ids: list[int] | None = None, priority: int = 0,
                     ) -> AsyncIterator[DecodeStart | EngineOutput]:
        """Yield a ``DecodeStart``, then the request's outputs until it finishes. Closing
        the stream at any point aborts the request and frees its blocks. ``priority``
        (vLLM's, lower first) orders the engine's queue and, with a ``kv_handle``, the
        requests waiting for blocks to pull into.

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
                                                     resume_token_ids=resume_token_ids or (),
                                                     priority=priority):
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
                                          first_token, first_logprob, kv_handle, priority)
        except BaseException:
            self.engine.close_stream(request_id)
            self.engine.post(lambda e: e.abort_request(request_id))  # if it got queued
            if request_id in self._aborted_pulls:  # Abort during the pull: a clean end
                self._aborted_pulls.discard(request_id)
                yield EngineOutput(request_id, [], [], True, "abort", None,
                                   len(prompt_token_ids), 0)
                return
            raise
        self._aborted_pulls.discard(request_id)  # an Abort that came as the pull ended
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
                         first_logprob, handle: KVHandle, priority: int) -> DecodeStart:
        alloc = await self._allocate(request_id, prompt, params, cache_salt, first_token,
                                     first_logprob, priority)
        ok = False
        try:
            try:
                if alloc.block_indices:
                    num_bytes = await self._pull(request_id, handle, alloc.block_ids,
                                                 alloc.block_indices, alloc.bindings)
                else:  # everything was cached here: just end the prefill worker's lease
                    await self._end_lease(request_id, handle)
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
                        first_logprob, priority):
        await self.engine.compile_grammar(params)  # off the engine thread
        deadline = time.monotonic() + self.alloc_timeout_s
        self._allocating[request_id] = priority
        try:
            while True:
                if not any(p < priority for p in self._allocating.values()):
                    alloc = await self.engine.call(
                        lambda e: e.add_kv_transfer_request(request_id, prompt, first_token,
                                                            params, cache_salt, first_logprob,
                                                            priority),
                        undo=_undo_kv_transfer_request)
                    if alloc is not None:
                        return alloc
                if time.monotonic() > deadline:
                    raise NoFreeBlocks(f"no free KV blocks for request {request_id} within "
                                       f"{self.alloc_timeout_s} s")
                await asyncio.sleep(0.02)
        finally:
            self._allocating.pop(request_id, None)

    async def _end_lease(self, request_id: str, handle: KVHandle) -> None:
        """SendKV of no blocks: the prompt is cached here whole, so the prefill worker
        only unpins it. ``abort`` cancels it."""
        send = asyncio.ensure_future(self.request_kv(handle, self.worker_id,
                                                     self.receiver.address, [], ""))
        self._lease_ends[request_id] = send
        try:
            await send
        finally:
            self._lease_ends.pop(request_id, None)
            _drop(send)

    async def _pull(self, request_id: str, handle: KVHandle, block_ids: list[int],
                    block_indices: list[int], bindings: list[bytes]) -> int:
        """Receive the prompt blocks at ``block_indices`` into ``block_ids``; returns bytes.
        ``bindings``: what each must hold (``KVTransferAllocation.bindings``); the prefill
        worker's tags must be of them.
        On any failure or cancellation the pull is cancelled first, so nothing writes into
        the blocks once this returns or raises. No thread waits for it (module
        docstring)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.transfer_timeout_s
        pull = self.receiver.init(request_id, handle.prefill_worker_id, block_ids,
                                  self.transfer_timeout_s, bindings)
        self._pulls[request_id] = pull
        ended = _ended(pull)
        send = asyncio.ensure_future(self.request_kv(handle, self.worker_id,
                                                     self.receiver.address, block_indices,
                                                     pull.ticket_text))
        try:
            await asyncio.wait({send, ended}, timeout=self.transfer_timeout_s,
                               return_when=asyncio.FIRST_COMPLETED)
            if send.done() and send.exception() is not None:
                raise KVTransferError(f"prefill worker {handle.prefill_worker_id} did not send "
                                      f"the KV of {request_id}: {_short(send.exception())}")
            await asyncio.wait({ended}, timeout=max(deadline - loop.time(), 0.0))
            if pull.poll() != KVPollState.SUCCESS:
                raise pull.failure_exception() or KVTransferError(
                    f"KV pull of {request_id} timed out after {self.transfer_timeout_s} s")
            await asyncio.wait_for(send, self.transfer_timeout_s)
            return pull.stats.num_bytes
        except BaseException:
            await self._stop(pull, ended)
            raise
        finally:
            self._pulls.pop(request_id, None)
            _drop(send)

    async def _stop(self, pull: KVPull, ended: asyncio.Future) -> None:
        """Cancel ``pull`` and wait until it has ended, so that nothing writes into its
        blocks once this returns (the caller frees them next). ``KVPull.cancel`` runs on
        this service's threads: it waits for a payload already moving, at most until the
        pull's deadline (``MIN_TRANSFER_S`` at least). Being cancelled again meanwhile
        does not cut the wait short; it is raised once the pull has ended."""
        if pull.poll().finished:
            return
        self._cancels.submit(pull.cancel)
        interrupted: BaseException | None = None
        while not ended.done():
            try:
                await asyncio.wait({ended}, timeout=pull.remaining_s(MIN_TRANSFER_S) + 1.0)
            except asyncio.CancelledError as exc:
                interrupted = exc
                continue
            if not ended.done():  # NOTE: cancel() ends the pull by then; never seen
                logger.error("KV pull of %s did not end after it was cancelled",
                             pull.request_id)
                break
        if interrupted is not None:
            raise interrupted


def _ended(pull: KVPull) -> asyncio.Future:
    """A future of the running loop that is done once ``pull`` has ended (SUCCESS or
    FAILED), set from the thread that ends it."""
    loop = asyncio.get_running_loop()
    ended = loop.create_future()

    def wake() -> None:
        with contextlib.suppress(RuntimeError):  # NOTE: the loop closed: nobody waits
            loop.call_soon_threadsafe(_set_done, ended)

    pull.add_done_callback(wake)
    return ended


def _set_done(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _drop(task: asyncio.Future) -> None:
    """Cancel ``task`` if it still runs; its failure, if any, is read (it was reported
    already, or nobody waits for it any more) so asyncio does not log it as lost."""
    task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


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
