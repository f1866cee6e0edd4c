"""The decode side of KV transfer: pulls blocks from prefill workers into the local cache.

A pull's life (one request, one prefill worker); the receiver moves it through
``KVPull``'s transitions (its docstring has the table), never through its state:

1. ``KVReceiver.init`` (BOOTSTRAPPING): picks the pair's channel (making a new generation
   when there is none, it broke, or the prefill side invalidated it: checked in the store
   only after a pull on it failed), writes the request's ``Ticket`` into this worker's
   store and returns a ``KVPull`` at once; the pull then runs on a long-lived thread. The
   caller then asks the prefill worker to send (gRPC ``SendKV``). A prefill worker that
   refuses the ticket (its ``KVGeometry`` differs: another KV cache dtype) says why in
   the store without joining the channel, which ends the pull at once.
2. WAITING_FOR_INPUT (``on_channel_up``): the channel's group is up; over gloo the pull
   posts its header and chunk receives at once (``post_early``, then ``post_rest``),
   straight into the cache's blocks, or into its ring's slots: in ``init`` itself when
   the channel is already up, else as soon as it is, so the sender's first bytes need no
   rendezvous round trip. It waits for the prefill side to claim the transfer (``"S"``)
   or to report that it cannot (``"F <reason>"``), which the claim watcher passes on
   (``on_claim``). At the deadline the pull gives up by claiming ``"X"`` itself: a clean
   failure that leaves the channel usable, since nothing is ever sent on its tag (tags
   are never reused on a channel); its posted receives are dropped.
3. TRANSFERRING (``begin``): header, then the payload's chunks straight into the cache's
   blocks (or through ring slots and ``scatter_blocks``). Any error here aborts the
   channel.
4. SUCCESS (``finish``) or FAILED (``fail``; ``failure_exception()``); the ticket is
   deleted at once, the claim key minutes later (so a very late prefill side finds
   ``"X"`` and sends nothing). The pull's ring, if it took one, goes back to the
   receiver's ``StagingPool`` first (``release_sink``; dropped after a failure: an
   aborted receive may still hold it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import secrets
import threading
import time
from collections import deque
from collections.abc import Sequence

import torch
import torch.distributed as dist

from pdserve.kvtransfer import socket_pair
from pdserve.kvtransfer.auth import BlockVerifier, PayloadDigest, request_bindings, transfer_key
from pdserve.kvtransfer.channel import CLOSE_ABORT_WAIT_S, PairGroup
from pdserve.kvtransfer.payload import (
    PayloadSink,
    load_copy_kernels,
    on_device,
    plan_chunks,
    wire_view,
)
from pdserve.kvtransfer.protocol import (
    CLAIM_FAILED_PREFIX,
    CLAIM_GIVEN_UP,
    CLAIM_QUEUE_KEY,
    CLAIM_SENDING,
    MIN_TRANSFER_S,
    CounterSet,
    Header,
    KVGeometry,
    KVTransferCounters,
    KVTransferError,
    KVTransferStats,
    Ticket,
    check_block_ids,
    claim_key,
    pair_prefix,
    request_hash,
    split_address,
    ticket_key,
)
from pdserve.kvtransfer.pull import KVPull, RecvChannel
from pdserve.kvtransfer.staging import DEFAULT_STAGING_BYTES, StagingPool
from pdserve.kvtransfer.store import KVStoreServer
from pdserve.kvtransfer.threads import TransferThreads

_WATCH_TIMEOUT = datetime.timedelta(days=1)
_CLAIM_KEY_TTL_S = 300.0  # longer than any sender waits before claiming
# NOTE: chunks whose receives init() posts itself; the pull's thread posts the rest at
# once. A receive costs ~10-20 us of CPU (a payload of 1024 scattered blocks is 1024
# chunks), and init() runs before the prefill side is even asked to send.
_EARLY_CHUNKS = 8
_BOOTSTRAP_POLL_S = 0.02  # how often a pull waiting for a new channel checks its claim


class KVReceiver:
    """Decode-worker side of KV transfer; hosts the pair channels' store
    (``store.KVStoreServer``: only cluster members get in).

    Args:
        worker_id: this decode worker's id (the registry's).
        kv_key: the cluster's KV key (``ClusterAuth.kv_key``): the store's handshake and
            every payload's tag (``auth``) need it.
        kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``,
            contiguous or over block-major storage (``ModelRunner``'s: then chunks of
            consecutive ids land in place), any wire dtype; pulled blocks are written
            into it.
        kv_scales: a quantized cache's scales ``[num_layers, 2, num_blocks,
            num_kv_heads]`` fp32, inside its blocks (``ModelRunner.kv_scales``): blocks
            then arrive as their bytes, values and scales together, never converted.
            None: a float cache.
        address: ``"host:port"`` to serve the store on (port 0 picks a free one); the
            host is also the address gloo binds to. ``self.address`` is the real one.
        timeout_s: default seconds a pull may take from ``init`` to its end.
        connect_timeout_s: seconds a new channel waits for its prefill worker.
        staging_bytes: the most bytes of staging rings (CPU caches: chunks that do not
            land in place are received into a ring slot, then scattered) kept for reuse
            across pulls (``StagingPool``); 0 allocates them for each pull.

    Raises:
        ValueError: a malformed cache or address, or a negative ``staging_bytes``.
        RuntimeError: the port is taken.
    """

    def __init__(self, worker_id: str, kv_cache: torch.Tensor, address: str = "127.0.0.1:0",
                 *, kv_key: bytes, timeout_s: float = 30.0, connect_timeout_s: float = 30.0,
                 staging_bytes: int = DEFAULT_STAGING_BYTES,
                 kv_scales: torch.Tensor | None = None) -> None:
        self.worker_id = worker_id
        self.geometry = KVGeometry.of(kv_cache, kv_scales)
        self.kv_cache = wire_view(kv_cache, kv_scales)  # what blocks are received into
        load_copy_kernels(kv_cache)
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.staging = StagingPool(staging_bytes)
        self._host, port = split_address(address)
        self._kv_key = kv_key
        self._server = KVStoreServer(self._host, port, kv_key, connect_timeout_s)
        self._store = self._server.local()
        self.address = f"{self._host}:{self._server.port}"
        self._incarnation = secrets.token_hex(6)
        self._lock = threading.Lock()
        self._channels: dict[str, RecvChannel] = {}
        self._pulls: dict[tuple[str, str], KVPull] = {}
        self._retired: deque[tuple[float, str]] = deque()  # (delete at, claim key)
        self._counters = CounterSet()
        self._closed = threading.Event()
        self._threads = TransferThreads(f"kv-pull-{worker_id}")
        self._connecting: list[threading.Thread] = []  # channel set-ups (under _lock)
        self._watch_store = self._store.clone()
        self._watch_store.set_timeout(_WATCH_TIMEOUT)
        self._watcher = threading.Thread(target=self._watch_claims, daemon=True,
                                         name=f"kv-claims-{worker_id}")
        self._watcher.start()

    def init(self, request_id: str, prefill_worker_id: str, block_ids: Sequence[int],
             timeout_s: float | None = None, bindings: Sequence[bytes] | None = None
             ) -> KVPull:
        """Start pulling ``len(block_ids)`` blocks of ``request_id`` from a prefill worker
        into local ``block_ids`` (payload order); returns at once (BOOTSTRAPPING).

        ``bindings``: what each block must hold (``engine.block_hash.block_bindings`` of
        the prompt at the pulled positions; the sender tags blocks with the same); a
        block whose tag is not of its binding fails the pull. None: the request id and
        the block's place in the payload (``auth.request_bindings``), as the sender's
        default.

        Ask the prefill worker to send only after this returns. ``timeout_s`` (default
        ``self.timeout_s``) bounds the whole pull. When the pair's channel is up (every
        pull but a channel's first), this also posts the pull's receives, so the
        sender's bytes never wait for a receive.

        Raises:
            ValueError: no blocks, ids out of range or repeated, not one binding each,
                or a pull of this request from this worker already in flight.
            KVTransferError: the receiver is closed or its store failed.
        """
        ids = check_block_ids(block_ids, self.kv_cache.shape[2])
        bindings = (request_bindings(request_id, len(ids)) if bindings is None
                    else list(bindings))
        if len(bindings) != len(ids):
            raise ValueError(f"{len(bindings)} bindings for {len(ids)} blocks")
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        prefix = pair_prefix(prefill_worker_id, self.worker_id)
        with self._lock:
            if self._closed.is_set():
                raise KVTransferError("the KV receiver is closed")
            if (prefill_worker_id, request_id) in self._pulls:
                raise ValueError(f"a pull of {request_id} from {prefill_worker_id} is in flight")
            try:
                channel = self._channel(prefill_worker_id, prefix)
                ticket = Ticket(self._incarnation, channel.generation, channel.next_tag(),
                                len(ids), self.geometry,
                                tuple(plan_chunks(self.kv_cache, ids, self.geometry)),
                                secrets.token_hex(16))
                pull = KVPull(request_id, prefill_worker_id, ids, channel, ticket, deadline,
                              bindings)
                self._store.set(ticket_key(prefix, request_id), ticket.encode())
            except (RuntimeError, dist.DistError) as exc:
                raise KVTransferError(f"KV receiver store failed: {exc}") from exc
            self._pulls[(prefill_worker_id, request_id)] = pull
        if channel.ready.is_set() and channel.group is not None:
            pull.on_channel_up()
            self._post_early(pull, channel.group)
        try:
            self._threads.submit(self._run, pull)
        except RuntimeError:  # NOTE: closed meanwhile; close() failed the pull
            pull.drop_early_receives()
            pull.release_sink(reusable=False)
            self._forget(pull)
        return pull

    def counters(self) -> KVTransferCounters:
        """Totals of pulls that ended (bytes and seconds of the successful ones), the
        pulls whose payload is moving now (``num_in_flight``), and the connections its KV
        store and this process's pair listeners refused (``num_refused``)."""
        return dataclasses.replace(self._counters.snapshot(), num_refused=(
            self._server.rejected + socket_pair.refused_total()))

    def close(self) -> None:
        """Fail pulls in flight, abort channels, stop serving the store, free staging
        buffers (those of pulls still running once they end). Waits for channel set-ups
        still under way, ``connect_timeout_s`` seconds at most."""
        with self._lock:
            self._closed.set()
            pulls, channels = list(self._pulls.values()), list(self._channels.values())
            self._channels.clear()
        for pull in pulls:
            pull.fail(KVTransferError("the KV receiver closed"))
        for channel in channels:
            channel.fail(wait_s=CLOSE_ABORT_WAIT_S)
        self._threads.close()
        with contextlib.suppress(RuntimeError):  # closing anyway
            self._store.queue_push(CLAIM_QUEUE_KEY, "\n")  # wakes the watcher
        self._watcher.join(timeout=5.0)
        # NOTE: a channel set-up waits in gloo for its peer up to connect_timeout_s and
        # cannot be cut short; one still waiting when the interpreter exits aborts it
        deadline = time.monotonic() + self.connect_timeout_s + 1.0
        for thread in self._connecting:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self._server.close()
        self.staging.close()

    def _channel(self, prefill_worker_id: str, prefix: str) -> RecvChannel:
        """The pair's usable channel, or a new one under a new generation (lock held)."""
        gen_key = f"{prefix}/gen"
        channel = self._channels.get(prefill_worker_id)
        if (channel is not None and not channel.failed and not channel.exhausted
                and (channel.verified or self._store.add(gen_key, 0) == channel.generation)):
            channel.verified = True
            return channel
        if channel is not None:
            channel.fail()
        channel = RecvChannel(prefix, self._store.add(gen_key, 1))
        self._channels[prefill_worker_id] = channel
        name = f"{prefix}/{self._incarnation}/{channel.generation}"
        thread = threading.Thread(target=channel.make, daemon=True, name=f"kv-connect-{name}",
                                  args=(self._store.clone(), name, self._host,
                                        self.kv_cache.device, self.connect_timeout_s,
                                        self._kv_key))
        thread.start()
        self._connecting = [t for t in self._connecting if t.is_alive()] + [thread]
        return channel

    def _watch_claims(self) -> None:
        """Wake each pull whose prefill worker claimed it (queue items
        ``"<S or F>\\n<prefill worker id>\\n<request id>"``)."""
        while not self._closed.is_set():
            try:
                item = self._watch_store.queue_pop(CLAIM_QUEUE_KEY).decode()
            except RuntimeError:  # a store timeout (DistStoreError) or the store going away
                time.sleep(0.05)
                continue
            kind, _, rest = item.partition("\n")
            prefill_worker_id, _, request_id = rest.partition("\n")
            with self._lock:
                pull = self._pulls.get((prefill_worker_id, request_id))
            if pull is not None:
                pull.on_claim(kind)

    def _run(self, pull: KVPull) -> None:
        stats, error, moving = None, None, False
        try:
            group = self._wait_channel(pull)
            if pull.on_channel_up() and not pull.posted:
                self._post_early(pull, group)
            pull.post_rest(group)  # the receives _post_early left (init stays short)
            self._await_claim(pull)
            self._counters.start()
            moving = True
            stats = self._receive(pull, group)
        except KVTransferError as exc:
            error = exc
            self._give_up(pull)
        finally:
            # NOTE: receives still posted belong to a tag nobody sends on (the pull was
            # given up, or failed); gloo keeps only weak references, so this frees them.
            # Before the end is signalled: cancel() returns only after this.
            pull.drop_early_receives()
            pull.release_sink(reusable=error is None and stats is not None)
            self._counters.add(stats, moving)
            if error is None and stats is not None:
                pull.finish(stats)
            else:
                pull.channel.verified = False
                pull.fail(error or KVTransferError(f"pull of {pull.request_id} failed"))
            self._forget(pull)

    def _wait_channel(self, pull: KVPull) -> PairGroup:
        """The pull's channel once it is up. A prefill side that refuses the pull before
        joining a new channel (another KV cache dtype, an expired lease) claims ``"F
        <reason>"``: that ends the wait at once, with the reason, rather than at the
        deadline; so does a cancel (a thread left polling here until the deadline costs
        its wake-ups, 50 a second, for nothing)."""
        while not pull.channel.ready.wait(min(_BOOTSTRAP_POLL_S, pull.remaining_s())):
            if pull.remaining_s() <= 0:
                break
            if pull.claim_pushed == CLAIM_FAILED_PREFIX[0]:
                self._await_claim(pull)  # raises the prefill side's reason
            if pull.cancelled:
                raise KVTransferError(f"pull of request {pull.request_id} was cancelled")
        return pull.channel.wait_ready(pull.deadline)

    def _post_early(self, pull: KVPull, group: PairGroup) -> None:
        """Post the pull's first receives before the prefill side claims it (gloo only;
        see ``PairGroup.post_recv`` and ``KVPull.post_early``). The claim protocol makes
        this safe: if the pull is given up ("X" wins) or the sender reports failure,
        nothing is ever sent on its tag; if it is cancelled after "S" won, ``cancel``
        waits for the payload. A group that cannot post is dead: it is aborted and the
        pull goes on without posting."""
        with on_device(self.kv_cache):
            sink = PayloadSink(self.kv_cache, pull.block_ids, self.geometry,
                               list(pull.ticket.chunks), group.device_payload,
                               staging=self.staging)
        pull.post_early(sink, group, _EARLY_CHUNKS)

    def _give_up(self, pull: KVPull) -> None:
        """Claim ``"X"`` for a failed pull unless a claim is there (a sender that holds the
        ticket, e.g. from ``SendKV``, then finds it given up and sends nothing)."""
        key = claim_key(pull.channel.prefix, pull.request_id, pull.ticket)
        with contextlib.suppress(RuntimeError):  # the store is local; best effort
            self._store.compare_set(key, "", CLAIM_GIVEN_UP)

    def _await_claim(self, pull: KVPull) -> None:
        """Return once the prefill side claimed the pull; raise KVTransferError if it
        reported a failure, or if the pull was cancelled or timed out first."""
        if pull.wait_for_claim(pull.remaining_s()) == CLAIM_SENDING:
            return  # NOTE: pushed only after the prefill side won: no round trip needed
        key = claim_key(pull.channel.prefix, pull.request_id, pull.ticket)
        try:
            value = self._store.compare_set(key, "", CLAIM_GIVEN_UP).decode()
        except RuntimeError as exc:  # the store is local; this is fatal
            raise KVTransferError(f"KV receiver store failed: {exc}") from exc
        if value == CLAIM_SENDING:
            return
        who = f"prefill worker {pull.prefill_worker_id}"
        if value.startswith(CLAIM_FAILED_PREFIX):
            raise KVTransferError(f"{who} cannot send request {pull.request_id}: "
                                  f"{value[len(CLAIM_FAILED_PREFIX):]}")
        if pull.cancelled:
            raise KVTransferError(f"pull of request {pull.request_id} was cancelled")
        raise KVTransferError(f"{who} did not start sending request {pull.request_id} "
                              "before the deadline")

    def _receive(self, pull: KVPull, group: PairGroup) -> KVTransferStats:
        """Header and payload into the blocks. Any error aborts the channel."""
        start = time.monotonic()
        deadline = max(pull.deadline, start + MIN_TRANSFER_S)
        drain = not pull.begin()  # cancelled: receive, then discard
        try:
            with on_device(self.kv_cache):
                early = pull.early_receives
                if early is not None:
                    # NOTE: posted into the blocks even if draining: cancel() waits for this
                    sink, posted = early
                else:
                    sink = PayloadSink(self.kv_cache, pull.block_ids, self.geometry,
                                       list(pull.ticket.chunks), group.device_payload, drain,
                                       staging=self.staging)
                    pull.hold_sink(sink)
                    posted = None
                digest = None if drain else PayloadDigest(transfer_key(
                    self._kv_key, pull.prefill_worker_id, self.worker_id, pull.request_id,
                    pull.ticket))
                verifier = None if drain else (lambda records: BlockVerifier(
                    self._kv_key, pull.prefill_worker_id, records, pull.bindings,
                    self.geometry.block_bytes))
                group.recv(sink, pull.ticket.tag, deadline,
                           lambda header: self._check_header(pull, header), posted, digest,
                           verifier)
                if not drain:
                    sink.finish()
        except KVTransferError as exc:
            pull.channel.fail()
            raise KVTransferError(f"pull of {pull.request_id} from prefill worker "
                                  f"{pull.prefill_worker_id}: {exc}") from exc
        if drain:
            raise KVTransferError(f"pull of request {pull.request_id} was cancelled; its "
                                  "payload was received and discarded")
        num_bytes = len(pull.block_ids) * self.geometry.block_bytes
        return KVTransferStats(len(pull.block_ids), num_bytes, time.monotonic() - start)

    def _check_header(self, pull: KVPull, header_tensor: torch.Tensor) -> int:
        """The header's seq; raises KVTransferError unless it is this pull's."""
        header = Header.decode(header_tensor)
        expected = (request_hash(pull.request_id), len(pull.block_ids), self.geometry)
        got = (header.request_hash, header.num_blocks, header.geometry)
        if got != expected:
            raise KVTransferError(f"KV header for {pull.request_id} does not match: expected "
                                  f"(request hash, blocks, geometry) {expected}, got {got}")
        return header.seq

    def _forget(self, pull: KVPull) -> None:
        """Drop the ended pull; delete its ticket now and its claim key later (a late
        prefill side then finds "X" rather than claiming a pull nobody receives)."""
        now = time.monotonic()
        with self._lock:
            if self._pulls.get((pull.prefill_worker_id, pull.request_id)) is pull:
                del self._pulls[(pull.prefill_worker_id, pull.request_id)]
            self._retired.append((now + _CLAIM_KEY_TTL_S,
                                  claim_key(pull.channel.prefix, pull.request_id, pull.ticket)))
            due = []
            while self._retired and self._retired[0][0] <= now:
                due.append(self._retired.popleft()[1])
        for key in [ticket_key(pull.channel.prefix, pull.request_id), *due]:
            with contextlib.suppress(RuntimeError):  # best effort; keys are per request
                self._store.delete_key(key)

