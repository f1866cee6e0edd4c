"""Grouped expert MLPs of a sparse mixture-of-experts block (Shazeer et al. 2017,
https://arxiv.org/abs/1701.06538; Mixtral, https://arxiv.org/abs/2401.04088): every token
through its top-k experts' SwiGLU MLPs, the outputs summed with its routing weights.

``fused_moe`` sends CPU tensors to the C++ kernel (``kernels/csrc/cpu_moe.cpp``:
tokens counting-sorted by expert, one ``at::mm`` pair per expert, experts in parallel on
small steps), CUDA tensors to the Triton kernel (``kernels/moe_triton.py``: tokens
sorted and padded per expert block, one grouped GEMM launch for ``w13`` with SiLU-and-mul
fused, one for ``w2``), and everything else to ``moe_ref``.

The routing (``engine/models/moe.py``) is not here: these take each token's expert ids
and weights. The arithmetic rounds where transformers' ``*Experts.forward`` rounds (each
expert's gate_up and down projections in the activation dtype, SiLU-and-mul in it), then
sums the weighted expert outputs in fp32 and rounds once (transformers adds them one
expert at a time in the activation dtype: identical in fp32 up to the order of the sum,
and no less exact in bf16).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_ext
from pdserve.kernels._triton_utils import use_triton

MOE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_moe_args(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   w13: torch.Tensor, w2: torch.Tensor) -> None:
    """Raise ``ValueError`` unless the shapes and dtypes fit ``fused_moe``'s contract."""
    if hidden.dim() != 2 or hidden.dtype not in MOE_DTYPES:
        raise ValueError(f"hidden: expected [T, H] float, got {tuple(hidden.shape)} "
                         f"{hidden.dtype}")
    num_tokens, hidden_size = hidden.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens or topk_ids.is_floating_point():
        raise ValueError(f"topk_ids: expected [{num_tokens}, k] int, got "
                         f"{tuple(topk_ids.shape)} {topk_ids.dtype}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights: expected {tuple(topk_ids.shape)}, got "
                         f"{tuple(topk_weights.shape)}")
    if w13.dim() != 3 or w13.shape[1] % 2 or w13.shape[2] != hidden_size:
        raise ValueError(f"w13: expected [E, 2 * I, {hidden_size}], got {tuple(w13.shape)}")
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    if tuple(w2.shape) != (num_experts, hidden_size, inter):
        raise ValueError(f"w2: expected {(num_experts, hidden_size, inter)}, got "
                         f"{tuple(w2.shape)}")
    if w13.dtype != hidden.dtype or w2.dtype != hidden.dtype:
        raise ValueError(f"w13 {w13.dtype} and w2 {w2.dtype} must be hidden's {hidden.dtype}")


def moe_ref(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The reference: a loop over the experts that have tokens, as transformers'.

    Args:
        hidden: ``[T, H]`` bf16, fp16 or fp32 activations.
        topk_ids: ``[T, k]`` int32/int64 expert of each of a token's ``k`` slots, in
            ``[0, E)``; a token's slots name distinct experts (top-k routing).
        topk_weights: ``[T, k]`` routing weight of each slot (fp32, or the activation
            dtype: widened to fp32).
        w13: ``[E, 2 * I, H]`` each expert's gate rows then up rows, ``hidden``'s dtype.
        w2: ``[E, H, I]`` each expert's down projection.

    Returns:
        ``[T, H]`` in ``hidden``'s dtype: ``sum_j w[t, j] * down_e(silu(gate_e(x)) *
        up_e(x))`` with ``e = topk_ids[t, j]``; each projection and the SiLU-and-mul in
        ``hidden``'s dtype, the weighted sum in fp32, rounded once.
    """
    inter = w13.shape[1] // 2
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    weights = topk_weights.float()
    for expert in torch.unique(topk_ids).tolist():
        token, slot = torch.where(topk_ids == expert)
        gate_up = F.linear(hidden[token], w13[expert])  # [n, 2I]
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = F.linear(act, w2[expert])  # [n, H]
        out.index_add_(0, token, y.float() * weights[token, slot, None])
    return out.to(hidden.dtype)


def fused_moe(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """``moe_ref``'s contract on the fastest kernel for the tensors' device: the C++ CPU
    kernel (built: ``cpu_ext.load``), Triton on CUDA (installed), else the reference.

    Raises:
        ValueError: shapes or dtypes outside the contract.
    """
    check_moe_args(hidden, topk_ids, topk_weights, w13, w2)
    # NOTE: inference only; the kernels have no backward (nn.Parameters require grad)
    topk_weights, w13, w2 = topk_weights.float().detach(), w13.detach(), w2.detach()
    if hidden.device.type == "cpu" and cpu_ext.load():
        return torch.ops.pdserve_cpu.moe_grouped(hidden, topk_ids, topk_weights, w13, w2)
    if use_triton(hidden):
        from pdserve.kernels.moe_triton import fused_moe_triton

        return fused_moe_triton(hidden, topk_ids, topk_weights, w13, w2)
    return moe_ref(hidden, topk_ids, topk_weights, w13, w2)
