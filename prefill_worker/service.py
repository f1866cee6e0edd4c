"""The prefill worker's logic, apart from its gRPC skin (``server.py``).

A ``Prefill`` runs the prompt through the engine as a ``remote_decode`` request: it ends
after the first token and its blocks stay held under a lease. ``SendKV`` sends the blocks
the decode worker lacks over the pair channel, then unpins all of them (into the prefix
cache). ``Release`` or the lease running out unpins them too, so nothing stays pinned
when a decode worker never comes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from pdserve.cluster.wire import KVHandle
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.block_hash import hash_block_chain
from pdserve.engine.request import Logprob
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer import KVSender, KVTransferError

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PrefillResult:
    """The first token and the handle of the held KV (None when the first token already
    finished the request: then nothing is held)."""

    request_id: str
    first_token: int
    first_logprob: Logprob | None
    num_cached_tokens: int
    finish_reason: str | None
    kv_handle: KVHandle | None


@dataclass(slots=True)
class _Lease:
    block_ids: list[int]
    expires_at: float  # time.monotonic()
    sending: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)


class PrefillService:
    """Prefills prompts and serves their KV to decode workers.

    Args:
        engine: the running engine (prefill requests only).
        sender: sends blocks over pair channels.
        worker_id, kv_address: this worker's identity in the registry and KV handles.
        lease_s: seconds held blocks wait for their decode worker before being unpinned.
    """

    def __init__(self, engine: AsyncEngine, sender: KVSender, worker_id: str, kv_address: str,
                 lease_s: float = 30.0, transfer_timeout_s: float = 30.0) -> None:
        self.engine = engine
        self.sender = sender
        self.worker_id = worker_id
        self.kv_address = kv_address
        self.lease_s = lease_s
        self.transfer_timeout_s = transfer_timeout_s
        self.leases: dict[str, _Lease] = {}
        config = engine.engine.config
        self.block_size = config.block_size
        self.root_hash = engine.engine.kv_cache_manager.root_hash

    async def prefill(self, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams, cache_salt: str | None = None) -> PrefillResult:
        """Compute the prompt's KV and first token; hold the KV under a lease.

        Raises:
            ValueError: a bad prompt or parameters (from the engine).
            EngineError: the engine failed this request.
        """
        last = None
        async for output in self.engine.generate(request_id, prompt_token_ids, params,
                                                 cache_salt, remote_decode=True):
            last = output
        if last is None or last.finish_reason == "abort":
            raise asyncio.CancelledError(f"prefill of {request_id} was aborted")
        first_logprob = last.new_logprobs[0] if last.new_logprobs else None
        block_ids = await self.engine.call(lambda e: e.held_block_ids(request_id))
        if last.finish_reason is not None:  # the first token ended it: nothing to decode
            await self.engine.call(lambda e: e.release_held(request_id))
            handle = None
        else:
            handle = self._lease(request_id, prompt_token_ids, block_ids or [], cache_salt)
        return PrefillResult(request_id, last.new_token_ids[0], first_logprob,
                             last.num_cached_tokens, last.finish_reason, handle)

    def _lease(self, request_id: str, prompt: list[int], block_ids: list[int],
               cache_salt: str | None) -> KVHandle:
        self.leases[request_id] = _Lease(block_ids, time.monotonic() + self.lease_s)
        hashes = hash_block_chain(prompt, self.block_size, self.root_hash, cache_salt)
        return KVHandle(self.worker_id, self.kv_address, request_id, len(prompt), hashes,
                        self.block_size, time.time() + self.lease_s)

    async def send_kv(self, request_id: str, decode_worker_id: str, decode_kv_address: str,
                      block_indices: list[int], ticket: str | None = None) -> tuple[int, int]:
        """Send the request's blocks at ``block_indices`` (positions in its prompt's block
        list) to the pulling decode worker, then unpin every block of the request.
        ``ticket``: the pull's ticket text, when the decode worker passed it (else it is
        read from the decode worker's store). Returns (blocks, bytes) sent.

        Raises:
            KeyError: no live lease for ``request_id`` (expired, released or sent).
            ValueError: an index outside the request's blocks, or a malformed ticket.
            KVTransferError: the transfer failed or timed out.
        """
        lease = self.leases.get(request_id)
        if lease is None or lease.sending:
            raise KeyError(f"no KV lease for request {request_id!r} (expired or released)")
        bad = [i for i in block_indices if not 0 <= i < len(lease.block_ids)]
        if bad:
            raise ValueError(f"block_indices {bad} outside the request's "
                             f"{len(lease.block_ids)} blocks")
        lease.sending = True
        try:
            if not block_indices:
                return 0, 0
            stats = await asyncio.to_thread(
                self.sender.send, request_id, decode_worker_id, decode_kv_address,
                [lease.block_ids[i] for i in block_indices], self.transfer_timeout_s, ticket)
            return stats.num_blocks, stats.num_bytes
        finally:
            await self._unpin(request_id)

    async def release(self, request_id: str) -> bool:
        """Unpin a request's blocks now (the router will not decode it); False if none."""
        lease = self.leases.get(request_id)
        if lease is None or lease.sending:
            return False
        await self._unpin(request_id)
        return True

    async def expire_leases(self) -> int:
        """Unpin the blocks of every lease past its expiry; returns how many."""
        now = time.monotonic()
        expired = [rid for rid, lease in self.leases.items()
                   if lease.expires_at <= now and not lease.sending]
        for request_id in expired:
            logger.info("KV lease of %s expired; unpinning its blocks", request_id)
            await self._unpin(request_id)
        return len(expired)

    async def run_lease_reaper(self, interval_s: float = 0.5) -> None:
        """Expire leases every ``interval_s`` seconds until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.expire_leases()
            except Exception:
                logger.exception("lease reaper failed")

    async def _unpin(self, request_id: str) -> None:
        self.leases.pop(request_id, None)
        await self.engine.call(lambda e: e.release_held(request_id))


__all__ = ["KVHandle", "KVTransferError", "PrefillResult", "PrefillService"]
