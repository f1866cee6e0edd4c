"""GGUF's quantized blocks as pdserve's quantized weights (``kernels/quant_linear.py``),
without loss: every value a block stores is kept, and ``dequantize`` of the result equals
``gguf.dequantize`` of the tensor exactly (both compute ``q * scale + min`` in fp32).

| GGUF type | block | becomes | bits per weight (GGUF -> pdserve) |
| --- | --- | --- | --- |
| Q8_0 | 32 int8, fp16 d | int8, group 32, fp16 scale d | 8.5 -> 8.5 |
| Q4_0 | 32 x 4 bit, fp16 d, x = d (q - 8) | int4, group 32, fp16 scale d, min -8d | 4.5 -> 4.5 |
| Q4_1 | 32 x 4 bit, fp16 d and m | int4, group 32, fp16 scale d and min m | 5 -> 5 |
| Q4_K | 256: 8 x 32 x 4 bit, 6-bit scales and mins | int4, group 32, scale d sc, min -dmin m | 4.5 -> 4.75 |
| Q5_K | 256: 8 x 32 x 5 bit, 6-bit scales and mins | int8, group 32, scale d sc, min -dmin m | 5.5 -> 8.75 |
| Q6_K | 256: 16 x 16 x 6 bit, int8 scales | int8 (q - 32), group 16, scale d sc | 6.56 -> 8.63 |

The last column is what the CPU kernel keeps. Q4_0's min (-8 d) is not stored there: the
kernel computes it from the scale (5 bits a weight on other devices, which store it). The K-quants keep their two levels of scales
(``ScaleCodes``): each group's integer ``sc`` (and ``m``) as an int8, each super-block's
``d`` (and ``-dmin``) as an fp32, multiplied in the kernel (exact in fp32); on other
devices the scales are fp32 per group (``d * sc`` does not fit fp16), 1 bit a weight more
for Q6_K's groups of 16, 2 for Q4_K's and Q5_K's scale and min. Q5_K and Q6_K values take
a byte each, since pdserve's kernels read 8- and 4-bit values only. So a K-quant file takes
more memory (and bandwidth) in pdserve than in llama.cpp, by the last column's ratio, and
computes the same numbers.
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.kernels.quant_linear import QuantWeight, ScaleCodes, pack_int4

QK_K = 256
KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")


def _f16(raw: np.ndarray) -> np.ndarray:
    """``[..., 2]`` uint8 -> ``[...]`` float32 (little-endian fp16 bits)."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """``[..., width]`` bytes -> ``[..., 2 * width]`` values: the low nibbles, then the high
    ones (llama.cpp's order within a block)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> the 8 sub-blocks' 6-bit scales and mins ``[n, 8]``."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


# Each decoder: a block array [n, block bytes] -> (values [n, block values], scales and mins
# [n, groups a block] fp32 (mins None), group size, and for the K-quants their two levels:
# (scale codes [n, groups a block], d [n, 1], min codes or None, -dmin [n, 1] or None)).


def _q8_0(b: np.ndarray):
    return b[:, 2:].view(np.int8), _f16(b[:, :2])[:, None], None, 32, None


def _q4_0(b: np.ndarray):
    d = _f16(b[:, :2])[:, None]
    return _nibbles(b[:, 2:], 16), d, -8 * d, 32, None


def _q4_1(b: np.ndarray):
    return (_nibbles(b[:, 4:], 16), _f16(b[:, :2])[:, None], _f16(b[:, 2:4])[:, None], 32,
            None)


def _k_common(b: np.ndarray):
    """Q4_K/Q5_K's scales and mins ``[n, 8]`` fp32, and their two levels (the comment
    above the decoders)."""
    d, dmin = _f16(b[:, :2])[:, None], _f16(b[:, 2:4])[:, None]
    sc, mn = _k_scale_min(b[:, 4:16])
    return d * sc, -(dmin * mn), (sc, d, mn, -dmin)


def _q4_k(b: np.ndarray):
    scale, minimum, codes = _k_common(b)
    qs = b[:, 16:144].reshape(-1, 4, 32)  # 4 chunks of 64 values: 2 sub-blocks each
    q = _nibbles(qs, 32).reshape(-1, QK_K)
    return q, scale, minimum, 32, codes


def _q5_k(b: np.ndarray):
    scale, minimum, codes = _k_common(b)
    qh = b[:, 16:48]  # bit j of qh[i] is the 5th bit of value i of sub-block j
    ql = _nibbles(b[:, 48:176].reshape(-1, 4, 32), 32).reshape(-1, 8, 32)
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [n, 8, 32]
    q = (ql | (high << 4)).reshape(-1, QK_K).astype(np.int8)
    return q, scale, minimum, 32, codes


def _q6_k(b: np.ndarray):
    ql = b[:, :128].reshape(-1, 2, 64)
    ql = np.concatenate([ql & 0x0F, ql >> 4], axis=-1).reshape(-1, 2, 4, 32)  # [n, 2, 4, 32]
    qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[None, None, :,
                                                                                 None]
    q = ((ql | ((qh & 0x03) << 4)).astype(np.int16) - 32).reshape(-1, QK_K).astype(np.int8)
    scales = b[:, 192:208].view(np.int8).astype(np.float32)  # [n, 16]
    d = _f16(b[:, 208:210])[:, None]
    return q, d * scales, None, 16, (scales, d, None, None)


_DECODERS = {"Q8_0": (34, 32, _q8_0), "Q4_0": (18, 32, _q4_0), "Q4_1": (20, 32, _q4_1),
             "Q4_K": (144, QK_K, _q4_k), "Q5_K": (176, QK_K, _q5_k),
             "Q6_K": (210, QK_K, _q6_k)}
_FP16_SCALES = ("Q8_0", "Q4_0", "Q4_1")


def quant_weight(data: np.ndarray, kind: str, out_features: int,
                 in_features: int) -> QuantWeight:
    """A GGUF tensor of ``kind`` (one of ``KEPT_TYPES``; ``data``: its raw bytes, rows
    first) as a ``QuantWeight [out_features, in_features]`` (module docstring).

    Raises:
        ValueError: another type, or bytes that do not fit the shape.
    """
    if kind not in _DECODERS:
        raise ValueError(f"GGUF type {kind} is not kept quantized; kept: {KEPT_TYPES}")
    block_bytes, block_values, decode = _DECODERS[kind]
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    blocks = out_features * in_features // block_values
    if in_features % block_values or raw.size != blocks * block_bytes:
        raise ValueError(f"{kind}: {raw.size} bytes do not hold [{out_features}, "
                         f"{in_features}] in blocks of {block_values}")
    q, scale, minimum, group, levels = decode(raw.reshape(blocks, block_bytes))
    n, groups = out_features, in_features // group
    q = torch.from_numpy(np.ascontiguousarray(q)).reshape(n, in_features)
    dtype = torch.float16 if kind in _FP16_SCALES else torch.float32

    def per_group(x, width=groups, as_type=dtype):
        return None if x is None else torch.from_numpy(
            np.ascontiguousarray(x, np.float32)).reshape(n, width).to(as_type)

    codes = [None, None]
    if levels is not None:  # a K-quant: its integers per group, its factors per block
        for i, (c, factor) in enumerate(zip(levels[::2], levels[1::2])):
            if c is not None:
                codes[i] = ScaleCodes(per_group(c, as_type=torch.int8),
                                      per_group(factor, in_features // block_values,
                                                torch.float32), block_values)
    if q.dtype == torch.uint8:  # 4-bit values
        return QuantWeight(pack_int4(q), per_group(scale), per_group(minimum), 4, group,
                           in_features, *codes)
    return QuantWeight(q.to(torch.int8), per_group(scale), per_group(minimum), 8, group,
                       in_features, *codes)


def permute_rows(w: QuantWeight, reorder) -> QuantWeight:
    """``w`` with ``reorder`` (a function of a ``[rows, ...]`` tensor, such as
    ``gguf_source.unpermute_rows``) applied to the rows of its values, scales and mins."""
    return QuantWeight(reorder(w.q), reorder(w.scale),
                       None if w.min is None else reorder(w.min), w.bits, w.group_size,
                       w.in_features,
                       None if w.scale_codes is None else w.scale_codes.rows(reorder),
                       None if w.min_codes is None else w.min_codes.rows(reorder))
