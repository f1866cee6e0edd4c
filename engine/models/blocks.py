"""The pieces every family's decoder layer shares (``llama.DecoderLayer``,
``gemma.GemmaDecoderLayer``): where a step's tokens sit in the paged KV cache
(``AttentionMetadata``), the family's norm, self-attention over the paged cache, and the
gated MLP. The switches between families are ``ModelConfig``'s (``llama.py`` lists them).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.models.layers import GemmaRMSNorm, RMSNorm
from pdserve.engine.parallel import TensorParallel
from pdserve.kernels.kv_store import store_kv
from pdserve.kernels.layers import gelu_tanh_and_mul_ref, rotary_embedding, silu_and_mul
from pdserve.kernels.paged_decode_attention import paged_decode_attention
from pdserve.kernels.paged_prefill_attention import paged_prefill_attention


@dataclass(slots=True)
class AttentionMetadata:
    """Where a step's tokens sit in the paged KV cache.

    The flat batch holds ``num_decode_tokens`` single-token sequences first, then the
    prefill chunks. All tensors are on the model's device.

    Attributes:
        slot_mapping: ``[num_tokens]`` int64 cache slot of each token.
        num_decode_tokens: tokens (= sequences) on the decode path.
        decode_block_tables: ``[num_decode_seqs, max_blocks]`` int32.
        decode_seq_lens: ``[num_decode_seqs]`` int32 context lengths incl. the new token.
        prefill_block_tables: ``[num_prefill_seqs, max_blocks]`` int32.
        prefill_cu_seqlens_q: ``[num_prefill_seqs + 1]`` int32 chunk offsets.
        prefill_seq_lens: ``[num_prefill_seqs]`` int32 context lengths incl. the chunk.
        rope_long: ``[num_tokens]`` bool, LongRoPE models only (Phi-3): the token takes
            the long factors, its sequence being past ``original_max_position_embeddings``
            (the longer of its prompt and its length after this step, as transformers
            decides for a whole forward pass). None elsewhere.
    """

    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode_block_tables: torch.Tensor
    decode_seq_lens: torch.Tensor
    prefill_block_tables: torch.Tensor
    prefill_cu_seqlens_q: torch.Tensor
    prefill_seq_lens: torch.Tensor
    rope_long: torch.Tensor | None = None


def make_norm(config: ModelConfig, dim: int) -> nn.Module:
    """The family's RMSNorm over ``dim``: Gemma's or Llama's."""
    return (GemmaRMSNorm if config.gemma_norm else RMSNorm)(dim, config.rms_norm_eps)


class Attention(nn.Module):
    """Layer ``layer``'s self-attention: fused q/k/v, optional q/k norm, RoPE, the KV
    store and paged attention (within the layer's sliding window, soft-capped where the
    family does), the output projection.

    ``config`` is the rank's (``TensorParallel.local_config``: its heads only); under
    tensor parallelism ``o_proj``'s output is all-reduced over ``tp``'s group."""

    def __init__(self, config: ModelConfig, layer: int = 0,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp or TensorParallel()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.softmax_scale
        self.sliding_window = config.layer_windows[layer] if config.layer_windows else None
        self.softcap = config.attn_logit_softcapping
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = make_norm(config, config.head_dim)
            self.k_norm = make_norm(config, config.head_dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        """``x: [T, hidden]``, ``rope``: the step's ``[T, D]`` cos and sin,
        ``kv_cache: [2, num_blocks, block_size, H_kv, D]`` and, for a quantized cache,
        its ``kv_scales: [2, num_blocks, H_kv]`` fp32 -> ``[T, hidden]``."""
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, H_kv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary_embedding(q, k, *rope)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        scales = (None, None) if kv_scales is None else (kv_scales[0], kv_scales[1])
        store_kv(k, v, key_cache, value_cache, meta.slot_mapping, *scales)
        nd = meta.num_decode_tokens
        options = (self.scale, self.sliding_window, self.softcap, *scales)
        if nd == num_tokens:
            out = paged_decode_attention(q, key_cache, value_cache, meta.decode_block_tables,
                                         meta.decode_seq_lens, *options)
        elif nd == 0:
            out = paged_prefill_attention(q, key_cache, value_cache, meta.prefill_block_tables,
                                          meta.prefill_cu_seqlens_q, meta.prefill_seq_lens,
                                          *options)
        else:
            out = torch.cat([
                paged_decode_attention(q[:nd], key_cache, value_cache, meta.decode_block_tables,
                                       meta.decode_seq_lens, *options),
                paged_prefill_attention(q[nd:], key_cache, value_cache,
                                        meta.prefill_block_tables, meta.prefill_cu_seqlens_q,
                                        meta.prefill_seq_lens, *options),
            ])
        return self.tp.all_reduce(self.o_proj(out.reshape(num_tokens, self.q_size)))


class MLP(nn.Module):
    """The gated MLP: SwiGLU, or GeGLU (Gemma's ``gelu_pytorch_tanh``); ``config`` the
    rank's (its share of ``intermediate_size``), ``down_proj``'s output all-reduced."""

    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp or TensorParallel()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_and_mul = (gelu_tanh_and_mul_ref if config.hidden_act == "gelu_pytorch_tanh"
                            else silu_and_mul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act_and_mul(self.gate_up_proj(x))  # [T, 2I] -> [T, I]
        return self.tp.all_reduce(self.down_proj(x))
