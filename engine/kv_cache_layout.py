"""How one worker's KV cache lies in memory (docs/architecture.md, The KV cache).

The cache is block-major: block ``b``'s K and V of every layer are one contiguous run of
``block_bytes``, so the KV transfer moves runs of blocks as byte regions. A float cache
(``--kv-cache-dtype auto``: the model's dtype) is ``[num_blocks, num_layers, 2,
block_size, num_kv_heads, head_dim]``. A quantized cache (int8, fp8;
``kernels/kv_quant.py``) is ``[num_blocks, block_bytes]`` bytes, each block its values
then its scales::

    block b: | values [num_layers, 2, block_size, num_kv_heads, head_dim] (1 byte each)
             | scales [num_layers, 2, num_kv_heads] fp32, from a 64-byte boundary
             | padding to a multiple of 64 bytes

Worked example, 2 layers, block_size 16, 2 kv heads, head_dim 32: 4096 bytes of int8
values, 32 bytes of scales at offset 4096, 4160 bytes per block (8192 in bf16: 1.97x as
many blocks in the same memory).

The model sees layer-major views: ``kv_cache [num_layers, 2, num_blocks, block_size,
num_kv_heads, head_dim]`` (the values) and, quantized, ``kv_scales [num_layers, 2,
num_blocks, num_kv_heads]``, both with a block stride of one block's bytes.
"""

from __future__ import annotations

import mmap
import os
import sys
from dataclasses import dataclass

import torch

from pdserve.engine.config import ModelConfig
from pdserve.kernels.kv_quant import is_quantized, kv_cache_torch_dtype

