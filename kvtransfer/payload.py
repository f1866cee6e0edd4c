"""The payload as messages: what a sender sends and where a receiver lands it.

The payload of ``n`` blocks goes on the wire block-major, ``[n, num_layers, 2,
block_size, num_kv_heads, head_dim]`` (each block's KV of all layers, in payload order),
cut into messages ("chunks") of whole blocks. Over NCCL it is one message. Over the pair
socket (``socket_pair.py``, every transfer that is not NCCL's) the receiver picks the cut
(``plan_chunks``) and its ticket carries it to the sender: with a block-major cache
(``ModelRunner``'s: one block's KV of all layers is one contiguous run, see
``block_major``) it cuts at every break in its local block ids and every
``CHUNK_BYTES`` within a run, so every message lands in place, with no copy. Then each
side decides on its own, per chunk, how to move it:

- direct: the side's cache is block-major and the chunk's block ids are consecutive
  there, so the chunk is one contiguous region of the cache: it is sent from, or
  received into, the cache itself;
- staged: otherwise the chunk is gathered into (sender) or received into and scattered
  from (receiver) one of ``RING_SLOTS`` ring slots, and gathering chunk ``c + 1``
  overlaps sending chunk ``c``.

Example, block-major caches, sender blocks ``[7, 8, 9, 2]``, receiver blocks
``[3, 0, 1, 5]``: the receiver cuts ``[1, 2, 1]``; the sender sends ``storage[7]``,
``storage[8:10]`` and ``storage[2]`` in place, the receiver receives them into blocks 3,
0-1 and 5 in place. A layer-major receiver (any test cache) would cut ``[4]`` and stage
it; the sender then gathers blocks 7-9 and 2 into a ring slot.

Why not stage scattered blocks into larger messages: on a 2-core host (loopback) a
16k-token payload (192 MiB, 12 layers) of random block ids moved at 0.5-0.6 of one plain
send when staged on both sides in 2 MiB chunks (the gathers and scatters ran at a third of
their speed alone, competing with the socket copies), no better than one message per
block (192 KiB: 1024 messages took 1.26x as long as one message in a bare gloo test).
Why 8 MiB: a 1k-token payload (12 MiB) sent as six 2 MiB messages took the sender 5-7 ms
against 3-5 ms as one; at 16k, 2 MiB and 16 MiB messages measured alike.
Why one message per block from ``BLOCK_MESSAGE_BYTES`` (512 KiB) up: with a Llama 3 8B
geometry (2 MiB blocks), random prefill ids into consecutive decode ids moved at 0.6 of
plain send/recv when the sender gathered 8 MiB messages, and at 0.8-1.0 one block per
message in place; with 512 KiB blocks 0.65-0.73 against 0.84-0.93. At 192 KiB the two
measured alike, so smaller blocks keep the gather (fewer messages).

A CUDA cache over the pair socket stages the whole payload through pinned host memory, whose chunks
are then sent or received in place; over NCCL a gathered payload is a CUDA tensor. A CPU
cache's ring comes from a ``StagingPool`` (``staging.py``) when the caller passes one.

A tensor-parallel worker's cache (``KVShards``: each rank's share of the KV heads) moves
as whole blocks of all heads, every chunk staged: gathered from every rank's head range
(sender), scattered into every rank's (receiver).

A quantized cache (int8 / fp8 values, each block's fp32 scales in its own bytes) moves
as its blocks' bytes: sender and receiver work on its ``wire_view``, the block storage
seen as ``[1, 1, num_blocks, 1, 1, block_bytes]`` uint8, so every path above (in place,
staged, CUDA) copies values and scales together, bit for bit, and nothing is converted.
"""

from __future__ import annotations

import contextlib

import torch

from pdserve.kernels import cpu_ext
from pdserve.kernels.block_copy import gather_blocks, scatter_blocks
from pdserve.kernels.kv_shards import KVShards
from pdserve.kvtransfer.protocol import KVGeometry, block_major
from pdserve.kvtransfer.staging import StagingLease, StagingPool

