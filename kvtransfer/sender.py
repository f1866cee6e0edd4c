"""The prefill side of KV transfer: sends held blocks to the decode worker that pulls them.

``KVSender.send`` serves one ``SendKV`` call: it reads the pull's ``Ticket`` from the decode
worker's store, makes or reuses the pair channel of the ticket's generation, claims the
transfer and sends header and payload (see ``protocol.py`` and ``receiver.py``). A failed
send aborts the channel and bumps the pair's generation, so the decode side makes a new
one for its next pull.

Blocks that go over the pair socket are tagged (``auth.BlockTagger``) by ``tag_blocks``
once they are written (the prefill worker calls it for each finished prefill, on this
sender's tagging thread, in the order called); a send tags a block only if it holds no
current tag then. Blocks of a CUDA cache are tagged only when they go over the pair
socket: between GPUs they go over NCCL, untagged (docs/architecture.md, KV transfer).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Sequence

import torch

from pdserve.kvtransfer import payload
from pdserve.kvtransfer.auth import (
    BlockTagger,
    PayloadDigest,
    request_bindings,
    transfer_key,
)
from pdserve.kvtransfer.channel import CLOSE_ABORT_WAIT_S, PairGroup
from pdserve.kvtransfer.handle import KVTransfer
from pdserve.kvtransfer.payload import PayloadSource, load_copy_kernels, on_device, wire_view
from pdserve.kvtransfer.protocol import (
    CLAIM_FAILED_PREFIX,
    CLAIM_QUEUE_KEY,
    CLAIM_SENDING,
    MIN_TRANSFER_S,
    CounterSet,
    Header,
    KVGeometry,
    KVPollState,
    KVTransferCounters,
    KVTransferError,
    KVTransferStats,
    Ticket,
    block_major,
    check_block_ids,
    claim_key,
    established_key,
    geometry_mismatch,
    pair_prefix,
    request_hash,
    split_address,
    ticket_key,
)
from pdserve.kvtransfer.socket_pair import byte_view
from pdserve.kvtransfer.staging import DEFAULT_STAGING_BYTES, StagingPool
from pdserve.kvtransfer.store import RemoteStore

_ABSENT = "\x00absent"  # never a ticket
TAG_WAIT_S = 1.0
"""Seconds a send waits for the tagging thread's earlier work before tagging here."""


class _Peer:
    """One decode worker as seen from here: an authenticated client of its store, the
    current group."""

    def __init__(self, address: str, decode_worker_id: str, prefix: str,
                 kv_key: bytes) -> None:
        self.address = address
        self.decode_worker_id = decode_worker_id
        self.prefix = prefix
        self.lock = threading.Lock()  # guards group making
        self.store: RemoteStore | None = None
        self.group: PairGroup | None = None
        self.group_key: tuple[str, int] | None = None
        self._kv_key = kv_key

    def connect(self, timeout_s: float) -> RemoteStore:
        """The store client, connected (and the handshake done) within ``timeout_s``.
        Raises RuntimeError (DistNetworkError, StoreAuthError) if it cannot be."""
        store = self.store
        if store is None:
            host, port = split_address(self.address)
            store = RemoteStore(host, port, self._kv_key, timeout_s)
            self.store = store
        return store

    def close(self) -> None:
        if self.group is not None:
            self.group.abort(wait_s=CLOSE_ABORT_WAIT_S)
        if self.store is not None:
            self.store.close()
        self.group, self.group_key, self.store = None, None, None


