"""The KV store into a quantized cache as kernels: Triton (CUDA, or the interpreter) and
the C++ CPU kernel's wrapper; ``kv_quant.store_kv_quant_ref`` is their reference and
``kv_store.store_kv`` dispatches to them.

Several tokens of one step may write one block (a prefill chunk), and each block's scale
depends on all of them, so the work is per (block, kv head), never per token: the C++
kernel groups the step's tokens by block; the Triton kernel sorts the slots on the device
(``torch.sort``, no host sync) and launches one program per (sorted token, kv head), of
which only the first token of each block (its "leader") works, on all of its block's
tokens. No two programs write the same (block, head), so there is no race and no atomic.
"""

from __future__ import annotations

import torch

from pdserve.kernels import cpu_ext
from pdserve.kernels._triton_utils import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_inner_contiguous,
    check_shape,
    check_tensor,
    jit,
    next_power_of_2,
    require_triton,
    tl,
)
from pdserve.kernels.kv_quant import (
    QMAX,
    QUANTIZED_DTYPES,
    kv_decode,
    kv_encode,
    kv_kind,
    triton_cache_view,
)


@jit
def _store_block_rows(
    rows_ptr, row_stride, cache_ptr, block_stride, scales_ptr, scale_stride,
    tokens, offsets, mine, block, head, start,
    QMAX_: tl.constexpr, KIND: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE_PAD: tl.constexpr,
):
    """One cache's (K's or V's) part of a leader program: the block's new rows of
    ``head`` (``tokens``/``offsets`` where ``mine``), its scale, and the rows before
    ``start`` requantized where the scale grew."""
    d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = (d < HEAD_DIM)[None, :]
    new_mask = mine[:, None] & d_mask  # [BLOCK_SIZE_PAD, HEAD_DIM_PAD]
    rows = tl.load(rows_ptr + tokens[:, None] * row_stride + head * HEAD_DIM + d[None, :],
                   mask=new_mask, other=0.0).to(tl.float32)
    absmax = tl.max(tl.max(tl.abs(rows), 1), 0)
    scale_ptr = scales_ptr + block * scale_stride + head
    old = tl.load(scale_ptr)
    old = tl.where(start > 0, old, 0.0)  # a write from slot 0: the block's first
    new = tl.maximum(old, tl.math.div_rn(absmax, QMAX_))
    block_ptr = cache_ptr + block * block_stride + head * HEAD_DIM
    if new > old:  # the rows before the write, requantized to the new scale
        r = tl.arange(0, BLOCK_SIZE_PAD)
        old_mask = (r < start)[:, None] & d_mask
        old_ptrs = block_ptr + r[:, None] * (NUM_KV_HEADS * HEAD_DIM) + d[None, :]
        stored = kv_decode(tl.load(old_ptrs, mask=old_mask, other=0), KIND)
        tl.store(old_ptrs, kv_encode(tl.math.div_rn(stored * old, new), KIND), mask=old_mask)
    safe = tl.where(new > 0, new, 1.0)
    tl.store(block_ptr + offsets[:, None] * (NUM_KV_HEADS * HEAD_DIM) + d[None, :],
             kv_encode(tl.math.div_rn(rows, safe), KIND), mask=new_mask)
    tl.store(scale_ptr, new)