CHUNK_BYTES = 8 * 2**20
"""The most bytes of one pair-socket message, unless one block is larger (a chunk is at least
one block). Part of the receiver's cut only: the sender follows the ticket."""

BLOCK_MESSAGE_BYTES = 512 * 2**10
"""Blocks at least this large go one per message, so no side ever gathers or scatters
them (each block of a block-major cache is one region): at this size a message's fixed
cost is small beside its bytes, and cheaper than a copy. Part of the receiver's cut."""

RING_SLOTS = 2
"""Staging slots per transfer side: chunks gathered (or received) ahead of the one that
is moving."""


def on_device(tensor: torch.Tensor):
    """``torch.cuda.device(tensor.device)`` for a CUDA tensor, else a no-op context."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def load_copy_kernels(kv_cache: torch.Tensor) -> None:
    """Build / load the C++ block copy kernels now for a CPU cache (``cpu_ext.load``), so
    that the first gather or scatter does not build them inside a transfer's timeout
    (a first build takes 10-60 s). Never raises; without them the references serve."""
    if kv_cache.device.type == "cpu":
        cpu_ext.load()


def wire_view(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
    """What a side moves blocks of: ``kv_cache`` itself, or for a quantized cache (with
    ``kv_scales``; ``KVGeometry.of`` checks their layout) its block storage as
    ``[1, 1, num_blocks, 1, 1, block_bytes]`` uint8 (the block gather/scatter kernels'
    layout: one plane of byte rows)."""
    if kv_scales is None:
        return kv_cache
    num_blocks, block_bytes = kv_cache.shape[2], kv_cache.stride(2)
    return torch.empty(0, dtype=torch.uint8, device=kv_cache.device).set_(
        kv_cache.untyped_storage(), kv_cache.storage_offset(), (1, 1, num_blocks, 1, 1, block_bytes),
        (num_blocks * block_bytes, num_blocks * block_bytes, block_bytes, block_bytes,
         block_bytes, 1))


def block_shape(kv_cache: torch.Tensor) -> tuple[int, ...]:
    """One block of a (wire view of a) cache as the payload holds it: ``[num_layers, 2,
    block_size, num_kv_heads, head_dim]`` (``[1, 1, 1, 1, block_bytes]`` for bytes)."""
    return (*kv_cache.shape[:2], *kv_cache.shape[3:])


def consecutive_start(block_ids: list[int]) -> int | None:
    """The first id if ``block_ids`` is ``[b, b+1, ..., b+n-1]`` (n >= 1), else None."""
    if not block_ids:
        return None
    first = block_ids[0]
    if all(b == first + i for i, b in enumerate(block_ids)):
        return first
    return None


def plan_chunks(kv_cache: torch.Tensor, block_ids: list[int], geometry: KVGeometry) -> list[int]:
    """The receiver's cut of a pair-socket payload into messages: their sizes in blocks, in
    payload order (the ticket carries them to the sender).

    A block-major CPU cache cuts at every break in its consecutive runs of local ids, and
    within a run every ``CHUNK_BYTES``, so every message lands in place; any other cache
    (layer-major, or a CUDA cache staged through host memory) cuts every ``CHUNK_BYTES``.
    Blocks of ``BLOCK_MESSAGE_BYTES`` or more go one per message, so that the sender too
    sends each in place, whatever its ids. Example, block_bytes 128 KiB, local ids
    ``[4, 5, 6, 9, 2, 3]``, ``CHUNK_BYTES`` 256 KiB: ``[2, 1, 1, 2]``.
    """
    if geometry.block_bytes >= BLOCK_MESSAGE_BYTES:
        return [1] * len(block_ids)
    per_chunk = max(1, CHUNK_BYTES // geometry.block_bytes)
    n = len(block_ids)
    if kv_cache.is_cuda or not block_major(kv_cache):
        return [min(per_chunk, n - s) for s in range(0, n, per_chunk)]
    sizes, run = [], 0
    for i, block in enumerate(block_ids):
        if run and (run == per_chunk or block != block_ids[i - 1] + 1):
            sizes.append(run)
            run = 0
        run += 1
    return [*sizes, run] if run else sizes


class _Chunks:
    """One side's plan: the payload's chunks (``sizes`` blocks each), and for each either
    the first of its consecutive local block ids in a block-major cache (direct) or a
    ring slot (staged).

    ``staged_everything`` forces every chunk through the ring (a drain)."""

    def __init__(self, kv_cache: torch.Tensor, block_ids: list[int], geometry: KVGeometry,
                 sizes: list[int], staged_everything: bool = False) -> None:
        self.geometry = geometry
        self.block_ids = block_ids
        self._dtype, self._block_shape = kv_cache.dtype, block_shape(kv_cache)
        self.bounds, start = [], 0
        for size in sizes:
            self.bounds.append((start, start + size))
            start += size
        direct_ok = not staged_everything and block_major(kv_cache) and bool(block_ids)
        # NOTE: [num_blocks, block_bytes] uint8 view of block-major storage, made once:
        # slicing it costs ~1 us per chunk, re-deriving views from the cache ~6 us
        self._blocks = (kv_cache.permute(2, 0, 1, 3, 4, 5).reshape(kv_cache.shape[2], -1)
                        .view(torch.uint8) if direct_ok else None)
        self.direct = [consecutive_start(block_ids[s:e]) if direct_ok else None
                       for s, e in self.bounds]
        staged_sizes = [e - s for (s, e), d in zip(self.bounds, self.direct) if d is None]
        self.num_slots = min(len(staged_sizes), RING_SLOTS)
        self.slots: list[int | None] = []
        staged = 0
        for d in self.direct:  # NOTE: staged chunks take the slots in turn
            self.slots.append(None if d is not None else staged % self.num_slots)
            staged += d is None
        self.slot_bytes = max(staged_sizes, default=0) * geometry.block_bytes

    @property
    def num_chunks(self) -> int:
        return len(self.bounds)

    @property
    def all_direct(self) -> bool:
        return all(d is not None for d in self.direct)

    def stage_whole(self) -> None:
        """No ring: the side copies the whole payload at once (a CUDA cache) and moves
        every chunk in place from / into that copy."""
        self.slots = [None] * self.num_chunks
        self.num_slots = self.slot_bytes = 0

    def take_ring(self, staging: StagingPool | None) -> StagingLease | None:
        """The ring's buffer (``num_slots`` slots), from ``staging`` when given; None when
        no chunk is staged."""
        ring_bytes = self.num_slots * self.slot_bytes
        if not ring_bytes:
            return None
        if staging is not None:
            return staging.take(ring_bytes)
        return StagingLease(torch.empty(ring_bytes, dtype=torch.uint8), pooled=False)

    def region(self, c: int) -> torch.Tensor:
        """Chunk ``c``'s region of a block-major cache, as uint8 bytes (direct chunks)."""
        start, stop = self.bounds[c]
        first = self.direct[c]
        return self._blocks[first:first + stop - start].view(-1)

    def slot_view(self, ring: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunk ``c``'s ring slot as (uint8 bytes, ``[num_layers, 2, k, block_size,
        num_kv_heads, head_dim]`` view of its block-major contents, or ``[1, 1, k, 1, 1,
        block_bytes]`` for a quantized cache's bytes)."""
        start, stop = self.bounds[c]
        raw = ring[self.slots[c] * self.slot_bytes:][:(stop - start) * self.geometry.block_bytes]
        blocks = raw.view(self._dtype).view(stop - start, *self._block_shape)
        return raw, blocks.permute(1, 2, 0, 3, 4, 5)


