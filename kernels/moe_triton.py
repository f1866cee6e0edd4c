"""Grouped expert MLPs of a sparse MoE block as two Triton grouped GEMMs, for CUDA tensors:
the contract of ``kernels/moe.py``'s ``moe_ref``.

The idea is the fused-MoE kernel of vLLM and of MegaBlocks (Gale et al. 2022,
https://arxiv.org/abs/2211.15841), written here from that description:

1. ``align_by_expert`` sorts the ``T * k`` (token, slot) rows by expert and pads each
   expert's run to a multiple of ``BLOCK_M`` (with an out-of-range row id), so every
   ``BLOCK_M`` block of the sorted list belongs to one expert; all on the device, no host
   synchronisation (the list is sized for the worst case, ``T * k + E * (BLOCK_M - 1)``
   rows; blocks past the last expert's run are marked ``-1`` and store nothing).
2. One launch over ``(blocks, I / BLOCK_N)``: each program gathers its block's token rows
   of ``hidden``, multiplies them by its expert's gate and up rows of ``w13`` (two fp32
   accumulators), and stores ``silu(gate) * up`` for its rows: ``[T * k, I]``.
3. One launch over ``(blocks, H / BLOCK_N)``: the rows of step 2 times the expert's
   ``w2``, rounded to the activation dtype, times the slot's routing weight, stored as
   fp32 ``[T * k, H]``; the ``k`` slots of each token are then summed and rounded once.

Rounding is ``moe_ref``'s: both projections and the SiLU-and-mul round to the
activation dtype where transformers' linears and activation do.
"""

from __future__ import annotations

import torch

from pdserve.kernels._triton_utils import cdiv, dot_options, interpreting, jit, require_triton, tl


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the flattened ``[T * k]`` rows of ``topk_ids`` by expert, each expert's run
    padded to a multiple of ``block_m``.

    Returns:
        ``sorted_rows``: ``[num_blocks * block_m]`` int32, row ``t * k + j`` ids in expert
        order, padding ``T * k``; ``block_expert``: ``[num_blocks]`` int32, the expert of
        each block, ``-1`` past the last run.
    """
    flat = topk_ids.reshape(-1).long()
    num_rows = flat.numel()
    device = flat.device
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    start = torch.cumsum(counts, 0) - counts
    experts, order = torch.sort(flat, stable=True)
    position = pad_start[experts] + torch.arange(num_rows, device=device) - start[experts]
    num_blocks = max(1, cdiv(num_rows + num_experts * (block_m - 1), block_m))
    sorted_rows = torch.full((num_blocks * block_m,), num_rows, dtype=torch.int32,
                             device=device)
    sorted_rows[position] = order.to(torch.int32)
    block_start = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(pad_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_rows, block_expert


@jit
def _moe_gate_up_kernel(
    x_ptr, w_ptr, out_ptr, rows_ptr, block_expert_ptr,
    num_rows, H, I, top_k,
    stride_xm, stride_we, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """``out[row, n] = silu(x[token] . w13[e, n]) * (x[token] . w13[e, I + n])`` for one
    ``[BLOCK_M, BLOCK_N]`` tile: a block of expert ``e``'s rows, ``token = row // top_k``."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    rows = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = rows < num_rows  # NOTE: blocks of expert -1 hold padding only
    tokens = (rows // top_k).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < I
    w_base = w_ptr + tl.maximum(expert, 0).to(tl.int64) * stride_we
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < H
        a = tl.load(x_ptr + tokens[:, None] * stride_xm + k[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = n_mask[:, None] & k_mask[None, :]
        w_gate = tl.load(w_base + rn[:, None].to(tl.int64) * stride_wn + k[None, :],
                         mask=w_mask, other=0.0)
        w_up = tl.load(w_base + (rn[:, None] + I).to(tl.int64) * stride_wn + k[None, :],
                       mask=w_mask, other=0.0)
        if UPCAST:
            a, w_gate, w_up = a.to(tl.float32), w_gate.to(tl.float32), w_up.to(tl.float32)
        acc_gate += tl.dot(a, tl.trans(w_gate), input_precision=PRECISION)
        acc_up += tl.dot(a, tl.trans(w_up), input_precision=PRECISION)
    dtype = out_ptr.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)  # NOTE: each linear rounds, as transformers'
    up = acc_up.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    out = out_ptr + rows[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out, (act * up).to(dtype), mask=row_mask[:, None] & n_mask[None, :])


@jit
def _moe_down_kernel(
    a_ptr, w_ptr, weights_ptr, out_ptr, rows_ptr, block_expert_ptr,
    num_rows, H, I,
    stride_am, stride_we, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """``out[row, n] = weight[row] * round(a[row] . w2[e, n])`` (fp32 out) for one tile."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    rows = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = rows < num_rows  # NOTE: blocks of expert -1 hold padding only
    rows64 = rows.to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < H
    w_base = w_ptr + tl.maximum(expert, 0).to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < I
        a = tl.load(a_ptr + rows64[:, None] * stride_am + k[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_base + rn[:, None].to(tl.int64) * stride_wn + k[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(a, tl.trans(w), input_precision=PRECISION)
    y = acc.to(a_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weights_ptr + rows64, mask=row_mask, other=0.0)
    out = out_ptr + rows64[:, None] * stride_om + rn[None, :]
    tl.store(out, y * weight[:, None], mask=row_mask[:, None] & n_mask[None, :])


def fused_moe_triton(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """``moe_ref`` in two grouped Triton GEMMs (shapes: ``kernels/moe.py``; the arguments
    are checked there, ``topk_weights`` fp32). ``hidden [T, H]`` -> ``[T, H]``.

    Raises:
        RuntimeError: triton is not installed.
    """
    require_triton("fused_moe_triton")
    num_tokens, hidden_size = hidden.shape
    top_k, num_experts, inter = topk_ids.shape[1], w13.shape[0], w13.shape[1] // 2
    num_rows = num_tokens * top_k
    out = torch.zeros((num_rows, hidden_size), dtype=torch.float32, device=hidden.device)
    if num_rows == 0:
        return out.view(num_tokens, top_k, hidden_size).sum(1).to(hidden.dtype)
    hidden, w13, w2 = hidden.contiguous(), w13.contiguous(), w2.contiguous()
    weights = topk_weights.float().contiguous().view(-1)
    small = interpreting()
    block_m = 16 if small or num_rows <= 64 * num_experts else 64
    block_n, block_k = (32, 32) if small else (64, 64)
    sorted_rows, block_expert = align_by_expert(topk_ids, num_experts, block_m)
    num_blocks = block_expert.numel()
    options = dot_options(hidden.dtype)
    act = torch.empty((num_rows, inter), dtype=hidden.dtype, device=hidden.device)
    _moe_gate_up_kernel[(num_blocks, cdiv(inter, block_n))](
        hidden, w13, act, sorted_rows, block_expert,
        num_rows, hidden_size, inter, top_k,
        hidden.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **options,
    )
    _moe_down_kernel[(num_blocks, cdiv(hidden_size, block_n))](
        act, w2, weights, out, sorted_rows, block_expert,
        num_rows, hidden_size, inter,
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **options,
    )
    return out.view(num_tokens, top_k, hidden_size).sum(1).to(hidden.dtype)
