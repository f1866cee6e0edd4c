"""Quantized KV caches: the dtypes of ``--kv-cache-dtype``, their per-block scales, and the
reference quantized KV store.

A quantized cache stores each K or V element in one byte, ``int8`` or fp8
(``torch.float8_e4m3fn``, ``torch.float8_e5m2``), and one fp32 scale per (block, kv
head) of each layer's K and V: element ``x`` is stored as ``q = round(x / scale)``,
saturated to ``[-qmax, qmax]`` (``qmax`` 127 for int8, 448 for e4m3, 57344 for e5m2;
round half to even for int8, the nearest fp8 value, ties to even, for fp8), and read back
as ``scale * q`` in fp32. A scale of 0 (a block of zeros) stores zeros.

Scales come from the values themselves, no calibration (vLLM's dynamic per-token-group
scales, made per block): when a step writes rows into a block, the block's new scale is
``max(old scale, absmax(new rows) / qmax)``, where the old scale counts only if the write
does not start at the block's slot 0 (a block's first write: a recycled block still holds
its last owner's scale); when it grows, the block's rows before the write are
requantized to it, ``round(q_old * old / new)``; then the new rows are written. Every
implementation (``store_kv_quant_ref`` here, the C++ kernel, the Triton kernel) does these
fp32 operations in this order, with correctly rounded divisions, so all store the same
bytes.

Layouts, as the kernels take them: ``cache [num_blocks, block_size, num_kv_heads,
head_dim]`` of a 1-byte dtype (each block packed, any block stride) and ``scales
[num_blocks, num_kv_heads]`` fp32 (heads packed, any block stride): the layer views of the
worker's block storage (``engine/kv_cache_layout.py``), where each block's scales lie
inside its own bytes.
"""

from __future__ import annotations

import torch

from pdserve.kernels._triton_utils import (
    check_inner_contiguous,
    check_shape,
    check_tensor,
    jit,
    tl,
)

KV_CACHE_DTYPE_NAMES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
"""``--kv-cache-dtype`` choices (vLLM's): ``auto`` is the model's dtype (no quantization),
``fp8`` is ``fp8_e4m3``."""

_TORCH_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn,
                 "fp8_e5m2": torch.float8_e5m2}
QMAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0,
                                  torch.float8_e5m2: 57344.0}
"""The largest magnitude each quantized dtype stores."""

QUANTIZED_DTYPES = tuple(QMAX)


def canonical_kv_cache_dtype(name: str) -> str:
    """``name`` with aliases resolved (``fp8`` -> ``fp8_e4m3``).

    Raises:
        ValueError: not one of ``KV_CACHE_DTYPE_NAMES``, naming ``kv_cache_dtype``.
    """
    if name not in KV_CACHE_DTYPE_NAMES:
        raise ValueError(f"kv_cache_dtype={name!r} must be one of {list(KV_CACHE_DTYPE_NAMES)}")
    return "fp8_e4m3" if name == "fp8" else name


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype a ``--kv-cache-dtype name`` cache stores: ``model_dtype`` for ``auto``.

    Raises:
        ValueError: an unknown name.
    """
    name = canonical_kv_cache_dtype(name)
    return model_dtype if name == "auto" else _TORCH_DTYPES[name]


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether a cache of ``dtype`` is quantized (stored with per-block scales)."""
    return dtype in QMAX