class _PayloadSide:
    """What the sender's and the receiver's sides share: the plan and the ring's lease."""

    _plan: _Chunks
    _staging: StagingPool | None = None
    _lease: StagingLease | None = None
    _whole_bytes: torch.Tensor | None = None  # CUDA: the whole payload as uint8 bytes

    @property
    def num_chunks(self) -> int:
        return self._plan.num_chunks

    def slot_of(self, c: int) -> int | None:
        """The ring slot chunk ``c`` moves through, or None (moved in place)."""
        return self._plan.slots[c]

    def _in_place(self, c: int) -> torch.Tensor | None:
        """Chunk ``c``'s bytes where it moves without a ring slot (a slice of the whole
        staged payload, or its region of a block-major cache); None if it is staged."""
        if self._whole_bytes is not None:
            start, stop = self._plan.bounds[c]
            block_bytes = self._plan.geometry.block_bytes
            return self._whole_bytes[start * block_bytes:stop * block_bytes]
        if self._plan.slots[c] is None:
            return self._plan.region(c)
        return None

    def release(self, reusable: bool) -> None:
        """Give the ring back to its pool (if this side took one); idempotent.
        ``reusable``: the transfer succeeded (after a failure the socket may still write into it)."""
        if self._lease is not None and self._staging is not None:
            self._staging.give_back(self._lease, reusable)