@jit
def _store_kv_quant_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, key_scales_ptr, value_scales_ptr,
    sorted_slots_ptr, order_ptr, num_tokens,
    key_stride, value_stride, key_block_stride, value_block_stride,
    key_scale_stride, value_scale_stride,
    QMAX_: tl.constexpr, KIND: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_SIZE_PAD: tl.constexpr,
):
    """Program (i, head): if sorted token i is the first of its block, store the
    block's tokens of this step (at most ``BLOCK_SIZE``, the next sorted ones) for
    ``head``, K and V."""
    i = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(sorted_slots_ptr + i)
    if slot < 0:  # padding (sorted first)
        return
    block = slot // BLOCK_SIZE
    if i > 0:
        previous = tl.load(sorted_slots_ptr + i - 1)
        if (previous >= 0) & (previous // BLOCK_SIZE == block):
            return  # not the block's leader
    j = i + tl.arange(0, BLOCK_SIZE_PAD)
    in_range = j < num_tokens
    slots = tl.load(sorted_slots_ptr + j, mask=in_range, other=-1)
    mine = in_range & (slots >= 0) & (slots // BLOCK_SIZE == block)
    tokens = tl.load(order_ptr + j, mask=mine, other=0)
    offsets = tl.where(mine, slots % BLOCK_SIZE, 0)
    start = slot % BLOCK_SIZE  # the lowest slot of the block's write
    _store_block_rows(key_ptr, key_stride, key_cache_ptr, key_block_stride, key_scales_ptr,
                      key_scale_stride, tokens, offsets, mine, block, head, start,
                      QMAX_, KIND, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE_PAD)
    _store_block_rows(value_ptr, value_stride, value_cache_ptr, value_block_stride,
                      value_scales_ptr, value_scale_stride, tokens, offsets, mine, block, head,
                      start, QMAX_, KIND, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE_PAD)


def check_quant_store_args(key, value, key_cache, value_cache, slot_mapping, key_scales,
                           value_scales) -> None:
    """Raise ValueError naming the argument whose shape, dtype, device or strides a
    quantized store cannot take."""
    device = key_cache.device
    check_tensor("key_cache", key_cache, 4, QUANTIZED_DTYPES)
    check_tensor("value_cache", value_cache, 4, (key_cache.dtype,), device)
    check_shape("value_cache", value_cache, key_cache.shape)
    num_blocks, _, num_kv_heads, head_dim = key_cache.shape
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        check_inner_contiguous(name, cache, 3)
    for name, scales in (("key_scales", key_scales), ("value_scales", value_scales)):
        check_tensor(name, scales, 2, (torch.float32,), device)
        check_shape(name, scales, (num_blocks, num_kv_heads))
        check_inner_contiguous(name, scales, 1)
    check_tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES, device)
    for name, tensor in (("key", key), ("value", value)):
        check_tensor(name, tensor, 3, FLOAT_DTYPES, device)
        check_shape(name, tensor, (slot_mapping.shape[0], num_kv_heads, head_dim))
        check_inner_contiguous(name, tensor, 2)


def store_kv_quant_triton(key, value, key_cache, value_cache, slot_mapping, key_scales,
                          value_scales) -> None:
    """``kv_quant.store_kv_quant_ref`` as one Triton kernel; same contract and bytes.

    ``key``/``value`` may have any token stride (each token's row packed); caches and
    scales any block stride. Slots are distinct (as ``store_kv``'s) and not range-checked.

    Raises:
        ValueError: naming the argument whose shape, dtype, device or strides are wrong.
        RuntimeError: triton is not installed.
    """
    require_triton("store_kv_quant_triton")
    check_quant_store_args(key, value, key_cache, value_cache, slot_mapping, key_scales,
                           value_scales)
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    sorted_slots, order = torch.sort(slot_mapping.long(), stable=True)
    _store_kv_quant_kernel[(num_tokens, num_kv_heads)](
        key, value, triton_cache_view(key_cache), triton_cache_view(value_cache),
        key_scales, value_scales, sorted_slots, order, num_tokens,
        key.stride(0), value.stride(0), key_cache.stride(0), value_cache.stride(0),
        key_scales.stride(0), value_scales.stride(0),
        QMAX_=QMAX[key_cache.dtype], KIND=kv_kind(key_cache.dtype), NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=next_power_of_2(head_dim), BLOCK_SIZE=block_size,
        BLOCK_SIZE_PAD=next_power_of_2(block_size),
    )


def store_kv_quant_cpu(key, value, key_cache, value_cache, slot_mapping, key_scales,
                       value_scales) -> None:
    """``kv_quant.store_kv_quant_ref`` as a C++ kernel (``kernels/csrc/cpu_kv_quant.cpp``:
    tokens grouped by block, one task per (block, kv head) on torch's intra-op threads);
    same contract and bytes; key/value in fp32, bf16 or fp16.

    Raises:
        RuntimeError: naming the argument whose shape, dtype or strides are wrong, or a
            slot outside the cache (all checked in C++: the per-layer call costs no
            Python checks), or the C++ kernels are not built.
    """
    if not cpu_ext.load():
        raise RuntimeError("store_kv_quant_cpu: the C++ CPU kernels are not built")
    torch.ops.pdserve_cpu.store_kv_quant(key, value, key_cache, value_cache, key_scales,
                                         value_scales, slot_mapping)
