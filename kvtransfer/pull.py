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
             timeout_s: float) -> None:
        try:
            self.group = PairGroup.make(store, name, 1, host, device, timeout_s)
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
    """One pull in flight (see the module docstring); made by ``KVReceiver.init``."""

    def __init__(self, request_id: str, prefill_worker_id: str, block_ids: list[int],
                 channel: RecvChannel, ticket: Ticket, deadline: float) -> None:
        super().__init__(request_id, len(block_ids), deadline)
        self.prefill_worker_id = prefill_worker_id
        self.block_ids = block_ids
        self.channel = channel
        self.ticket = ticket
        self._claimed = threading.Event()
        self._claim_pushed: str | None = None  # what the prefill side's wake-up said
        self._cancelled = False
        # receives posted before the claim (gloo): (sink, PostedRecv); dropped at the end
        self._early: tuple[PayloadSink, PostedRecv] | None = None
        self._sink: PayloadSink | None = None  # the sink the payload goes to; released at the end
        self._posted = False  # _post_early ran (from init, or from the pull's thread)

    @property
    def ticket_text(self) -> str:
        """The ticket as written into the store; pass it to the prefill worker's send
        (``KVSender.send(..., ticket=...)``) to spare it reading the store."""
        return self.ticket.encode()

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
        self._fail(KVTransferError(f"pull of request {self.request_id} was cancelled"))
        return self.poll()

    def _begin_transfer(self) -> bool:
        """Enter TRANSFERRING; False if cancelled (then the payload is drained)."""
        with self._lock:
            if self._cancelled or self._state.finished:
                return False
            self._state = KVPollState.TRANSFERRING
            return True