_HUGE_PAGE_BYTES = 2 << 20  # x86-64 and arm64 transparent huge pages
ALIGN_BYTES = 64
"""Quantized blocks and their scales start on cache lines."""


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def cpu_zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed, contiguous CPU tensor of ``shape`` and ``dtype`` whose memory Linux backs
    with 2 MiB transparent huge pages (``madvise(MADV_HUGEPAGE)``), where it can.

    Decode attention reads the KV cache a block (a few KiB) at a time from scattered
    places; on 4 KiB pages nearly every block costs a TLB miss, and huge pages make the
    C++ decode kernel about 13% faster on a DRAM-resident cache. Takes up to 2 MiB more
    address space than the tensor's bytes to align it. Where the kernel refuses the advice
    (built without THP) the pages stay 4 KiB; off Linux, or without ``MADV_HUGEPAGE``,
    this is ``torch.zeros``. The tensor keeps its mapping alive.
    """
    if sys.platform != "linux" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    length = -(-(nbytes + _HUGE_PAGE_BYTES) // _HUGE_PAGE_BYTES) * _HUGE_PAGE_BYTES
    mapping = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # NOTE: a kernel built without THP (EINVAL): plain pages, same tensor
        pass
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # NOTE: holds a reference to mapping
    offset = -raw.data_ptr() % _HUGE_PAGE_BYTES
    tensor = raw[offset:offset + nbytes].view(dtype).view(shape)
    tensor.zero_()  # NOTE: anonymous pages are zero already; this faults them in now
    return tensor


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    """One worker's KV cache geometry: ``dtype`` is the stored values' (the model's dtype,
    or int8 / float8_e4m3fn / float8_e5m2 with scales). Sizes in bytes."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, config: ModelConfig, block_size: int, kv_cache_dtype: str = "auto"
           ) -> KVCacheLayout:
        """The layout of ``config``'s cache with ``--kv-cache-dtype kv_cache_dtype``.

        Raises:
            ValueError: an unknown ``kv_cache_dtype``.
        """
        return cls(config.num_layers, block_size, config.num_kv_heads, config.head_dim,
                   kv_cache_torch_dtype(kv_cache_dtype, config.dtype))

    @property
    def quantized(self) -> bool:
        return is_quantized(self.dtype)

    @property
    def values_bytes(self) -> int:
        """One block's K and V values, all layers."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    @property
    def scales_offset(self) -> int:
        """Where a quantized block's scales start within it."""
        return _round_up(self.values_bytes, ALIGN_BYTES)

    @property
    def scales_bytes(self) -> int:
        """One block's fp32 scales (0 for a float cache)."""
        return self.num_layers * 2 * self.num_kv_heads * 4 if self.quantized else 0

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes across all layers, K and V, with its scales."""
        if not self.quantized:
            return self.values_bytes
        return _round_up(self.scales_offset + self.scales_bytes, ALIGN_BYTES)

    def allocate(self, num_blocks: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A zeroed cache of ``num_blocks`` blocks (on the CPU on huge pages): its
        layer-major ``(kv_cache, kv_scales)`` views (``kv_scales`` None unquantized)."""
        if not self.quantized:
            shape = (num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads,
                     self.head_dim)
            storage = (cpu_zeros_on_huge_pages(shape, self.dtype) if device.type == "cpu"
                       else torch.zeros(shape, dtype=self.dtype, device=device))
            return storage.permute(1, 2, 0, 3, 4, 5), None
        shape = (num_blocks, self.block_bytes)
        storage = (cpu_zeros_on_huge_pages(shape, torch.uint8) if device.type == "cpu"
                   else torch.zeros(shape, dtype=torch.uint8, device=device))
        return self.views(storage)

    def storage_shape(self, num_blocks: int) -> tuple[tuple[int, ...], torch.dtype]:
        """The block-major storage's shape and dtype for ``num_blocks`` blocks."""
        if self.quantized:
            return (num_blocks, self.block_bytes), torch.uint8
        return (num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads,
                self.head_dim), self.dtype

    def allocate_shared(self, num_blocks: int
                        ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """A zeroed CPU cache in shared memory (a ``memfd``, advised onto huge pages),
        for a tensor-parallel rank whose rank 0 maps it too (``map_shared``): its
        layer-major ``(kv_cache, kv_scales)`` views and the file descriptor, which the
        caller closes once rank 0 has it.

        Raises:
            OSError: no memfd (not Linux), or no memory for it.
        """
        shape, dtype = self.storage_shape(num_blocks)
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        fd = os.memfd_create("pdserve-kv-cache", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            storage = _map(fd, nbytes, dtype, shape)
        except BaseException:
            os.close(fd)
            raise
        storage.zero_()
        return (*self._layer_major(storage), fd)

    def map_shared(self, fd: int, num_blocks: int
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Another process's ``allocate_shared`` cache of ``num_blocks`` blocks, from its
        file descriptor: the same memory, as layer-major ``(kv_cache, kv_scales)``."""
        shape, dtype = self.storage_shape(num_blocks)
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        return self._layer_major(_map(fd, nbytes, dtype, shape))

    def _layer_major(self, storage: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.quantized:
            return self.views(storage)
        return storage.permute(1, 2, 0, 3, 4, 5), None

    def views(self, storage: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A quantized cache's ``(kv_cache, kv_scales)`` over ``storage [num_blocks,
        block_bytes]`` uint8: values ``[num_layers, 2, num_blocks, block_size,
        num_kv_heads, head_dim]`` of ``dtype``, scales ``[num_layers, 2, num_blocks,
        num_kv_heads]`` fp32."""
        num_blocks = storage.shape[0]
        values = storage[:, :self.values_bytes].view(self.dtype).view(
            num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)
        scales = storage[:, self.scales_offset:self.scales_offset + self.scales_bytes]
        scales = scales.view(torch.float32).view(num_blocks, self.num_layers, 2,
                                                 self.num_kv_heads)
        return values.permute(1, 2, 0, 3, 4, 5), scales.permute(1, 2, 0, 3)


def _map(fd: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """``nbytes`` of file ``fd`` mapped shared, as a tensor of ``shape`` (which keeps the
    mapping alive)."""
    mapping = mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, AttributeError):  # NOTE: shmem THP off (the default): plain pages
        pass
    return torch.frombuffer(mapping, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)
