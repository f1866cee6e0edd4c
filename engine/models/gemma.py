"""Gemma 2 and Gemma 3's decoder layer: where its structure differs from Llama's.

A Gemma layer normalises the attention's and the MLP's outputs before each residual add
("sandwich" norms: ``post_attention_layernorm``, ``pre_feedforward_layernorm``,
``post_feedforward_layernorm``), so its adds are plain ones rather than fused into the
next norm. Everything else (GeGLU, ``(1 + weight)`` norms, q/k norms, the attention scale,
soft-capping, sliding windows) is a switch on the shared pieces of ``blocks.py``. As
transformers' ``Gemma2DecoderLayer`` (Gemma 2, https://arxiv.org/abs/2408.00118).
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.models.blocks import MLP, Attention, AttentionMetadata, make_norm
from pdserve.engine.parallel import TensorParallel


class GemmaDecoderLayer(nn.Module):
    """``forward(x [T, hidden], residual None, rope, kv_cache, meta, kv_scales)`` ->
    ``(x, None)``: the layer's output with its residual adds done (each in the model's
    dtype, as transformers rounds them)."""

    def __init__(self, config: ModelConfig, layer: int = 0,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer, tp)
        self.mlp = MLP(config, tp)
        hidden = config.hidden_size
        self.input_layernorm = make_norm(config, hidden)
        self.post_attention_layernorm = make_norm(config, hidden)
        self.pre_feedforward_layernorm = make_norm(config, hidden)
        self.post_feedforward_layernorm = make_norm(config, hidden)

    def forward(self, x: torch.Tensor, residual: None,
                rope: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                meta: AttentionMetadata, kv_scales: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, None]:
        attn = self.self_attn(self.input_layernorm(x), rope, kv_cache, meta, kv_scales)
        x = x + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(mlp), None
