"""A transfer in flight, as seen by the thread that started it (SGLang's poll interface)."""

from __future__ import annotations

import threading
import time

from pdserve.kvtransfer.protocol import KVPollState, KVTransferError, KVTransferStats


class KVTransfer:
    """One transfer's state, moved forward by a worker thread and read by anyone.

    ``poll()`` never blocks; ``wait()`` blocks up to a timeout (from asyncio:
    ``await asyncio.to_thread(transfer.wait, timeout_s)``); ``failure_exception()``
    tells why a FAILED transfer failed. All methods are thread-safe.
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

    def poll(self) -> KVPollState:
        """The current state; never blocks."""
        with self._lock:
            return self._state

    def wait(self, timeout_s: float | None = None) -> KVPollState:
        """Block until SUCCESS or FAILED, or ``timeout_s`` seconds; return the state."""
        self._done.wait(timeout_s)
        return self.poll()

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

    def _advance(self, state: KVPollState) -> bool:
        """Move to a non-final ``state``; False if the transfer already ended."""
        with self._lock:
            if self._state.finished:
                return False
            self._state = state
            return True

    def _succeed(self, stats: KVTransferStats) -> None:
        with self._lock:
            if self._state.finished:
                return
            self._state, self._stats = KVPollState.SUCCESS, stats
        self._done.set()

    def _fail(self, error: KVTransferError) -> bool:
        """End as FAILED with ``error``; False if it had already ended."""
        with self._lock:
            if self._state.finished:
                return False
            self._state, self._error = KVPollState.FAILED, error
        self._done.set()
        return True
