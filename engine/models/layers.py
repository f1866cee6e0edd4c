"""Building blocks of the Llama family: RMSNorm, rotary position embeddings, packed linears.

The arithmetic is in ``pdserve.kernels.layers`` (fused C++ on CPU), which follows
transformers' step for step (fp32 statistics, the cast back to the activation dtype in
the same places), so outputs agree with transformers to rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.kernels import cpu_ext
from pdserve.kernels.layers import fused_add_rms_norm, gemma_rms_norm_ref, rms_norm


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019, https://arxiv.org/abs/1910.07467),
    optionally fused with the residual add before it (vLLM's ``fused_add_rms_norm``).

    ``forward(x [..., dim])`` -> same shape and dtype, statistics in fp32;
    ``forward(x [T, dim], residual [T, dim])`` -> ``(norm(x + residual), x + residual)``,
    the inputs then invalid (updated in place on CPU). See ``pdserve.kernels.layers``.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        if x.dim() == 2:
            return rms_norm(x, self.weight, self.eps)
        return rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)


def rope_inv_freq(head_dim: int, params: dict, max_position_embeddings: int,
                  long: bool = False) -> tuple[torch.Tensor, float]:
    """Rotary inverse frequencies ``[head_dim // 2]`` fp32 (RoFormer,
    https://arxiv.org/abs/2104.09864) and the factor on cos and sin, for ``params`` (a
    ``ModelConfig.rope_parameters``): ``default``; ``linear`` scaling; Llama 3.1's
    ``llama3``; Phi-3's ``longrope`` (LongRoPE, https://arxiv.org/abs/2402.13753: per
    frequency ``short_factor`` or, with ``long``, ``long_factor``, and cos and sin times
    ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))``), each as transformers
    computes it.
    """
    base = float(params.get("rope_theta", 10000.0))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    rope_type = params.get("rope_type", "default")
    if rope_type == "longrope":
        original = int(params["original_max_position_embeddings"])
        factor = params.get("factor") or max_position_embeddings / original
        scaling = params.get("attention_factor")
        if scaling is None:
            scaling = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor)
                                                          / math.log(original))
        ext = torch.tensor(params["long_factor" if long else "short_factor"],
                           dtype=torch.float32)
        return 1.0 / (ext * base ** exponents), float(scaling)
    inv_freq = 1.0 / (base ** exponents)
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type != "llama3":
        return inv_freq, 1.0
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled), 1.0


class RotaryEmbedding(nn.Module):
    """Applies RoPE (rotate-half layout, as transformers' Llama) to q and k.

    Holds a ``[max_position_embeddings, head_dim]`` fp32 cos and sin table for ``params``
    (default: the model's ``rope_parameters``); for ``longrope`` two, the short factors'
    then the long factors' (``[2 * max_position_embeddings, head_dim]``): position ``p``
    with the long factors is row ``max_position_embeddings + p``.
    """

    def __init__(self, config: ModelConfig, params: dict | None = None) -> None:
        super().__init__()
        params = config.rope_parameters if params is None else params
        self.num_positions = config.max_position_embeddings
        variants = [False, True] if params.get("rope_type") == "longrope" else [False]
        cos, sin = [], []
        positions = torch.arange(self.num_positions, dtype=torch.float32)
        for long in variants:
            inv_freq, scaling = rope_inv_freq(config.head_dim, params, self.num_positions, long)
            freqs = torch.outer(positions, inv_freq)  # [P, D/2]
            emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
            cos.append(emb.cos() * scaling)
            sin.append(emb.sin() * scaling)
        self.register_buffer("cos", torch.cat(cos), persistent=False)
        self.register_buffer("sin", torch.cat(sin), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's ``[T, D]`` cos and sin in ``dtype``, gathered once for all layers
        (``positions`` past ``max_position_embeddings`` take the long factors)."""
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``(x * rsqrt(mean(x**2) + eps) * (1 + weight))`` in fp32, cast to
    ``x``'s dtype once at the end (Llama's casts before the weight). ``x: [..., dim]``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm_ref(x, self.weight, self.eps)


class PackedLinear(nn.Module):
    """A bias-free or biased linear layer whose weight was reordered once, at load, into a
    kernel's blocked layout, so no call reorders it again (what Inductor's CPU freezing
    does, and vLLM's CPU backend with ``onednn_mm``).

    Two kernels, chosen per layer at construction by its weight's dtype:

    - pdserve's ``torch.ops.pdserve_cpu.linear_packed`` where it is the faster one
      (``cpu_ext.linear_packed_dtypes``, with the measurements): fp32 on an AVX2 + FMA
      CPU without AVX-512 (``kernels/csrc/cpu_gemm.cpp``: panels of 16 output features,
      6 x 16 register tiles, work items handed out dynamically), bf16 on an AVX-512 CPU
      whose bf16 dot products are no faster than fp32 FMAs (``cpu_gemm_avx512.cpp``:
      panels of 32 features, 12 x 32 register tiles summing in fp32);
    - otherwise oneDNN's packed linear (``mkldnn._linear_pointwise``): bf16, about 1.2x
      ``F.linear`` at 32 rows on AVX512-BF16 CPUs; fp32 on that 2-core AVX2 EPYC, 1.5x
      at 32 rows for the 768-wide layers and 2.3x for the 32000-row LM head, level at
      1024 rows.

    ``x: [..., in_features]`` -> ``[..., out_features]``, in the weight's dtype (bf16 or
    fp32): the values of ``F.linear`` up to fp32 summation order.
    """

    def __init__(self, linear: nn.Linear, own_kernel: bool | None = None) -> None:
        """``own_kernel``: use ``linear_packed`` (None: where it is the faster kernel for
        the weight's dtype, ``cpu_ext.linear_packed_dtypes``)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        if own_kernel is None:
            own_kernel = weight.dtype in cpu_ext.linear_packed_dtypes()
        self.own_kernel = own_kernel
        pack = torch.ops.pdserve_cpu.pack_linear_weight if own_kernel else \
            (lambda w: torch.ops.mkldnn._reorder_linear_weight(w, None))
        self.register_buffer("packed_weight", pack(weight), persistent=False)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def rows_kernel(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """This layer's kernel bound to its weight: ``f(x [T, in_features]) ->
        [T, out_features]``, ``forward``'s values without the module call
        (``engine/models/cpu_decode.py``)."""
        if not self.own_kernel:
            return self.forward
        weight, bias, n = self.packed_weight, self.bias, self.out_features
        op = torch.ops.pdserve_cpu.linear_packed.default
        return lambda x: op(x, weight, bias, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.own_kernel:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none",
                                                      [], "")
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.pdserve_cpu.linear_packed(rows, self.packed_weight, self.bias,
                                                  self.out_features)
        return out.view(*x.shape[:-1], self.out_features)


_PACKED_DTYPES = (torch.bfloat16, torch.float32)


def pack_linears_for_cpu(model: nn.Module) -> int:
    """Replace every bf16 or fp32 ``nn.Linear`` of a CPU model with a ``PackedLinear``.

    A dtype is left alone where oneDNN's linear for it is unavailable or gives a result
    different from ``F.linear``; returns the number of layers replaced.
    """
    works = {dtype: _packed_linear_works(dtype) for dtype in _PACKED_DTYPES}
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and works.get(child.weight.dtype, False) \
                    and child.weight.device.type == "cpu":
                setattr(parent, name, PackedLinear(child))
                replaced += 1
    return replaced


def _packed_linear_works(dtype: torch.dtype) -> bool:
    try:
        own_kernel = dtype in cpu_ext.linear_packed_dtypes()
        if not own_kernel and not torch.backends.mkldnn.is_available():
            return False
        x = torch.randn(3, 32).to(dtype)
        linear = nn.Linear(32, 16).to(dtype)
        atol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        return torch.allclose(PackedLinear(linear)(x).float(), linear(x).float(), atol=atol)
    except (RuntimeError, AttributeError):
        return False
