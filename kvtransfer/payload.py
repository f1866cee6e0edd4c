"""The payload as planes: what a sender sends and where a receiver lands it.

The payload of ``n`` blocks is ``[num_layers, 2, n, block_size, num_kv_heads, head_dim]``
and goes on the wire as its ``num_layers * 2`` planes ``[n, block_size, num_kv_heads,
head_dim]`` in order (plane ``p`` is layer ``p // 2``, K for even ``p``, V for odd).
A plane is one contiguous run of memory in the cache when its blocks have consecutive
ids, so each side, on its own, moves such a plane straight from / into its cache and
gathers / scatters the others (``pdserve.kernels.block_copy``). Example, 2 layers,
sender blocks ``[7, 8, 9]`` (consecutive), receiver blocks ``[3, 0, 5]``: the sender sends
``kv_cache[l, k, 7:10]`` for each of the 4 planes with no copy; the receiver receives
each plane into a staging buffer and scatters it into blocks 3, 0, 5.

CUDA caches over gloo stage the whole payload through pinned host memory; over NCCL the
planes are CUDA tensors. A CPU cache's staging planes are views of one buffer per
transfer from a ``StagingPool`` (``staging.py``) when the caller passes one, so they are
reused across transfers instead of faulted in afresh each time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from pdserve.kernels import cpu_ext
from pdserve.kernels.block_copy import gather_blocks, scatter_blocks
from pdserve.kvtransfer.protocol import KVGeometry
from pdserve.kvtransfer.staging import StagingLease, StagingPool


def on_device(tensor: torch.Tensor):
    """``torch.cuda.device(tensor.device)`` for a CUDA tensor, else a no-op context."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def load_copy_kernels(kv_cache: torch.Tensor) -> None:
    """Build / load the C++ block copy kernels now for a CPU cache (``cpu_ext.load``), so
    that the first gather or scatter does not build them inside a transfer's timeout
    (a first build takes 10-60 s). Never raises; without them the references serve."""
    if kv_cache.device.type == "cpu":
        cpu_ext.load()


def consecutive_start(block_ids: list[int]) -> int | None:
    """The first id if ``block_ids`` is ``[b, b+1, ..., b+n-1]`` (n >= 1), else None."""
    if not block_ids:
        return None
    first = block_ids[0]
    if all(b == first + i for i, b in enumerate(block_ids)):
        return first
    return None


def _plane_shape(geometry: KVGeometry, num_blocks: int) -> tuple[int, ...]:
    return (num_blocks, geometry.block_size, geometry.num_kv_heads, geometry.head_dim)


def send_staging_bytes(kv_cache: torch.Tensor, block_ids: list[int]) -> int:
    """Bytes of CPU staging that sending ``block_ids`` of ``kv_cache`` needs from a
    ``StagingPool``: the whole payload when the cache is on the CPU and the ids are not
    consecutive, else 0 (planes sent in place, or a CUDA cache's own staging)."""
    if kv_cache.is_cuda or consecutive_start(block_ids) is not None:
        return 0
    plane_bytes = kv_cache[0, 0, 0].numel() * kv_cache.element_size() * len(block_ids)
    return kv_cache.shape[0] * 2 * plane_bytes


