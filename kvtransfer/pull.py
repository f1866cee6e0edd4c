"""A pull's state on the decode side: the pair's channel at one generation, and the pull.

``KVReceiver`` (``receiver.py``) makes and drives both; the pull's life is described
there.
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from pdserve.kvtransfer.channel import PairGroup, PostedRecv
from pdserve.kvtransfer.handle import KVTransfer
from pdserve.kvtransfer.payload import PayloadSink
from pdserve.kvtransfer.protocol import (
    MIN_TRANSFER_S,
    KVPollState,
    KVTransferError,
    Ticket,
    established_key,
)

_MAX_TAG = (1 << 31) - 1  # gloo tags are C ints


class RecvChannel:
    """The decode side of one pair at one generation; its group is made in a thread."""

    def __init__(self, prefix: str, generation: int) -> None:
        self.prefix = prefix
        self.generation = generation
        self.group: PairGroup | None = None
        self.error: KVTransferError | None = None
        self.ready = threading.Event()
        self._next_tag = 0
        # NOTE: False once a pull on it failed: the next pull then checks the pair's
        # generation in the store (the prefill side may have bumped it); while pulls
        # succeed, the channel is known good and that round trip is skipped.
        self.verified = True

    def next_tag(self) -> int:
        """A tag no earlier pull on this channel used (receives of a pull that was given
        up stay posted on its tag, so tags are never reused: see ``exhausted``)."""
        self._next_tag += 1
        return self._next_tag

    @property
    def exhausted(self) -> bool:
        """All tags used: the next pull makes a new channel."""
        return self._next_tag >= _MAX_TAG

    @property
    def failed(self) -> bool:
        return self.error is not None or (self.group is not None and self.group.broken)

    def make(self, store: dist.Store, name: str, host: str, device: torch.device,
             timeout_s: float, kv_key: bytes) -> None:
        try:
            self.group = PairGroup.make(store, name, 1, host, device, timeout_s, kv_key=kv_key)
            store.set(established_key(name), "1")
        except KVTransferError as exc:
            self.error = exc
        except RuntimeError as exc:  # the store write failed
            self.error = KVTransferError(f"{name}: {exc}")
        self.ready.set()

    def wait_ready(self, deadline: float) -> PairGroup:
        if not self.ready.wait(max(deadline - time.monotonic(), 0)):
            raise KVTransferError(f"{self.prefix}: the prefill worker did not join the pair "
                                  "channel before the deadline")
        if self.error is not None:
            raise self.error
        return self.group

    def fail(self, wait_s: float = 0.0) -> None:
        """Abort the group: it is never reused (see channel.py). ``wait_s``: as
        ``PairGroup.abort``'s."""
        if self.group is not None:
            self.group.abort(wait_s)


