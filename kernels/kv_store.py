"""KV store: write a step's new keys and values into the paged KV cache.

``store_kv`` is the one entry point: CUDA tensors go to the Triton kernel, CPU tensors to
the C++ kernel or ``store_kv_ref``. All have the same signature and semantics.

The caches are ``[num_blocks, block_size, num_kv_heads, head_dim]`` with any block stride
(``stride(0)``) as long as each block's ``[block_size, num_kv_heads, head_dim]`` is packed:
the layer views ``kv_cache[l, 0]`` / ``kv_cache[l, 1]`` of the worker's block-major cache
(``engine/model_runner.py``) have a block stride of all layers' K and V of one block.

A quantized cache (int8 or fp8, ``kernels/kv_quant.py``) takes its scales too,
``key_scales`` / ``value_scales`` ``[num_blocks, num_kv_heads]`` fp32 (any block stride):
the store then quantizes each block it touches as ``kv_quant`` says. Without scales a
store is the plain copy (cast to the cache's dtype) it always was.
"""

from __future__ import annotations

import torch

from pdserve.kernels import cpu_ext
from pdserve.kernels._triton_utils import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    cdiv,
    check_inner_contiguous,
    check_shape,
    check_tensor,
    jit,
    next_power_of_2,
    require_triton,
    tl,
    use_triton,
)
from pdserve.kernels.kv_quant import is_quantized, store_kv_quant_ref
from pdserve.kernels.kv_store_quant import store_kv_quant_cpu, store_kv_quant_triton


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
) -> None:
    """Write ``key``/``value`` rows into the cache at ``slot_mapping`` (plain PyTorch).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, any float dtype.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``;
            written in place (values cast to the cache dtype). The kernels need each
            block packed (any block stride); the reference takes any strides.
        slot_mapping: ``[num_tokens]`` int32/int64, flat slot
            ``block_id * block_size + offset`` per token, distinct (the kernels write
            tokens in parallel: of two tokens with one slot, either may win); ``-1``
            marks padding, skipped.
        key_scales, value_scales: a quantized cache's ``[num_blocks, num_kv_heads]`` fp32
            scales, updated in place (``kv_quant.store_kv_quant_ref``); None for a
            float cache.

    Raises:
        IndexError: a slot is ``>= num_blocks * block_size``.
        ValueError: a quantized cache without scales, or scales for a float cache.
    """
    if _check_scales(key_cache, key_scales, value_scales):
        store_kv_quant_ref(key, value, key_cache, value_cache, slot_mapping, key_scales,
                           value_scales)
        return
    block_size = key_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping.long()
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[valid], value[valid]
    # NOTE: (block, offset) indexing writes through any block stride, where a flat
    # [num_blocks * block_size, ...] view needs a contiguous cache.
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key.to(key_cache.dtype)
    value_cache[blocks, offsets] = value.to(value_cache.dtype)


def _check_scales(key_cache: torch.Tensor, key_scales, value_scales) -> bool:
    """Whether the store is quantized: a quantized cache given its two scale tensors.

    Raises:
        ValueError: a quantized cache without both scales, or scales for a float cache.
    """
    quantized = is_quantized(key_cache.dtype)
    given = (key_scales is not None, value_scales is not None)
    if given != (quantized, quantized):
        raise ValueError(f"key_scales/value_scales: a {key_cache.dtype} cache takes "
                         f"{'both' if quantized else 'none'}, got {sum(given)}")
    return quantized


@jit
def _store_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    key_stride, value_stride,  # elements between consecutive tokens' rows
    key_block_stride, value_block_stride,  # elements between consecutive cache blocks
    ROW: tl.constexpr,  # num_kv_heads * head_dim: one token's elements
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK: tl.constexpr,  # elements per program, a power of two
):
    """One program copies ``BLOCK`` elements of one token's K and V row to its slot."""
    token = tl.program_id(0)
    chunk = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    offsets = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < ROW
    row = token.to(tl.int64)
    key = tl.load(key_ptr + row * key_stride + offsets, mask=mask)
    value = tl.load(value_ptr + row * value_stride + offsets, mask=mask)
    key = key.to(key_cache_ptr.dtype.element_ty)
    value = value.to(value_cache_ptr.dtype.element_ty)
    block_id = slot // BLOCK_SIZE
    in_block = (slot % BLOCK_SIZE) * ROW + offsets
    tl.store(key_cache_ptr + block_id * key_block_stride + in_block, key, mask=mask)
    tl.store(value_cache_ptr + block_id * value_block_stride + in_block, value, mask=mask)