class PayloadSource(_PayloadSide):
    """The sender's payload as ``num_chunks`` messages (see the module docstring).

    Args:
        kv_cache: the sender's cache ``[num_layers, 2, num_blocks, block_size,
            num_kv_heads, head_dim]``, or a quantized cache's ``wire_view``.
        block_ids: the ``n`` local block ids, in payload order.
        geometry: the cache's geometry.
        sizes: the receiver's message sizes in blocks (``plan_chunks``, from its ticket);
            ignored over NCCL, where the payload is one message.
        device_payload: the group carries CUDA tensors (NCCL).
        staging: where a CPU cache's ring comes from (None: a new tensor). Call
            ``release`` however the transfer ends.

    Call ``chunk(c)`` in order ``c = 0, 1, ...``, and only once the send of the chunk
    that last used ``slot_of(c)`` has completed.
    """

    def __init__(self, kv_cache: torch.Tensor, block_ids: list[int], geometry: KVGeometry,
                 sizes: list[int], device_payload: bool,
                 staging: StagingPool | None = None) -> None:
        self.kv_cache = kv_cache
        self._staging = staging
        self._plan = _Chunks(kv_cache, block_ids, geometry,
                             [len(block_ids)] if device_payload else sizes)
        if kv_cache.is_cuda and not (device_payload and self._plan.all_direct):
            self._whole_bytes = _gather_whole(kv_cache, block_ids, pinned=not device_payload)
            self._plan.stage_whole()
        self._lease = self._plan.take_ring(staging)
        self._ids = (torch.tensor(block_ids, dtype=torch.int64) if self._lease is not None
                     else None)

    def chunk(self, c: int) -> torch.Tensor:
        """Chunk ``c`` as contiguous uint8 bytes, gathered into its slot if staged."""
        wire = self._in_place(c)
        if wire is not None:
            return wire
        start, stop = self._plan.bounds[c]
        raw, blocks = self._plan.slot_view(self._lease.buffer, c)
        if isinstance(self.kv_cache, KVShards):
            self.kv_cache.gather(self._ids[start:stop], blocks)
        else:
            gather_blocks(self.kv_cache, self._ids[start:stop], blocks)
        return raw


def _gather_whole(kv_cache: torch.Tensor, block_ids: list[int], pinned: bool) -> torch.Tensor:
    """A CUDA cache's blocks as one block-major payload, uint8 bytes: on the GPU, or
    (``pinned``) copied to pinned host memory for the pair socket."""
    ids = torch.tensor(block_ids, dtype=torch.int64, device=kv_cache.device)
    blocks = kv_cache.index_select(2, ids).permute(2, 0, 1, 3, 4, 5).contiguous()
    if pinned:
        host = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=True)
        host.copy_(blocks, non_blocking=True)
        torch.cuda.current_stream(kv_cache.device).synchronize()
        blocks = host
    return blocks.reshape(-1).view(torch.uint8)