def iter_send_planes(kv_cache: torch.Tensor, block_ids: list[int], device_payload: bool,
                     staging: StagingLease | None = None) -> Iterator[torch.Tensor]:
    """Yield the payload's planes in order, each contiguous ``[n, block_size,
    num_kv_heads, head_dim]`` in the cache's dtype, ready to send.

    Planes are gathered lazily, so gathering plane ``p + 1`` overlaps sending plane ``p``.
    ``device_payload``: the group carries tensors on the cache's device (NCCL); False
    with a CUDA cache stages the payload through pinned host memory for gloo.
    ``staging``: where a CPU cache's planes are gathered, of at least
    ``send_staging_bytes`` bytes (None: a new tensor per plane). The planes are views of
    it: give it back only after they are sent.
    """
    num_planes = kv_cache.shape[0] * 2
    start = consecutive_start(block_ids)
    if kv_cache.is_cuda and not device_payload:
        host = _stage_to_host(kv_cache, block_ids)  # [num_layers, 2, n, ...] pinned
        for p in range(num_planes):
            yield host[p // 2, p % 2]
        return
    if start is not None:
        yield from cache_planes(kv_cache, start, len(block_ids))  # views, no copy
        return
    ids = torch.tensor(block_ids, dtype=torch.int64, device=kv_cache.device)
    outs = [None] * num_planes
    if staging is not None and not kv_cache.is_cuda:
        shape = (1, 1, len(block_ids), *kv_cache.shape[3:])
        outs = staging.planes(num_planes, shape, kv_cache.dtype)
    for p in range(num_planes):
        layer, kv = divmod(p, 2)
        yield gather_blocks(kv_cache[layer:layer + 1, kv:kv + 1], ids, outs[p])[0, 0]


def cache_planes(kv_cache: torch.Tensor, start: int, num_blocks: int) -> list[torch.Tensor]:
    """The ``num_layers * 2`` planes of blocks ``start .. start + num_blocks - 1`` as views
    of the cache, each contiguous ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    NOTE: one ``unbind`` makes all views in one call; indexing each plane costs ~10 us of
    Python per plane, which a 1k-token pull (24 planes) pays on both sides."""
    region = kv_cache[:, :, start:start + num_blocks]  # [num_layers, 2, n, ...]
    return list(region.flatten(0, 1).unbind(0))


def _stage_to_host(kv_cache: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    ids = torch.tensor(block_ids, dtype=torch.int64, device=kv_cache.device)
    gathered = gather_blocks(kv_cache, ids)  # [num_layers, 2, n, ...] on the GPU
    host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
    host.copy_(gathered, non_blocking=True)
    torch.cuda.current_stream(kv_cache.device).synchronize()
    return host


class PayloadSink:
    """Receive buffers for one payload, and the scatter into the cache's blocks.

    Args:
        kv_cache: the receiver's cache.
        block_ids: ``n`` local block ids, in payload order.
        geometry: the cache's geometry.
        device_payload: the group carries tensors on the cache's device (NCCL).
        drain: receive and discard (the pull was cancelled after the sender started).
        staging: where a CPU cache's staging planes come from (None: new tensors). The
            sink holds one buffer of it until ``release``; call ``release`` however the
            transfer ends.
    """

    def __init__(self, kv_cache: torch.Tensor, block_ids: list[int], geometry: KVGeometry,
                 device_payload: bool, drain: bool = False,
                 staging: StagingPool | None = None) -> None:
        self.kv_cache = None if drain else kv_cache
        self.block_ids = block_ids
        self.num_planes = geometry.num_layers * 2
        self._direct = False
        self._staging = staging
        self._lease: StagingLease | None = None
        shape = _plane_shape(geometry, len(block_ids))
        self._staged_on_host = kv_cache.is_cuda and not device_payload and not drain
        if drain:
            device = kv_cache.device if device_payload else torch.device("cpu")
            scratch = torch.empty(shape, dtype=geometry.dtype, device=device)
            self.buffers = [scratch] * self.num_planes
        elif self._staged_on_host:
            self._host = torch.empty((geometry.num_layers, 2, *shape), dtype=geometry.dtype,
                                     pin_memory=True)
            self.buffers = [self._host[p // 2, p % 2] for p in range(self.num_planes)]
        else:
            self.buffers = self._cache_buffers(kv_cache, shape)

    def _cache_buffers(self, kv_cache: torch.Tensor, shape: tuple[int, ...]) -> list[torch.Tensor]:
        start = consecutive_start(self.block_ids)
        self._direct = start is not None
        if self._direct:
            return cache_planes(kv_cache, start, len(self.block_ids))
        self._ids = torch.tensor(self.block_ids, dtype=torch.int64, device=kv_cache.device)
        if self._staging is not None and not kv_cache.is_cuda:
            plane_bytes = kv_cache.dtype.itemsize * shape[0] * shape[1] * shape[2] * shape[3]
            self._lease = self._staging.take(self.num_planes * plane_bytes)
            return self._lease.planes(self.num_planes, shape, kv_cache.dtype)
        return [torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)
                for _ in range(self.num_planes)]

    def release(self, reusable: bool) -> None:
        """Give the staging buffer back to its pool (if the sink took one); idempotent.
        ``reusable``: the transfer succeeded, so no receive can still write into it."""
        if self._lease is not None:
            self._staging.give_back(self._lease, reusable)

    @property
    def copies_planes(self) -> bool:
        """Whether ``plane_done`` copies the plane (so call it as each plane lands)."""
        return self.kv_cache is not None and not self._staged_on_host and not self._direct

    def plane_done(self, p: int) -> None:
        """Plane ``p`` has arrived: scatter it into the cache unless it landed there."""
        if self.kv_cache is None or self._staged_on_host or self._direct:
            return
        layer, kv = divmod(p, 2)
        scatter_blocks(self.kv_cache[layer:layer + 1, kv:kv + 1], self._ids,
                       self.buffers[p][None, None])
        self.buffers[p] = None  # NOTE: frees the staging plane early (without a pool)

    def finish(self) -> None:
        """All planes arrived: finish the copy into the cache (and wait for the GPU)."""
        if self.kv_cache is None:
            return
        if self._staged_on_host:
            device = self.kv_cache.device
            ids = torch.tensor(self.block_ids, dtype=torch.int64, device=device)
            scatter_blocks(self.kv_cache, ids, self._host.to(device, non_blocking=True))
        if self.kv_cache.is_cuda:
            torch.cuda.current_stream(self.kv_cache.device).synchronize()