class KVSender:
    """Prefill-worker side of KV transfer. Thread-safe; ``send`` blocks (run it in a
    thread from asyncio: ``await asyncio.to_thread(sender.send, ...)``).

    Args:
        worker_id: this prefill worker's id (the registry's).
        kv_key: the cluster's KV key (``ClusterAuth.kv_key``): it proves this worker to
            decode workers' stores and keys every payload's tag (``auth``).
        kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``,
            contiguous or over block-major storage (``ModelRunner``'s: then chunks of
            consecutive ids are sent in place); blocks are read from it.
        kv_scales: a quantized cache's scales ``[num_layers, 2, num_blocks,
            num_kv_heads]`` fp32, inside its blocks (``ModelRunner.kv_scales``): blocks
            are then sent as their bytes, values and scales together. None: a float cache.
        host: the local address gloo binds to (the host of this worker's KV address).
        timeout_s: default seconds one send may take.
        connect_timeout_s: seconds to reach a decode worker's store and channel.
        staging_bytes: the most bytes of staging rings (CPU caches: chunks not sent in
            place are gathered into a ring slot first) kept for reuse across sends
            (``StagingPool``); 0 allocates them for each send.

    Raises:
        ValueError: a malformed cache, or a negative ``staging_bytes``.
    """

    def __init__(self, worker_id: str, kv_cache: torch.Tensor, host: str = "127.0.0.1",
                 *, kv_key: bytes, timeout_s: float = 30.0, connect_timeout_s: float = 30.0,
                 staging_bytes: int = DEFAULT_STAGING_BYTES,
                 kv_scales: torch.Tensor | None = None) -> None:
        self.worker_id = worker_id
        self._kv_key = kv_key
        self.geometry = KVGeometry.of(kv_cache, kv_scales)
        self.kv_cache = wire_view(kv_cache, kv_scales)  # what blocks are sent from
        load_copy_kernels(kv_cache)
        self.host = host
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._counters = CounterSet()
        self.staging = StagingPool(staging_bytes)
        self.tagger = BlockTagger(kv_key, worker_id)
        # NOTE: a block-major CPU cache's blocks as rows of bytes, for tagging in place
        self._rows = (self.kv_cache.permute(2, 0, 1, 3, 4, 5)
                      .reshape(self.kv_cache.shape[2], -1).view(torch.uint8).numpy()
                      if not self.kv_cache.is_cuda and block_major(self.kv_cache) else None)
        self._tagging = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"kv-tag-{worker_id}")

    def tag_blocks(self, block_ids: Sequence[int], bindings: Sequence[bytes]
                   ) -> concurrent.futures.Future:
        """Tag written blocks ``block_ids`` as holding ``bindings`` (one each:
        ``engine.block_hash.block_bindings``) on this sender's tagging thread, in the
        order called; the future is done once they are tagged. Call while the blocks
        are pinned (their lease). Does nothing on a CUDA cache (see the module
        docstring).

        Raises:
            ValueError: block ids repeated or out of range, or not one binding each.
            RuntimeError: the sender is closed.
        """
        ids = check_block_ids(block_ids, self.kv_cache.shape[2])
        if len(bindings) != len(ids):
            raise ValueError(f"{len(bindings)} bindings for {len(ids)} blocks")
        if self.kv_cache.is_cuda:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(None)
            return done
        return self._tagging.submit(self._tag_now, ids, list(bindings))

    def _tag_now(self, ids: list[int], bindings: list[bytes]) -> None:
        """Tag blocks ``ids`` (their wire bytes, as a send moves them) on this thread."""
        if self._rows is not None:
            rows = self._rows
            self.tagger.tag(ids, bindings, lambda i: rows[ids[i]].data)
            return
        with on_device(self.kv_cache):
            # NOTE: one block a chunk: in place where the cache is block-major
            source = payload.PayloadSource(self.kv_cache, ids, self.geometry, [1] * len(ids),
                                           False)
            try:
                self.tagger.tag(ids, bindings, lambda i: byte_view(source.chunk(i)))
            finally:
                source.release(reusable=True)

    def send(self, request_id: str, decode_worker_id: str, decode_kv_address: str,
             block_ids: Sequence[int], timeout_s: float | None = None,
             ticket: str | None = None, bindings: Sequence[bytes] | None = None
             ) -> KVTransferStats:
        """Send blocks ``block_ids`` (the payload's order) of ``request_id`` to the decode
        worker that is pulling them; return blocks, bytes and seconds moved.

        ``ticket``: the pull's ticket text (``KVPull.ticket_text``) when the decode worker
        passed it along; then it is not read back from the decode worker's store.
        ``bindings``: what each block holds (``engine.block_hash.block_bindings`` of the
        prompt, at the blocks' positions), as the decode worker expects them; None binds
        them to the request id and their place in the payload (``auth.request_bindings``,
        for callers without a prompt). Blocks without a current tag of their binding
        (``tag_blocks``) are tagged here, if they go over the pair socket.

        Raises:
            ValueError: block ids repeated or out of range, or not one binding each.
            KVTransferError: no pull of this request is waiting at the decode worker before
                the timeout, the two sides disagree on block count or geometry, the pull
                was given up, or moving the bytes failed or timed out.
        """
        transfer = KVTransfer(request_id, len(block_ids), self._deadline(timeout_s))
        known = self._parse_ticket(ticket)
        ids = check_block_ids(block_ids, self.kv_cache.shape[2])
        bindings = (request_bindings(request_id, len(ids)) if bindings is None
                    else list(bindings))
        if len(bindings) != len(ids):
            raise ValueError(f"{len(bindings)} bindings for {len(ids)} blocks")
        self._send(transfer, decode_worker_id, decode_kv_address, ids, known, bindings)
        if transfer.poll() != KVPollState.SUCCESS:
            raise transfer.failure_exception()
        return transfer.stats

    def send_failure(self, request_id: str, decode_worker_id: str, decode_kv_address: str,
                     reason: str) -> bool:
        """Tell a waiting pull that its blocks will not come (e.g. the lease expired), so
        it fails at once with ``reason``. False if no pull was waiting or it had ended."""
        peer = self._peer(decode_worker_id, decode_kv_address)
        try:
            ticket = self._read_ticket(peer, request_id, self.connect_timeout_s)
            if ticket is None:
                return False
            return self._claim(peer, request_id, ticket, CLAIM_FAILED_PREFIX + reason)
        except (RuntimeError, ValueError):  # the pull times out on its own then
            peer.store = None
            return False

    def counters(self) -> KVTransferCounters:
        """Totals of sends (bytes and seconds of the successful ones), and the sends whose
        payload is moving now (``num_in_flight``)."""
        return self._counters.snapshot()

    def close(self) -> None:
        """Abort all channels, drop store connections and free staging buffers."""
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            peer.close()
        self._tagging.shutdown(wait=False, cancel_futures=True)
        self.staging.close()

    @staticmethod
    def _parse_ticket(ticket: str | None) -> Ticket | None:
        if not ticket:
            return None
        try:
            return Ticket.decode(ticket)
        except (ValueError, IndexError, KVTransferError) as exc:
            raise ValueError(f"malformed KV ticket {ticket!r}: {exc}") from exc

    def _deadline(self, timeout_s: float | None) -> float:
        return time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)

    def _peer(self, decode_worker_id: str, address: str) -> _Peer:
        with self._lock:
            peer = self._peers.get(decode_worker_id)
            if peer is None or peer.address != address:
                if peer is not None:
                    peer.close()
                peer = _Peer(address, decode_worker_id,
                             pair_prefix(self.worker_id, decode_worker_id), self._kv_key)
                self._peers[decode_worker_id] = peer
            return peer

    def _send(self, transfer: KVTransfer, decode_worker_id: str, address: str,
              ids: list[int], known: Ticket | None, bindings: list[bytes]) -> None:
        peer = self._peer(decode_worker_id, address)
        stats, moving = None, False
        try:
            ticket = self._ticket(peer, transfer, known, decode_worker_id)
            group = self._group(peer, ticket, transfer)
            if (transfer.remaining_s() <= 0
                    or not self._claim(peer, transfer.request_id, ticket, CLAIM_SENDING)):
                raise KVTransferError(f"decode worker {decode_worker_id} gave up on request "
                                      f"{transfer.request_id} before it was sent")
            transfer.begin()
            self._counters.start()
            moving = True
            stats = self._move(group, peer, ticket, transfer, ids, bindings)
        except KVTransferError as exc:
            error = exc
        except RuntimeError as exc:  # the store connection broke (DistError is one)
            peer.store = None
            error = KVTransferError(f"decode worker {decode_worker_id} store at {address}: {exc}")
        self._counters.add(stats, moving)
        if stats is not None:
            transfer.finish(stats)
        else:
            transfer.fail(error)

    def _ticket(self, peer: _Peer, transfer: KVTransfer, known: Ticket | None,
                decode_worker_id: str) -> Ticket:
        """The pull's ticket, checked: ``known`` (passed along by the decode worker), or
        read from its store (polling, bounded by the deadline). A ticket of another
        geometry (another KV cache dtype) is refused before any channel is made."""
        delay_s = 0.0005
        ticket = known
        while ticket is None and (ticket := self._read_ticket(
                peer, transfer.request_id, transfer.remaining_s(0.001))) is None:
            if transfer.remaining_s() <= 0:
                raise KVTransferError(f"no pull of request {transfer.request_id} is waiting at "
                                      f"{peer.address} ({peer.prefix})")
            time.sleep(min(delay_s, transfer.remaining_s()))
            delay_s = min(delay_s * 2, 0.02)
        if ticket.geometry != self.geometry:
            reason = geometry_mismatch(decode_worker_id, ticket.geometry, self.worker_id,
                                       self.geometry)
            self._claim(peer, transfer.request_id, ticket, CLAIM_FAILED_PREFIX + reason)
            raise KVTransferError(f"request {transfer.request_id}: {reason}")
        if ticket.num_blocks != transfer.num_blocks:
            reason = (f"the decode side expects {ticket.num_blocks} blocks, this side has "
                      f"{transfer.num_blocks}")
            self._claim(peer, transfer.request_id, ticket, CLAIM_FAILED_PREFIX + reason)
            raise KVTransferError(f"request {transfer.request_id}: {reason}")
        return ticket

    def _read_ticket(self, peer: _Peer, request_id: str, timeout_s: float) -> Ticket | None:
        """The pull's ticket, or None; one round trip (``compare_set`` with an impossible
        expected value reads a key without blocking). Reconnects once (the decode
        worker may have restarted)."""
        key = ticket_key(peer.prefix, request_id)
        timeout_s = min(self.connect_timeout_s, timeout_s)
        try:
            value = peer.connect(timeout_s).compare_set(key, _ABSENT, _ABSENT)
        except RuntimeError:
            peer.store = None
            value = peer.connect(timeout_s).compare_set(key, _ABSENT, _ABSENT)
        return None if value.decode() == _ABSENT else Ticket.decode(value)

    def _group(self, peer: _Peer, ticket: Ticket, transfer: KVTransfer) -> PairGroup:
        """The group of the ticket's generation: cached, or made now (blocking)."""
        key = (ticket.incarnation, ticket.generation)
        with peer.lock:
            if peer.group is not None and peer.group_key == key and not peer.group.broken:
                return peer.group
            if peer.group is not None:
                peer.group.abort()
            name = f"{peer.prefix}/{ticket.incarnation}/{ticket.generation}"
            timeout_s = min(self.connect_timeout_s, transfer.remaining_s(0.001))
            try:
                self._check_not_established(peer, name, ticket)
                peer.group = PairGroup.make(peer.connect(timeout_s).clone(), name, 0, self.host,
                                            self.kv_cache.device, timeout_s,
                                            kv_key=self._kv_key)
            except KVTransferError as exc:
                peer.group = None
                self._claim(peer, transfer.request_id, ticket, f"{CLAIM_FAILED_PREFIX}{exc}")
                raise
            peer.group_key = key
            return peer.group

    def _check_not_established(self, peer: _Peer, name: str, ticket: Ticket) -> None:
        """Raise KVTransferError if the decode side's group ``name`` is already up with
        an earlier incarnation of this worker (or a group of this one that broke); then
        bump the pair's generation so that the next pull makes a new one."""
        store = peer.connect(self.connect_timeout_s)
        if not store.check([established_key(name)]):
            return
        gen = ticket.generation
        store.compare_set(f"{peer.prefix}/gen", str(gen), str(gen + 1))
        raise KVTransferError(f"pair channel {name} is up with an earlier sender (this worker "
                              "restarted, or its side broke); the next pull makes a new one")

    def _claim(self, peer: _Peer, request_id: str, ticket: Ticket, value: str) -> bool:
        """Atomically claim the pull with ``value``; True if this side won."""
        store = peer.connect(self.connect_timeout_s)
        key = claim_key(peer.prefix, request_id, ticket)
        won = store.compare_set(key, "", value).decode()
        if won != value:
            return False
        store.queue_push(CLAIM_QUEUE_KEY, f"{value[0]}\n{self.worker_id}\n{request_id}")
        return True

    def _move(self, group: PairGroup, peer: _Peer, ticket: Ticket, transfer: KVTransfer,
              ids: list[int], bindings: list[bytes]) -> KVTransferStats:
        """Header, block tags and payload; on failure abort the group and bump the
        generation."""
        start = time.monotonic()
        deadline = max(transfer.deadline, start + MIN_TRANSFER_S)
        rid_hash = request_hash(transfer.request_id)

        def make_header(seq: int) -> torch.Tensor:
            return Header(rid_hash, len(ids), self.geometry, seq).encode()

        digest = PayloadDigest(transfer_key(self._kv_key, self.worker_id, peer.decode_worker_id,
                                            transfer.request_id, ticket))

        sent = False
        try:
            with on_device(self.kv_cache):
                source = PayloadSource(self.kv_cache, ids, self.geometry, list(ticket.chunks),
                                       group.device_payload, self.staging)
                try:
                    num_bytes = group.send(make_header, source, ticket.tag, deadline, digest,
                                           lambda: self._records(ids, bindings))
                    sent = True
                finally:  # NOTE: after a failed send gloo may still read the ring
                    source.release(reusable=sent)
        except KVTransferError:
            group.abort()
            gen = ticket.generation
            # NOTE: only over a store connection already made: a decode worker that died
            # refuses new ones, and reconnecting waits up to the timeout, which would
            # hold this failed send (and its blocks) that long
            store = peer.store
            with contextlib.suppress(RuntimeError):  # the decode side sees the closed group
                if store is not None:
                    store.compare_set(f"{peer.prefix}/gen", str(gen), str(gen + 1))
            raise
        return KVTransferStats(len(ids), num_bytes, time.monotonic() - start)

    def _records(self, ids: list[int], bindings: list[bytes]) -> torch.Tensor:
        """The payload's records frame (pair socket only), once every block holds a tag
        of its binding: after the tagging thread's earlier work (``TAG_WAIT_S`` at
        most), blocks still without one are tagged here (``tagged_on_send``)."""
        untagged = [i for i, ok in enumerate(self.tagger.current(ids, bindings)) if not ok]
        if untagged:
            with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
                self._tagging.submit(lambda: None).result(timeout=TAG_WAIT_S)
            untagged = [i for i, ok in enumerate(self.tagger.current(ids, bindings))
                        if not ok]
        if untagged:
            self.tagger.count_tagged_on_send(len(untagged))
            self._tag_now([ids[i] for i in untagged], [bindings[i] for i in untagged])
        return self.tagger.records(ids, bindings)
