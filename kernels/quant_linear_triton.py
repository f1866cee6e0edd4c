"""Weight-only quantized linear (W8A16 / W4A16) as a Triton kernel, for CUDA tensors: the
same contract as ``quant_linear.linear_quant_ref``, on ``QuantWeight``'s own layout (int8
``[N, K]``, or int4 two per byte ``[N, K // 2]``, scales and mins ``[N, K // group]``).

One program computes a ``BLOCK_M x BLOCK_N`` tile of ``y``: for each ``BLOCK_K`` slice of
K (within one group: ``BLOCK_K`` divides the group size), the weight slice is loaded as
integers, dequantized (``q * scale + min``) in fp32, then multiplied with the activation
tile by ``tl.dot`` with fp32 accumulation, as vLLM's and Marlin's dequantize-in-the-loop
GEMMs do (without their weight layouts).
"""

from __future__ import annotations

import torch

from pdserve.kernels._triton_utils import (
    FLOAT_DTYPES,
    cdiv,
    check_tensor,
    interpreting,
    jit,
    require_triton,
    tl,
)
from pdserve.kernels.quant_linear import QuantWeight


@jit
def _quant_linear_kernel(
    x_ptr, q_ptr, scale_ptr, min_ptr, bias_ptr, y_ptr,
    M, N, K, group,
    stride_xm, stride_qn, stride_sn, stride_ym,
    BITS: tl.constexpr, HAS_MIN: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One ``[BLOCK_M, BLOCK_N]`` tile of ``y = x W^T (+ b)``."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk  # [BLOCK_K]
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + k[None, :],
                    mask=m_mask[:, None], other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_K]
        rows = rn[:, None].to(tl.int64) * stride_qn
        if BITS == 8:
            q = tl.load(q_ptr + rows + k[None, :], mask=n_mask[:, None], other=0).to(tl.float32)
        else:
            byte = tl.load(q_ptr + rows + k[None, :] // 2, mask=n_mask[:, None], other=0)
            q = ((byte.to(tl.int32) >> ((k[None, :] % 2) * 4)) & 0xF).to(tl.float32)
        g = k0 // group
        s = tl.load(scale_ptr + rn.to(tl.int64) * stride_sn + g, mask=n_mask, other=0.0)
        w = q * s.to(tl.float32)[:, None]  # [BLOCK_N, BLOCK_K]
        if HAS_MIN:
            mn = tl.load(min_ptr + rn.to(tl.int64) * stride_sn + g, mask=n_mask, other=0.0)
            w = w + mn.to(tl.float32)[:, None]
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def linear_quant_triton(x: torch.Tensor, w: QuantWeight,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """``linear_quant_ref`` in Triton: ``x [..., K]`` (bf16, fp16 or fp32; its last dim
    contiguous) -> ``[..., N]`` in ``x``'s dtype, fp32 sums.

    Raises:
        ValueError: ``x`` of another width or dtype, or on another device than ``w``.
        RuntimeError: triton is not installed.
    """
    require_triton("linear_quant_triton")
    rows = x.reshape(-1, x.shape[-1])
    check_tensor("x", rows, 2, FLOAT_DTYPES, w.q.device)
    if rows.shape[1] != w.in_features:
        raise ValueError(f"x: {rows.shape[1]} in_features, the weight has {w.in_features}")
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    m, n = rows.shape[0], w.out_features
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.view(*x.shape[:-1], n)
    block_k = min(32, w.group_size)  # NOTE: group sizes are 16 or multiples of 32
    block_m = 16 if interpreting() else max(16, min(64, 1 << (m - 1).bit_length()))
    block_n = 32 if interpreting() else 64
    q, scale = w.q.contiguous(), w.scale.contiguous()
    minimum = w.min.contiguous() if w.min is not None else scale
    grid = (cdiv(m, block_m), cdiv(n, block_n))
    _quant_linear_kernel[grid](
        rows, q, scale, minimum, bias if bias is not None else scale, y,
        m, n, w.in_features, w.group_size,
        rows.stride(0), q.stride(0), scale.stride(0), y.stride(0),
        BITS=w.bits, HAS_MIN=w.min is not None, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return y.view(*x.shape[:-1], n)