def store_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
) -> None:
    """``store_kv_ref`` as one Triton kernel (after nano-vllm's ``store_kvcache``);
    a quantized cache goes to ``kv_store_quant.store_kv_quant_triton``.

    Same contract; ``key``/``value`` may have any token stride (a view into a fused QKV
    projection) but each token's ``[num_kv_heads, head_dim]`` row must be packed; the
    caches may have any block stride (each may differ) but each block's
    ``[block_size, num_kv_heads, head_dim]`` must be packed. Slot ids are not
    range-checked (a slot past the cache writes out of bounds).

    Raises:
        ValueError: naming the argument whose shape, dtype, device or strides are wrong.
        RuntimeError: triton is not installed.
    """
    require_triton("store_kv_triton")
    if _check_scales(key_cache, key_scales, value_scales):
        store_kv_quant_triton(key, value, key_cache, value_cache, slot_mapping, key_scales,
                              value_scales)
        return
    device = key_cache.device
    check_tensor("key_cache", key_cache, 4, FLOAT_DTYPES)
    check_inner_contiguous("key_cache", key_cache, 3)
    check_tensor("value_cache", value_cache, 4, (key_cache.dtype,), device)
    check_shape("value_cache", value_cache, key_cache.shape)
    check_inner_contiguous("value_cache", value_cache, 3)
    check_tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES, device)
    num_tokens = slot_mapping.shape[0]
    row_shape = tuple(key_cache.shape[2:])  # (num_kv_heads, head_dim)
    for name, tensor in (("key", key), ("value", value)):
        check_tensor(name, tensor, 3, FLOAT_DTYPES, device)
        check_shape(name, tensor, (num_tokens, *row_shape))
        check_inner_contiguous(name, tensor, 2)
    if num_tokens == 0:
        return
    row = row_shape[0] * row_shape[1]
    block = min(next_power_of_2(row), 4096)
    grid = (num_tokens, cdiv(row, block))
    _store_kv_kernel[grid](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), value.stride(0), key_cache.stride(0), value_cache.stride(0),
        ROW=row, BLOCK_SIZE=key_cache.shape[1], BLOCK=block,
    )


def _rows_packed(t: torch.Tensor) -> bool:
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]


def _blocks_packed(cache: torch.Tensor) -> bool:
    """Whether each block ``[block_size, num_kv_heads, head_dim]`` of a 4-D cache is
    packed (any block stride); size-1 dims may have any stride."""
    expected = 1
    for size, stride in zip(reversed(cache.shape[1:]), reversed(cache.stride()[1:])):
        if size > 1 and stride != expected:
            return False
        expected *= size
    return True


def store_kv(key, value, key_cache, value_cache, slot_mapping, key_scales=None,
             value_scales=None) -> None:
    """Dispatching entry point; see ``store_kv_ref`` for the contract.

    CUDA tensors go to ``store_kv_triton``; CPU tensors of the caches' dtype, each token's
    row and each cache block packed, to the C++ kernel (``kernels/csrc/cpu_store_kv.cpp``:
    one copy per token, slots range-checked, RuntimeError naming the bad slot) where it is
    built; a quantized CPU cache to ``kv_store_quant.store_kv_quant_cpu`` where it is
    built; the rest to ``store_kv_ref``.
    """
    if use_triton(key_cache):
        store_kv_triton(key, value, key_cache, value_cache, slot_mapping, key_scales,
                        value_scales)
    elif _check_scales(key_cache, key_scales, value_scales):
        if key_cache.device.type == "cpu" and cpu_ext.load():
            store_kv_quant_cpu(key, value, key_cache, value_cache, slot_mapping, key_scales,
                               value_scales)
        else:
            store_kv_quant_ref(key, value, key_cache, value_cache, slot_mapping, key_scales,
                               value_scales)
    elif (key_cache.device.type == "cpu" and key.dtype == value.dtype == key_cache.dtype
          and _rows_packed(key) and _rows_packed(value) and key_cache.dim() == 4
          and value_cache.dim() == 4 and _blocks_packed(key_cache)
          and _blocks_packed(value_cache) and cpu_ext.load()):
        torch.ops.pdserve_cpu.store_kv(key, value, key_cache, value_cache, slot_mapping)
    else:
        store_kv_ref(key, value, key_cache, value_cache, slot_mapping)