class KVPull(KVTransfer):
    """One pull in flight (see ``receiver.py``'s docstring); made by ``KVReceiver.init``
    and driven by the receiver through the transitions below (every other caller only
    reads it, or calls ``cancel``).

    =================  ==========================  =================  ====================
    from               call                        to                 called by
    =================  ==========================  =================  ====================
    BOOTSTRAPPING      ``on_channel_up()``         WAITING_FOR_INPUT  ``init`` (channel
                                                                      up), else the
                                                                      pull's thread
    WAITING_FOR_INPUT  ``post_early(...)``         (same)             ``init`` or the
                                                                      pull's thread
    WAITING_FOR_INPUT  ``post_rest(group)``        (same)             the pull's thread
    any                ``on_claim(kind)``          (same)             the claim watcher
    WAITING_FOR_INPUT  ``begin()``                 TRANSFERRING       the pull's thread,
                                                                      claim ``"S"`` seen
    any not ended      ``finish(stats)``           SUCCESS            the pull's thread
    any not ended      ``fail(error)``             FAILED             the pull's thread,
                                                                      ``cancel``,
                                                                      ``KVReceiver.close``
    =================  ==========================  =================  ====================

    ``cancel()`` (any caller) marks the pull cancelled and wakes it: ``begin`` then
    returns False (the payload is received and discarded), ``post_early``/``post_rest``
    post nothing, and the pull ends FAILED. The receives posted early and the payload's
    sink are the pull's own: ``early_receives``, ``drop_early_receives``, ``hold_sink``,
    ``release_sink``.
    """

    def __init__(self, request_id: str, prefill_worker_id: str, block_ids: list[int],
                 channel: RecvChannel, ticket: Ticket, deadline: float,
                 bindings: list[bytes]) -> None:
        super().__init__(request_id, len(block_ids), deadline)
        self.prefill_worker_id = prefill_worker_id
        self.block_ids = block_ids
        self.bindings = bindings  # what each block must hold (``auth.BlockVerifier``)
        self.channel = channel
        self.ticket = ticket
        self._claimed = threading.Event()
        self._claim_pushed: str | None = None  # what the prefill side's wake-up said
        self._cancelled = False
        # receives posted before the claim (gloo): (sink, PostedRecv); dropped at the end
        self._early: tuple[PayloadSink, PostedRecv] | None = None
        self._sink: PayloadSink | None = None  # the sink the payload goes to; released at the end
        self._posted = False  # post_early ran (from init, or from the pull's thread)

    @property
    def ticket_text(self) -> str:
        """The ticket as written into the store; pass it to the prefill worker's send
        (``KVSender.send(..., ticket=...)``) to spare it reading the store."""
        return self.ticket.encode()

    @property
    def cancelled(self) -> bool:
        """``cancel()`` was called."""
        return self._cancelled

    @property
    def claim_pushed(self) -> str | None:
        """What the prefill side's wake-up said (``on_claim``): ``"S"``, ``"F"``, or None
        while none came."""
        return self._claim_pushed

    @property
    def posted(self) -> bool:
        """``post_early`` ran (whether or not it posted anything)."""
        return self._posted

    @property
    def early_receives(self) -> tuple[PayloadSink, PostedRecv] | None:
        """The receives ``post_early`` posted (the sink and what ``PairGroup.post_recv``
        returned), until ``drop_early_receives``; None if none are posted."""
        return self._early

    def cancel(self) -> KVPollState:
        """Stop the pull. Once this returns, nothing more is written into its blocks
        (a transfer already under way, or one whose receives are posted into the blocks,
        is waited for, up to its deadline; a later one is received and discarded).
        Returns the final state."""
        with self._lock:
            self._cancelled = True
            wait_for_end = self._state == KVPollState.TRANSFERRING or self._early is not None
        self._claimed.set()
        if wait_for_end:
            self._done.wait(self.remaining_s(at_least_s=MIN_TRANSFER_S))
        self.fail(KVTransferError(f"pull of request {self.request_id} was cancelled"))
        return self.poll()

    # -- transitions, called by the receiver (see the class docstring)

    def on_channel_up(self) -> bool:
        """The pair's channel is up: BOOTSTRAPPING (or WAITING_FOR_INPUT: a no-op) ->
        WAITING_FOR_INPUT. False if the pull already ended. Called by ``init`` when the
        channel is up already, else by the pull's thread once it is.

        Raises:
            RuntimeError: the pull is TRANSFERRING (a bug in the caller).
        """
        return self._move((KVPollState.BOOTSTRAPPING, KVPollState.WAITING_FOR_INPUT),
                          KVPollState.WAITING_FOR_INPUT)

    def post_early(self, sink: PayloadSink, group: PairGroup, num_chunks: int) -> None:
        """In WAITING_FOR_INPUT, before the claim: post the first ``num_chunks`` receives
        of the payload into ``sink`` on ``group`` (``PairGroup.post_recv``, on the
        ticket's tag), under the pull's lock; they are kept as ``early_receives`` and
        ``sink`` as the payload's sink. Nothing is posted (and ``sink`` is released) if
        the pull was cancelled or ended, or if the group posts later (NCCL); a group that
        cannot post is dead: the channel is aborted. Marks ``posted`` in every case.
        Called once, by ``init`` or by the pull's thread.

        Raises:
            RuntimeError: the pull is not in WAITING_FOR_INPUT and has not ended (a bug
                in the caller).
        """
        self._posted = True
        with self._lock:
            if self._cancelled or self._state.finished:
                sink.release(reusable=True)  # never posted
                return
            if self._state != KVPollState.WAITING_FOR_INPUT:
                sink.release(reusable=True)
                raise RuntimeError(f"pull of {self.request_id}: cannot post receives in "
                                   f"{self._state.name}")
            try:
                posted = group.post_recv(sink, self.ticket.tag, num_chunks)
            except KVTransferError:
                # NOTE: the group is dead (e.g. its sender restarted); the claim protocol
                # still decides how this pull ends (the sender reports why it cannot
                # send), and the next pull makes a new channel.
                self.channel.fail()
                sink.release(reusable=False)  # some receives may be posted
                return
            if posted is None:  # NCCL: posted later, into a sink made then
                sink.release(reusable=True)
                return
            self._early = (sink, posted)
            self._sink = sink

    def post_rest(self, group: PairGroup) -> None:
        """In WAITING_FOR_INPUT: post the receives ``post_early`` left (under the pull's
        lock; ``PairGroup.post_more``). A no-op when none were posted early, or the pull
        was cancelled or ended. A group that cannot post is dead: the channel is aborted
        and the pull goes on (and fails receiving). Called by the pull's thread."""
        with self._lock:
            if self._early is None or self._cancelled or self._state.finished:
                return
            sink, posted = self._early
            try:
                group.post_more(sink, self.ticket.tag, posted)
            except KVTransferError:
                self.channel.fail()

    def on_claim(self, kind: str) -> None:
        """The prefill side's wake-up for this pull arrived (``kind``: ``"S"`` it claimed
        the pull and sends, ``"F"`` it cannot): record it and wake ``wait_for_claim``.
        Any state. Called by the receiver's claim watcher."""
        self._claim_pushed = kind
        self._claimed.set()

    def wait_for_claim(self, timeout_s: float) -> str | None:
        """Block until ``on_claim`` or ``cancel``, or ``timeout_s`` seconds; return
        ``claim_pushed``. Called by the pull's thread."""
        self._claimed.wait(timeout_s)
        return self._claim_pushed

    def begin(self) -> bool:
        """The prefill side claimed the pull: WAITING_FOR_INPUT -> TRANSFERRING. False,
        and nothing changes, if the pull was cancelled or ended (its payload is then
        received and discarded). Called by the pull's thread.

        Raises:
            RuntimeError: the pull is BOOTSTRAPPING or TRANSFERRING (a bug in the caller).
        """
        with self._lock:
            if self._cancelled or self._state.finished:
                return False
            if self._state != KVPollState.WAITING_FOR_INPUT:
                raise RuntimeError(f"pull of {self.request_id}: no move from "
                                   f"{self._state.name} to TRANSFERRING")
            self._state = KVPollState.TRANSFERRING
            return True

    def hold_sink(self, sink: PayloadSink) -> None:
        """``sink`` is where the payload goes (made when no receives were posted early);
        ``release_sink`` gives it back. Called by the pull's thread."""
        self._sink = sink

    def drop_early_receives(self) -> None:
        """Forget the receives posted early (at the pull's end: nobody sends on its tag
        any more, and gloo holds them only weakly). Called by the receiver."""
        self._early = None

    def release_sink(self, reusable: bool) -> None:
        """Give the payload's sink's staging buffer back (``PayloadSink.release``), once;
        a no-op without a sink. Called by the receiver at the pull's end."""
        sink, self._sink = self._sink, None
        if sink is not None:
            sink.release(reusable)