def quantize_ref(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (fp32) divided by ``scale`` (fp32, broadcast; 0 counts as 1), rounded and
    saturated into the quantized ``dtype``."""
    q = x / torch.where(scale > 0, scale, torch.ones_like(scale))
    qmax = QMAX[dtype]
    if dtype == torch.int8:
        return torch.round(q).clamp_(-qmax, qmax).to(torch.int8)
    return q.clamp_(-qmax, qmax).to(dtype)


def dequantize_ref(cache: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``cache [num_blocks, block_size, num_kv_heads, head_dim]`` (quantized) times its
    ``scales [num_blocks, num_kv_heads]``: the fp32 values it holds."""
    return cache.float() * scales[:, None, :, None]


def store_kv_quant_ref(key, value, key_cache, value_cache, slot_mapping, key_scales,
                       value_scales) -> None:
    """``store_kv_ref`` into a quantized cache (plain PyTorch): the module docstring's
    rule, for K and V alike.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, any float dtype.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``,
            int8 / float8_e4m3fn / float8_e5m2 (any strides); written in place.
        slot_mapping: ``[num_tokens]`` int32/int64 slots, ``-1`` skipped. A step's tokens
            of one block are its rows from the lowest slot written on (as every engine
            step's are).
        key_scales, value_scales: ``[num_blocks, num_kv_heads]`` fp32; written in place.
    """
    block_size = key_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping.long()
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[valid], value[valid]
    if slots.numel() == 0:
        return
    blocks, offsets = slots // block_size, slots % block_size
    touched, inverse = torch.unique(blocks, return_inverse=True)  # [U], [T]
    start = torch.full(touched.shape, block_size, device=slots.device).scatter_reduce_(
        0, inverse, offsets, "amin")  # [U] the first slot each block's write starts at
    for rows, cache, scales in ((key, key_cache, key_scales), (value, value_cache, value_scales)):
        _store_rows(rows.float(), cache, scales, blocks, offsets, touched, inverse, start)


def _store_rows(rows, cache, scales, blocks, offsets, touched, inverse, start) -> None:
    """One cache's part of ``store_kv_quant_ref``: ``rows [T, H, D]`` fp32 into blocks
    ``touched [U]`` (``inverse [T]``: each row's index into them)."""
    num_heads = rows.shape[1]
    absmax = torch.zeros(len(touched), num_heads, device=rows.device).scatter_reduce_(
        0, inverse[:, None].expand(-1, num_heads), rows.abs().amax(-1), "amax")  # [U, H]
    old = torch.where((start > 0)[:, None], scales[touched], 0.0)  # [U, H]
    new = torch.maximum(old, absmax / QMAX[cache.dtype])
    grown = new > old
    if bool(grown.any()):  # requantize the rows before each write to the grown scale
        existing = cache[touched]  # [U, block_size, H, D]
        slot = torch.arange(cache.shape[1], device=rows.device)
        keep = (slot[None, :, None] < start[:, None, None]) & grown[:, None, :]  # [U, bs, H]
        requantized = quantize_ref(existing.float() * old[:, None, :, None],
                                   new[:, None, :, None], cache.dtype)
        cache[touched] = torch.where(keep[..., None], requantized, existing)
    cache[blocks, offsets] = quantize_ref(rows, new[inverse][:, :, None], cache.dtype)
    scales[touched] = new


def check_kv_scales(key_cache, key_scales, value_scales) -> None:
    """Raise ValueError unless a quantized cache has both scales ``[num_blocks,
    num_kv_heads]`` fp32 (heads packed) and a float cache none."""
    quantized = key_cache.dtype in QUANTIZED_DTYPES
    if (key_scales is not None, value_scales is not None) != (quantized, quantized):
        raise ValueError(f"key_scales/value_scales: a {key_cache.dtype} cache takes "
                         f"{'both' if quantized else 'none'}")
    if quantized:
        for name, scales in (("key_scales", key_scales), ("value_scales", value_scales)):
            check_tensor(name, scales, 2, (torch.float32,), key_cache.device)
            check_shape(name, scales, key_cache.shape[::2])
            check_inner_contiguous(name, scales, 1)


def triton_kv_args(key_cache, value_cache, key_scales, value_scales) -> tuple:
    """The Triton kernels' cache, scale and scale-stride arguments and ``KV_KIND``; a
    float cache passes itself where the (unread) scales go."""
    if key_scales is None:
        return key_cache, value_cache, key_cache, value_cache, 0, 0, 0
    return (triton_cache_view(key_cache), triton_cache_view(value_cache), key_scales,
            value_scales, key_scales.stride(0), value_scales.stride(0), kv_kind(key_cache.dtype))


# ---- Triton helpers: the same encodings with integer ops ------------------------------
# NOTE: triton 3.9's interpreter rounds some fp32 -> fp8 casts wrongly (-125.05 became
# -64 in e4m3), so the kernels encode and decode fp8 bits themselves, on uint8 views of
# the caches; the same code runs on the GPU.

KV_KIND_FLOAT, KV_KIND_INT8, KV_KIND_E4M3, KV_KIND_E5M2 = 0, 1, 2, 3
_KINDS = {torch.int8: KV_KIND_INT8, torch.float8_e4m3fn: KV_KIND_E4M3,
          torch.float8_e5m2: KV_KIND_E5M2}


def kv_kind(dtype: torch.dtype) -> int:
    """The Triton kernels' constexpr code of a cache dtype (0: a float cache)."""
    return _KINDS.get(dtype, KV_KIND_FLOAT)


def triton_cache_view(cache: torch.Tensor) -> torch.Tensor:
    """What a Triton kernel is given for ``cache``: fp8 as its uint8 bits, else itself."""
    return cache.view(torch.uint8) if cache.dtype in (torch.float8_e4m3fn,
                                                      torch.float8_e5m2) else cache


@jit
def kv_decode(raw, KIND: tl.constexpr):
    """Stored elements (int8, or fp8 bits as uint8) -> their fp32 values (unscaled)."""
    if KIND == 1:
        return raw.to(tl.float32)
    elif KIND == 2:
        return _fp8_decode(raw, 3, 7, 0.001953125)  # e4m3fn: subnormal step 2**-9
    else:
        return _fp8_decode(raw, 2, 15, 1.52587890625e-05)  # e5m2: 2**-16


@jit
def _fp8_decode(raw, MANT: tl.constexpr, BIAS: tl.constexpr, STEP: tl.constexpr):
    bits = raw.to(tl.int32) & 0xFF
    exponent = (bits >> MANT) & ((1 << (7 - MANT)) - 1)
    mantissa = bits & ((1 << MANT) - 1)
    normal = (((exponent + (127 - BIAS)) << 23) | (mantissa << (23 - MANT))).to(
        tl.float32, bitcast=True)
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * STEP, normal)
    return tl.where((bits & 0x80) != 0, -magnitude, magnitude)