class PayloadSink(_PayloadSide):
    """Receive buffers for one payload, and the scatter into the cache's blocks.

    Args:
        kv_cache: the receiver's cache, or a quantized cache's ``wire_view``.
        block_ids: ``n`` local block ids, in payload order.
        geometry: the cache's geometry.
        sizes: the message sizes in blocks (``plan_chunks``, as in the pull's ticket);
            ignored over NCCL, where the payload is one message.
        device_payload: the group carries tensors on the cache's device (NCCL).
        drain: receive and discard (the pull was cancelled after the sender started).
        staging: where a CPU cache's ring comes from (None: a new tensor). The sink holds
            one buffer of it until ``release``; call ``release`` however the transfer
            ends.

    Post the receive of chunk ``c`` (into ``buffer(c)``) only once ``chunk_done`` ran
    for the chunk that last used ``slot_of(c)``.
    """

    def __init__(self, kv_cache: torch.Tensor, block_ids: list[int], geometry: KVGeometry,
                 sizes: list[int], device_payload: bool, drain: bool = False,
                 staging: StagingPool | None = None) -> None:
        self.kv_cache = None if drain else kv_cache
        self.block_ids = block_ids
        self._staging = staging
        self._whole: torch.Tensor | None = None  # CUDA: the payload as received
        self._plan = _Chunks(kv_cache, block_ids, geometry,
                             [len(block_ids)] if device_payload else sizes,
                             staged_everything=drain)
        if kv_cache.is_cuda and not (device_payload and self._plan.all_direct):
            whole_shape = (len(block_ids), *block_shape(kv_cache))
            self._whole = torch.empty(whole_shape, dtype=kv_cache.dtype,
                                      device=kv_cache.device if device_payload else "cpu",
                                      pin_memory=not device_payload)
            self._whole_bytes = self._whole.view(-1).view(torch.uint8)
            self._plan.stage_whole()
        self._lease = self._plan.take_ring(staging)
        self._ids = (torch.tensor(block_ids, dtype=torch.int64, device=kv_cache.device)
                     if self._lease is not None or self._whole is not None else None)

    @property
    def uses_ring(self) -> bool:
        """Whether some chunks land in ring slots: then call ``chunk_done`` as each one
        lands (it scatters unless draining), and post the next receives as slots free."""
        return self._plan.num_slots > 0

    def buffer(self, c: int) -> torch.Tensor:
        """Where chunk ``c`` is received: contiguous uint8 bytes."""
        wire = self._in_place(c)
        if wire is not None:
            return wire
        return self._plan.slot_view(self._lease.buffer, c)[0]

    def chunk_done(self, c: int) -> None:
        """Chunk ``c`` has arrived: scatter it into the cache unless it landed there."""
        if self.kv_cache is None or self._plan.slots[c] is None:
            return
        start, stop = self._plan.bounds[c]
        blocks = self._plan.slot_view(self._lease.buffer, c)[1]
        if isinstance(self.kv_cache, KVShards):
            self.kv_cache.scatter(self._ids[start:stop], blocks)
        else:
            scatter_blocks(self.kv_cache, self._ids[start:stop], blocks)

    def finish(self) -> None:
        """All chunks arrived: finish the copy into the cache (and wait for the GPU)."""
        if self.kv_cache is None:
            return
        if self._whole is not None:
            blocks = self._whole.to(self.kv_cache.device, non_blocking=True)
            self.kv_cache.index_copy_(2, self._ids, blocks.permute(1, 2, 0, 3, 4, 5))
        if self.kv_cache.is_cuda:
            torch.cuda.current_stream(self.kv_cache.device).synchronize()
