"""Building blocks of the Llama family: RMSNorm and rotary position embeddings.

Both follow transformers' arithmetic step for step (fp32 statistics, the cast back to the
activation dtype in the same place), so outputs agree with transformers to rounding.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pdserve.engine.config import ModelConfig


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019, https://arxiv.org/abs/1910.07467).

    ``x: [..., dim]`` -> same shape and dtype; statistics in fp32.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies ``[head_dim // 2]`` fp32 (RoFormer,
    https://arxiv.org/abs/2104.09864), with ``linear`` or Llama 3.1's ``llama3`` scaling.
    """
    dim, base = config.head_dim, config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    params = config.rope_parameters
    if config.rope_type == "linear":
        return inv_freq / float(params["factor"])
    if config.rope_type != "llama3":
        return inv_freq
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Applies RoPE (rotate-half layout, as transformers' Llama) to q and k.

    Holds a ``[max_position_embeddings, head_dim]`` fp32 cos and sin table.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [P, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """``positions: [T]`` int64, ``q: [T, H, D]``, ``k: [T, H_kv, D]`` -> rotated q, k."""
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