@jit
def kv_encode(x, KIND: tl.constexpr):
    """fp32 ``x`` (already divided by the scale) -> stored elements: int8 rounded half to
    even and saturated to 127, or fp8 bits (uint8), the nearest value, ties to even,
    saturated to qmax (e4m3fn 448, e5m2 57344)."""
    if KIND == 1:
        rounded = (x + 12582912.0) - 12582912.0  # 1.5 * 2**23: round half to even
        return tl.minimum(tl.maximum(rounded, -127.0), 127.0).to(tl.int8)
    elif KIND == 2:
        return _fp8_encode(x, 3, 7, 448.0, 0.015625, 512.0)  # min normal 2**-6, 2**9 steps
    else:
        return _fp8_encode(x, 2, 15, 57344.0, 6.103515625e-05, 65536.0)  # 2**-14, 2**16


@jit
def _fp8_encode(x, MANT: tl.constexpr, BIAS: tl.constexpr, QMAX_: tl.constexpr,
                MIN_NORMAL: tl.constexpr, STEPS_PER_UNIT: tl.constexpr):
    x = tl.minimum(tl.maximum(x, -QMAX_), QMAX_)
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    magnitude_bits = bits & 0x7FFFFFFF
    magnitude = magnitude_bits.to(tl.float32, bitcast=True)
    # normal: round the fp32 mantissa to MANT bits, ties to even (a carry bumps the
    # exponent), then rebias the exponent
    drop: tl.constexpr = 23 - MANT
    rounded = (magnitude_bits + ((1 << (drop - 1)) - 1) + ((magnitude_bits >> drop) & 1)) >> drop
    normal = rounded - ((127 - BIAS) << MANT)
    # below the smallest normal: whole subnormal steps, rounded half to even (a result of
    # 1 << MANT steps is the smallest normal's code)
    steps = (tl.minimum(magnitude, MIN_NORMAL) * STEPS_PER_UNIT + 12582912.0) - 12582912.0
    code = tl.where(magnitude >= MIN_NORMAL, normal, steps.to(tl.int32))
    return (code | (sign << 7)).to(tl.uint8)
