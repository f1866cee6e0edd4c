"""Staging memory for payloads that are gathered or scattered, reused across transfers.

A payload whose blocks are not consecutive on one side goes through a staging buffer on
that side: the sender gathers each plane into it, the receiver receives each plane into
it and scatters from there (``payload.py``). A fresh buffer per transfer costs more than
the copy itself once it is large: fresh memory page-faults on first touch. In the KV
transfer benchmark (12 layers, bf16, random block ids) a 4k-token pull (48 MiB) took
~2,000 minor faults on the sender and ~6,000 on the receiver, and the sender's gathers
29 ms against ~7 ms into warm memory. ``StagingPool`` keeps the buffers of finished
transfers and hands them to the next ones.

One transfer takes one buffer (``take``) for all its planes and gives it back
(``give_back``) when its bytes have moved. A buffer of a failed transfer is dropped, not
reused: an aborted gloo op may still hold it. CPU memory only (a CUDA cache's staging
comes from torch's caching allocators).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

DEFAULT_STAGING_BYTES = 256 * 2**20
"""Default bound of one pool: one 16k-token payload of a ~125M Llama (12 KiB per token,
192 MiB) or several shorter ones."""

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

    def planes(self, num_planes: int, shape: tuple[int, ...],
               dtype: torch.dtype) -> list[torch.Tensor]:
        """``num_planes`` contiguous, non-overlapping ``shape`` tensors of ``dtype`` laid
        out one after another in the buffer.

        Raises:
            ValueError: they do not fit in the buffer.
        """
        plane_bytes = dtype.itemsize
        for size in shape:
            plane_bytes *= size
        if num_planes * plane_bytes > self.buffer.numel():
            raise ValueError(f"{num_planes} planes of {shape} {dtype} need "
                             f"{num_planes * plane_bytes} bytes, the buffer has "
                             f"{self.buffer.numel()}")
        return [self.buffer[p * plane_bytes:(p + 1) * plane_bytes].view(dtype).view(shape)
                for p in range(num_planes)]


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
