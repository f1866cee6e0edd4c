"""A transfer in flight, as seen by the thread that started it (SGLang's poll interface)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pdserve.kvtransfer.protocol import KVPollState, KVTransferError, KVTransferStats

logger = logging.getLogger(__name__)


class KVTransfer:
    """One transfer's state, moved forward by a worker thread and read by anyone.

    ``poll()`` never blocks; ``wait()`` blocks up to a timeout; ``add_done_callback``
    calls back once it ends (from asyncio, wake the loop with it rather than park a
    thread in ``wait``: a transfer may take its whole timeout, and a pool of such
    threads, the loop's default executor above all, runs out); ``failure_exception()``
    tells why a FAILED transfer failed. All methods are thread-safe.

    Its states (``KVPollState``) and the transitions that move it, each a method:

    =================  ==================  ==============  ===========================
    from               call                to              called by
    =================  ==================  ==============  ===========================
    BOOTSTRAPPING      ``begin()``         TRANSFERRING    ``KVSender``, claim won
    any not ended      ``finish(stats)``   SUCCESS         the thread that moved bytes
    any not ended      ``fail(error)``     FAILED          that thread, or a close
    =================  ==================  ==============  ===========================

    A ``KVPull`` (``pull.py``) adds WAITING_FOR_INPUT and the transitions of a pull.
    SUCCESS and FAILED are final: no transition moves an ended transfer.
    """

    def __init__(self, request_id: str, num_blocks: int, deadline: float) -> None:
        self.request_id = request_id
        self.num_blocks = num_blocks
        self.deadline = deadline  # time.monotonic() seconds
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._state = KVPollState.BOOTSTRAPPING
        self._error: KVTransferError | None = None
        self._stats: KVTransferStats | None = None
        self._callbacks: list[Callable[[], object]] = []

    def poll(self) -> KVPollState:
        """The current state; never blocks."""
        with self._lock:
            return self._state

    def wait(self, timeout_s: float | None = None) -> KVPollState:
        """Block until SUCCESS or FAILED, or ``timeout_s`` seconds; return the state."""
        self._done.wait(timeout_s)
        return self.poll()

    def add_done_callback(self, fn: Callable[[], object]) -> None:
        """Call ``fn()`` once the transfer is SUCCESS or FAILED: on the thread that ends
        it, or at once on this one if it already ended. ``fn`` must not block (from
        asyncio: ``loop.call_soon_threadsafe``); an exception it raises is logged."""
        with self._lock:
            if not self._state.finished:
                self._callbacks.append(fn)
                return
        _call_back(fn)

    def failure_exception(self) -> KVTransferError | None:
        """Why the transfer FAILED, or None while it has not."""
        with self._lock:
            return self._error

    @property
    def stats(self) -> KVTransferStats | None:
        """Blocks, bytes and seconds moved, once SUCCESS."""
        with self._lock:
            return self._stats

    def remaining_s(self, at_least_s: float = 0.0) -> float:
        """Seconds left before the deadline (never below ``at_least_s``)."""
        return max(self.deadline - time.monotonic(), at_least_s)

    # -- transitions (called by the thread that drives the transfer: ``KVSender`` or
    # ``KVReceiver``; each takes the transfer's lock, and none moves an ended transfer)

    def begin(self) -> bool:
        """Bytes start moving: BOOTSTRAPPING or WAITING_FOR_INPUT -> TRANSFERRING.

        Called by ``KVSender`` once it won the claim (a ``KVPull`` overrides it, see
        there). Returns False, and changes nothing, if the transfer already ended.

        Raises:
            RuntimeError: it is TRANSFERRING already (a bug in the caller).
        """
        return self._move((KVPollState.BOOTSTRAPPING, KVPollState.WAITING_FOR_INPUT),
                          KVPollState.TRANSFERRING)

    def finish(self, stats: KVTransferStats) -> None:
        """End as SUCCESS with ``stats``, from any state not yet ended (a no-op once
        ended), and call the done callbacks on this thread. Called by the thread that
        moved the bytes."""
        with self._lock:
            if self._state.finished:
                return
            self._state, self._stats = KVPollState.SUCCESS, stats
            callbacks, self._callbacks = self._callbacks, []
        self._done.set()
        for fn in callbacks:
            _call_back(fn)

    def fail(self, error: KVTransferError) -> bool:
        """End as FAILED with ``error``, from any state not yet ended, and call the done
        callbacks on this thread; False if it had already ended (nothing changes).
        Called by the thread that drives the transfer, and by ``KVReceiver.close`` (a
        caller that wants a pull stopped calls ``KVPull.cancel``, which waits for bytes
        under way)."""
        with self._lock:
            if self._state.finished:
                return False
            self._state, self._error = KVPollState.FAILED, error
            callbacks, self._callbacks = self._callbacks, []
        self._done.set()
        for fn in callbacks:
            _call_back(fn)
        return True

    def _move(self, allowed: tuple[KVPollState, ...], state: KVPollState) -> bool:
        """Move from one of the ``allowed`` states to the non-final ``state``; False if
        the transfer already ended. Raises RuntimeError from any other state."""
        with self._lock:
            if self._state.finished:
                return False
            if self._state not in allowed:
                raise RuntimeError(f"KV transfer of {self.request_id}: no move from "
                                   f"{self._state.name} to {state.name}")
            self._state = state
            return True


def _call_back(fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception:  # NOTE: e.g. a closed event loop; the transfer's end stands
        logger.exception("a KV transfer's done callback failed")
