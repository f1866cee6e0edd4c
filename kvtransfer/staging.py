"""Staging memory for payload chunks that are gathered or scattered, reused across transfers.

A payload chunk whose blocks are not one contiguous region on one side goes through a
ring of staging slots on that side (``payload.py``): the sender gathers the chunk into a
slot and sends it from there, the receiver receives it into a slot and scatters it. Each
transfer side takes one buffer (``take``) for its ring, ``RING_SLOTS`` chunks of up to
8 MiB, and gives it back (``give_back``) when its bytes have moved. A fresh buffer per
transfer costs page faults on first touch (a 4k-token payload staged whole once took
~2,000 minor faults on the sender and ~6,000 on the receiver, and the sender's gathers
29 ms against ~7 ms into warm memory), so ``StagingPool`` keeps the buffers of finished
transfers and hands them to the next ones. A buffer of a failed transfer is dropped, not
reused: an aborted gloo op may still hold it. CPU memory only (a CUDA cache's staging
comes from torch's caching allocators).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

DEFAULT_STAGING_BYTES = 64 * 2**20
"""Default bound of one pool: the rings of 4 transfers in flight at once (16 MiB each)."""

_MIN_SIZE_CLASS_BYTES = 64 * 2**10


def size_class(num_bytes: int) -> int:
    """``num_bytes`` rounded up to a buffer size the pool allocates: a multiple of an
    eighth of its power of two (at most 1/8 wasted), at least 64 KiB, so that payloads of
    nearby sizes share buffers. Example: between 8 and 16 MiB the step is 1 MiB, so
    12 MiB stays 12 MiB and 12 MiB + 1 byte becomes 13 MiB."""
    num_bytes = max(num_bytes, _MIN_SIZE_CLASS_BYTES)
    step = 1 << max(num_bytes.bit_length() - 4, 0)
    return -(-num_bytes // step) * step


@dataclass(slots=True, eq=False)
class StagingLease:
    """One transfer's staging buffer, from ``StagingPool.take``.

    ``buffer`` is a uint8 CPU tensor of at least the bytes asked for; ``pooled`` says
    whether it goes back to the pool (False: allocated for this transfer alone, because
    the pool was full or closed)."""

    buffer: torch.Tensor
    pooled: bool
    returned: bool = field(default=False)


class StagingPool:
    """CPU staging buffers reused across transfers, at most ``max_bytes`` kept.

    ``take`` hands out the smallest free buffer that is large enough, else allocates one
    (``size_class`` of the request), first dropping free buffers least recently given
    back while the pool would exceed ``max_bytes``; when even that cannot make room (the
    buffers in use fill the bound), or the request alone exceeds it, the buffer is
    allocated for that transfer alone and freed after it. So the pool never holds more
    than ``max_bytes`` bytes (in use and free together), and a transfer never waits for
    one. Thread-safe; a buffer is never handed to a second transfer before the first
    gives it back.

    Args:
        max_bytes: the most bytes of buffers the pool keeps (0 disables reuse: every
            transfer gets a fresh buffer, as without a pool).

    Raises:
        ValueError: ``max_bytes`` is negative.
    """

    def __init__(self, max_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []  # least recently given back first
        self._held_bytes = 0  # pooled buffers, free or in use
        self._in_use_bytes = 0  # pooled buffers handed out and not given back
        self._closed = False

    @property
    def held_bytes(self) -> int:
        """Bytes of the buffers the pool owns, free or in use (at most ``max_bytes``)."""
        with self._lock:
            return self._held_bytes

    @property
    def in_use_bytes(self) -> int:
        """Bytes of pooled buffers handed out and not yet given back."""
        with self._lock:
            return self._in_use_bytes

    @property
    def num_free(self) -> int:
        """Free buffers waiting for a transfer."""
        with self._lock:
            return len(self._free)

    def take(self, num_bytes: int) -> StagingLease:
        """A buffer of at least ``num_bytes`` bytes for one transfer; give it back with
        ``give_back`` when the transfer ends, however it ends.

        Raises:
            ValueError: ``num_bytes`` is negative.
        """
        if num_bytes < 0:
            raise ValueError(f"num_bytes must be >= 0, got {num_bytes}")
        with self._lock:
            buffer = self._take_free(num_bytes)
            if buffer is None:
                buffer = self._make_room(size_class(num_bytes))
            if buffer is not None:
                self._in_use_bytes += buffer.numel()
                return StagingLease(buffer, pooled=True)
        return StagingLease(torch.empty(num_bytes, dtype=torch.uint8), pooled=False)

    def give_back(self, lease: StagingLease, reusable: bool = True) -> None:
        """End ``lease``'s transfer. ``reusable=False`` (the transfer failed: an aborted
        receive or send may still hold the buffer) drops the buffer instead of keeping
        it. Giving a lease back twice does nothing the second time."""
        with self._lock:
            if lease.returned:
                return
            lease.returned = True
            if not lease.pooled:
                return
            self._in_use_bytes -= lease.buffer.numel()
            if reusable and not self._closed:
                self._free.append(lease.buffer)
            else:
                self._held_bytes -= lease.buffer.numel()

    def close(self) -> None:
        """Drop the free buffers; buffers in use are dropped when given back, and later
        ``take`` calls get buffers of their own."""
        with self._lock:
            self._closed = True
            self._held_bytes -= sum(b.numel() for b in self._free)
            self._free.clear()

    def _take_free(self, num_bytes: int) -> torch.Tensor | None:
        fits = [i for i, b in enumerate(self._free) if b.numel() >= num_bytes]
        if not fits:
            return None
        best = min(fits, key=lambda i: self._free[i].numel())
        return self._free.pop(best)

    def _make_room(self, num_bytes: int) -> torch.Tensor | None:
        """A new pooled buffer of ``num_bytes``, dropping free ones least recently used
        first as needed; None if the buffers in use leave no room (lock held)."""
        if self._closed or self._in_use_bytes + num_bytes > self.max_bytes:
            return None
        while self._held_bytes + num_bytes > self.max_bytes:
            self._held_bytes -= self._free.pop(0).numel()
        self._held_bytes += num_bytes
        return torch.empty(num_bytes, dtype=torch.uint8)
