"""The prefill worker's logic, apart from its gRPC skin (``server.py``).

A ``Prefill`` runs the prompt through the engine as a ``remote_decode`` request: it ends
after the first token and, in the same engine step, its blocks move under a lease
(``KVCacheManager.hold``), so no await separates the hold from its owner. ``SendKV`` sends
the blocks the decode worker lacks over the pair channel and then unpins all of them (into
the prefix cache), but only to the decode worker the lease names (``kv_consumer``: the
router names it in ``Prefill`` and, to retry elsewhere, in ``GrantKV``); an unknown lease
or another decode worker is refused before anything is sent or connected; a failed send leaves the lease standing, so the router can retry the
decode elsewhere. ``Release``, an abort, or the lease running out (the engine thread
expires leases) unpins them too, so nothing stays pinned when a decode worker never comes.

Sends run on threads of this service's own (``TransferThreads``), never in the event
loop's default executor: a send holds its thread up to the transfer timeout, and a few
stuck ones would hold back every other send, and with them the release of the leases
being sent, which waits for their end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from pdserve.cluster.wire import KVHandle
from pdserve.engine.async_engine import AsyncEngine, EngineDeadError
from pdserve.engine.block_hash import block_bindings, hash_block_chain
from pdserve.engine.request import Logprob
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer import KVSender, KVTransferError
from pdserve.kvtransfer.threads import TransferThreads

logger = logging.getLogger(__name__)


def kv_consumer(decode_worker_id: str, decode_kv_address: str) -> str:
    """How a lease names the decode worker it is for (its id and KV store address)."""
    return f"{decode_worker_id}@{decode_kv_address}"


@dataclass(slots=True)
class PrefillResult:
    """The first token and the handle of the held KV (None when the first token already
    finished the request: then nothing is held); ``prompt_logprobs`` as the engine's
    ``EngineOutput`` has them (one per prompt token, the first None) when asked for."""

    request_id: str
    first_token: int
    first_logprob: Logprob | None
    num_cached_tokens: int
    finish_reason: str | None
    kv_handle: KVHandle | None
    prompt_logprobs: list[Logprob | None] | None = None


class PrefillService:
    """Prefills prompts and serves their KV to decode workers.

    Args:
        engine: the running engine (prefill requests only); it owns the leases.
        sender: sends blocks over pair channels.
        worker_id, kv_address: this worker's identity in the registry and KV handles.
        grpc_address: this worker's advertised gRPC address, written into KV handles so
            a decode worker reaches it without the registry.
        lease_s: seconds held blocks wait for their decode worker before being unpinned
            (the engine's ``kv_lease_s``; here for the handle's expiry).
        transfer_timeout_s: seconds one send may take.
    """

    def __init__(self, engine: AsyncEngine, sender: KVSender, worker_id: str, kv_address: str,
                 lease_s: float = 30.0, transfer_timeout_s: float = 30.0,
                 grpc_address: str = "") -> None:
        self.engine = engine
        self.sender = sender
        self.worker_id = worker_id
        self.kv_address = kv_address
        self.grpc_address = grpc_address
        self.lease_s = lease_s
        self.transfer_timeout_s = transfer_timeout_s
        config = engine.engine.config
        self.block_size = config.block_size
        self.root_hash = engine.engine.kv_cache_manager.root_hash
        self._sends: set[asyncio.Task] = set()
        self._threads = TransferThreads(f"kv-send-{worker_id}")

    async def prefill(self, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams, cache_salt: str | None = None,
                      consumer: str | None = None, priority: int = 0) -> PrefillResult:
        """Compute the prompt's KV and first token; the KV stays pinned under a lease that
        only ``consumer`` (``kv_consumer(...)``; None: any decode worker) may take.
        ``priority`` (vLLM's): lower is scheduled first.
        Cancelled at any point, the request is aborted and its lease (if made) released.

        Raises:
            ValueError: a bad prompt or parameters (from the engine).
            EngineError: the engine failed this request.
        """
        last = prompt_logprobs = None
        try:
            async for output in self.engine.generate(request_id, prompt_token_ids, params,
                                                     cache_salt, remote_decode=True,
                                                     kv_consumer=consumer,
                                                     priority=priority):
                last = output
                prompt_logprobs = output.prompt_logprobs or prompt_logprobs
        except BaseException:
            self.engine.post(lambda e: e.abort_request(request_id))  # the lease, if any
            raise
        if last is None or last.finish_reason == "abort":
            raise asyncio.CancelledError(f"prefill of {request_id} was aborted")
        first_logprob = last.new_logprobs[0] if last.new_logprobs else None
        handle = None
        if last.finish_reason is None:  # else the first token ended it: nothing is held
            hashes = hash_block_chain(prompt_token_ids, self.block_size, self.root_hash,
                                      cache_salt)
            handle = KVHandle(self.worker_id, self.kv_address, request_id,
                              len(prompt_token_ids), hashes, self.block_size,
                              time.time() + self.lease_s, self.grpc_address)
            bindings = block_bindings(prompt_token_ids, self.block_size, self.root_hash,
                                      cache_salt, full_hashes=hashes)
            # NOTE: queued before this returns, so before any SendKV's engine call
            self.engine.post(lambda e: self._tag_lease(e, request_id, bindings))
        return PrefillResult(request_id, last.new_token_ids[0], first_logprob,
                             last.num_cached_tokens, last.finish_reason, handle,
                             prompt_logprobs)

    def _tag_lease(self, engine, request_id: str, bindings: list[bytes]) -> None:
        """On the engine thread: record what the lease's blocks hold and have the sender
        tag them (on its tagging thread), while the router picks a decode worker."""
        block_ids = engine.bind_kv_lease(request_id, bindings)
        if block_ids:
            try:
                self.sender.tag_blocks(block_ids, bindings)
            except RuntimeError:  # NOTE: the sender is closing; a send would tag them
                pass

    async def send_kv(self, request_id: str, decode_worker_id: str, decode_kv_address: str,
                      block_indices: list[int], ticket: str | None = None) -> tuple[int, int]:
        """Send the request's blocks at ``block_indices`` (positions in its prompt's block
        list) to the pulling decode worker; once sent, every block of the request is
        unpinned. A failed send leaves the lease until it expires. ``ticket``: the pull's
        ticket text, when the decode worker passed it (else it is read from the decode
        worker's store). Returns (blocks, bytes) sent. If the caller is cancelled, the
        send runs to its end (bounded by the transfer timeout) before the lease is
        touched, so no block is unpinned while it is being read.

        Raises:
            KeyError: no live lease for ``request_id`` (expired, released or sent).
            PermissionError: the lease is for another decode worker.
            ValueError: an index outside the request's blocks, or a malformed ticket.
            KVTransferError: the transfer failed or timed out.
        """
        consumer = kv_consumer(decode_worker_id, decode_kv_address)
        block_ids, bindings = await self.engine.call(
            lambda e: (e.begin_kv_send(request_id, consumer), e.kv_lease_bindings(request_id)),
            undo=lambda e, _: e.end_kv_send(request_id, False))
        task = asyncio.ensure_future(self._send(request_id, decode_worker_id,
                                                decode_kv_address, block_ids, block_indices,
                                                ticket, bindings))
        self._sends.add(task)  # NOTE: a strong reference while it runs, even if we leave
        task.add_done_callback(self._send_ended)
        return await asyncio.shield(task)

    async def _send(self, request_id: str, decode_worker_id: str, decode_kv_address: str,
                    block_ids: list[int], block_indices: list[int], ticket: str | None,
                    bindings: list[bytes] | None) -> tuple[int, int]:
        ok = False
        try:
            bad = [i for i in block_indices if not 0 <= i < len(block_ids)]
            if bad:
                raise ValueError(f"block_indices {bad} outside the request's "
                                 f"{len(block_ids)} blocks")
            if block_indices and (bindings is None
                                  or any(i >= len(bindings) for i in block_indices)):
                raise KVTransferError(f"the KV lease of {request_id} records no bindings "
                                      "for the blocks asked")
            if block_indices:
                stats = await _on_thread(
                    self._threads, self.sender.send, request_id, decode_worker_id,
                    decode_kv_address, [block_ids[i] for i in block_indices],
                    self.transfer_timeout_s, ticket, [bindings[i] for i in block_indices])
                result = stats.num_blocks, stats.num_bytes
            else:
                result = 0, 0
            ok = True
            return result
        finally:
            with contextlib.suppress(EngineDeadError):  # stopping: the leases go with it
                await asyncio.shield(self.engine.call(lambda e: e.end_kv_send(request_id, ok)))

    def _send_ended(self, task: asyncio.Task) -> None:
        """Forget an ended send; its failure is read here too, since a caller that left
        (the decode worker gave up on the pull) never reads it."""
        self._sends.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.debug("send of a KV lease failed: %s", task.exception())

    async def grant(self, request_id: str, decode_worker_id: str,
                    decode_kv_address: str) -> bool:
        """Let another decode worker take ``request_id``'s lease; False if no lease is
        live (or one is being sent)."""
        consumer = kv_consumer(decode_worker_id, decode_kv_address)
        return await self.engine.call(lambda e: e.grant_kv(request_id, consumer))

    async def release(self, request_id: str) -> bool:
        """Stop a prefill or unpin its lease now (the router will not decode it); a lease
        being sent is unpinned when the send ends. False if neither is here."""
        return await self.engine.call(lambda e: e.abort_request(request_id))


def _on_thread(threads: TransferThreads, fn, *args) -> asyncio.Future:
    """``fn(*args)`` on one of ``threads``; a future of the running loop with its result
    or exception."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result, error) -> None:
        if future.done():  # NOTE: the awaiting task was cancelled; the result is moot
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def run() -> None:
        result, error = None, None
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            error = exc
        with contextlib.suppress(RuntimeError):  # NOTE: the loop closed: nobody waits
            loop.call_soon_threadsafe(settle, result, error)

    threads.submit(run)
    return future


__all__ = ["KVHandle", "KVTransferError", "PrefillResult", "PrefillService"]
