"""Every family pdserve runs as one decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3, and with
the layer of ``gemma.py``, Gemma 2 and 3).

The architectures differ only by config switches (``ModelConfig``, ``engine/families.py``):
``qkv_bias`` (Qwen2), ``qk_norm`` (Qwen3, Gemma 3: per-head RMSNorm on q and k before
RoPE), ``rope_type`` (``longrope`` for Phi-3) and per-layer RoPE (Gemma 3's local
layers), per-layer sliding windows, the activation (SwiGLU or GeGLU), the attention
scale and soft-caps, the embedding scale, tied embeddings, and Gemma's sandwich norms
(``gemma.GemmaDecoderLayer``). The model works on a flat batch of tokens from many
sequences (no padding) and reads and writes the paged KV cache through
``AttentionMetadata``; it knows nothing of scheduling. q/k/v and gate/up projections are
fused for fewer, larger matmuls; ``load_weights`` maps transformers' parameter names onto
them (Phi-3's checkpoints store them fused already). Mixture-of-experts families
(Mixtral, Qwen2-MoE, Qwen3-MoE) swap a layer's MLP for ``moe.MoEBlock``, which loads its
own router and expert tensors.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.models.layers import GemmaRMSNorm, RMSNorm, RotaryEmbedding
from pdserve.engine.models.moe import MoEBlock, load_moe_weight
from pdserve.engine.models.quantization import install_quantized
from pdserve.engine.parallel import TensorParallel
from pdserve.kernels.kv_store import store_kv
from pdserve.kernels.layers import gelu_tanh_and_mul_ref, rotary_embedding, silu_and_mul
from pdserve.kernels.paged_decode_attention import paged_decode_attention
from pdserve.kernels.paged_prefill_attention import paged_prefill_attention
from pdserve.kernels.quant_linear import QuantWeight


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


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer (Llama's), the residual adds fused into the norms."""

    def __init__(self, config: ModelConfig, layer: int = 0,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer, tp)
        # MoE layers: a sparse block that takes its own share of every expert
        self.mlp = (MoEBlock(config, tp or TensorParallel()) if config.is_moe_layer(layer)
                    else MLP(config, tp))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, rope, kv_cache, meta, kv_scales=None):
        """``x, residual: [T, hidden]`` -> ``(x, residual)``; the layer's input is
        ``x + residual`` (``residual`` None: just ``x``), added inside the fused norms as
        vLLM does. Rounding is transformers': each residual sum in the model dtype."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, kv_cache, meta, kv_scales)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class VocabParallelEmbedding(nn.Module):
    """The token embedding, ``tp.vocab_shard``'s rows on each rank (all of them at size 1).

    ``forward(input_ids [T] int64)`` -> ``[T, hidden]``: each rank looks up the ids in its
    rows, zeros for the others, and the all-reduce sums them (exact: one rank adds the
    row, the rest add zeros).
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.start, rows = tp.vocab_shard(vocab_size)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return nn.functional.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill_(outside[:, None], 0))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        from pdserve.engine.models.gemma import GemmaDecoderLayer

        tp = tp or TensorParallel()
        local = tp.local_config(config)
        layer_class = GemmaDecoderLayer if config.sandwich_norm else DecoderLayer
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(layer_class(local, i, tp) for i in range(config.num_layers))
        self.norm = make_norm(config, config.hidden_size)


class LlamaForCausalLM(nn.Module):
    """Causal LM over a flat token batch, for every family (``ModelConfig``).

    ``forward(input_ids [T] int64, positions [T] int64, kv_cache [L, 2, num_blocks,
    block_size, H_kv, D], meta, kv_scales [L, 2, num_blocks, H_kv] fp32 for a quantized
    cache)`` returns hidden states ``[T, hidden]``;
    ``compute_logits(hidden [N, hidden])`` returns fp32 logits ``[N, vocab]`` (on rank 0;
    None on the other ranks of a tensor-parallel group, ``engine/parallel.py``).

    ``config`` is the whole model's; ``tp`` this process's rank (default: the only one),
    whose share of every weight the model holds and loads.
    """

    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp or TensorParallel()
        self.model = LlamaModel(config, self.tp)
        self.rotary_emb = RotaryEmbedding(config)
        # NOTE: Gemma 3's sliding layers rotate with a base of their own
        self.local_rotary_emb = (RotaryEmbedding(config, config.local_rope_parameters)
                                 if config.local_rope_parameters else None)
        self.lm_head = nn.Linear(config.hidden_size, self.tp.vocab_shard(config.vocab_size)[1],
                                 bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, kv_scales: torch.Tensor | None = None
                ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        if self.config.embed_scale is not None:  # NOTE: the scale rounded to x's dtype first
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        if meta.rope_long is not None:  # LongRoPE: the long factors' rows follow the short's
            positions = positions + meta.rope_long * self.rotary_emb.num_positions
        rope = self.rotary_emb.cos_sin(positions, x.dtype)
        local_rope = (self.local_rotary_emb.cos_sin(positions, x.dtype)
                      if self.local_rotary_emb is not None else rope)
        windows = self.config.layer_windows or (None,) * len(self.model.layers)
        residual = None
        layer_scales = kv_scales if kv_scales is not None else (None,) * len(windows)
        for layer, layer_cache, scales, window in zip(self.model.layers, kv_cache, layer_scales,
                                                      windows):
            x, residual = layer(x, residual, rope if window is None else local_rope,
                                layer_cache, meta, scales)
        return self.model.norm(x) if residual is None else self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden)  # [N, vocab / tp]
        cap = self.config.final_logit_softcapping
        if cap:  # Gemma 2: in the model's dtype, as transformers
            logits = torch.tanh(logits / cap) * cap
        logits = self.tp.gather_to_first(logits)  # [N, padded vocab] on rank 0
        return None if logits is None else logits[:, :self.config.vocab_size].float()

    def weight_shard(self, name: str, shape: tuple[int, ...]
                     ) -> list[tuple[int, int, int]] | None:
        """This rank's share of checkpoint tensor ``name`` of ``shape`` (transformers'
        names; Phi-3's fused ones too): pieces ``(dim, start, length)`` to concatenate
        along ``dim``, or None for the whole tensor (every tensor at size 1; norms).
        A vocab-parallel piece may end before the rank's rows (the padding's)."""
        tp = self.tp
        if tp.size == 1:
            return None
        cfg = self.config
        d, heads, kv_heads = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        q0, qn = tp.shard(heads)
        k0, kn = tp.kv_head_shard(kv_heads)
        i0, i_n = tp.shard(cfg.intermediate_size)
        q = (q0 * d, qn * d)
        k = (k0 * d, kn * d)
        if ".experts." in name or ".shared_expert." in name:
            return None  # NOTE: a MoE block takes its own share (moe.MoEBlock.load_weight)
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            start, rows = tp.vocab_shard(cfg.vocab_size)
            return [(0, start, max(0, min(rows, shape[0] - start)))]
        if ".q_proj." in name:
            return [(0, *q)]
        if ".k_proj." in name or ".v_proj." in name:
            return [(0, *k)]
        if ".o_proj." in name:
            return [(1, *q)]
        if ".gate_proj." in name or ".up_proj." in name:
            return [(0, i0, i_n)]
        if ".down_proj." in name:
            return [(1, i0, i_n)]
        if ".qkv_proj." in name:  # Phi-3: [q; k; v] rows
            return [(0, *q), (0, heads * d + k[0], k[1]), (0, (heads + kv_heads) * d + k[0], k[1])]
        if ".gate_up_proj." in name:  # Phi-3: [gate; up] rows
            return [(0, i0, i_n), (0, cfg.intermediate_size + i0, i_n)]
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantWeight]]
                     ) -> set[str]:
        """Copy transformers-named tensors into the fused parameters; quantized weights
        (``QuantWeight``: a GGUF file's or a quantized checkpoint's) replace their linear,
        shards of a fused one stacked (``quantization.install_quantized``).

        Returns the names of the parameters that were written.

        Raises:
            KeyError: a checkpoint tensor with no place in this model.
            ValueError: a tensor whose shape does not match its place.
        """
        params = dict(self.named_parameters())
        q, kv = self.model.layers[0].self_attn.q_size, self.model.layers[0].self_attn.kv_size
        inter = next((layer.mlp.intermediate_size for layer in self.model.layers  # the rank's
                      if isinstance(layer.mlp, MLP)), 0)  # NOTE: a dense layer's, if any
        shards = {"q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, kv),
                  "v_proj": ("qkv_proj", q + kv, kv), "gate_proj": ("gate_up_proj", 0, inter),
                  "up_proj": ("gate_up_proj", inter, inter)}
        loaded: set[str] = set()
        # linears whose float weight was dropped (drop_quantized_weights): all their shards
        # go to install_quantized, float ones too
        replaced = {f"{n}.weight" for n, m in self.named_modules()
                    if isinstance(m, nn.Linear) and m.weight is None}
        quantized: dict[str, list[tuple[int, QuantWeight | torch.Tensor]]] = {}
        moe_blocks = {i: layer.mlp for i, layer in enumerate(self.model.layers)
                      if isinstance(layer.mlp, MoEBlock)}
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if moe_blocks and (written := load_moe_weight(moe_blocks, name, tensor)):
                loaded.add(written)  # NOTE: the router and experts load themselves
                continue
            tied_head = name == "lm_head.weight" and self.config.tie_word_embeddings
            if tied_head and not isinstance(tensor, QuantWeight):
                continue  # NOTE: a quantized tied head gets its own linear
            target, start, size = name, 0, None
            for shard, (fused, offset, length) in shards.items():
                if f".{shard}." in name:
                    target, start, size = name.replace(shard, fused), offset, length
            if target not in params and target not in replaced and not tied_head:
                raise KeyError(f"checkpoint tensor {name!r} has no place in "
                               f"{self.config.architecture}")
            if isinstance(tensor, QuantWeight) or target in replaced:
                quantized.setdefault(target, []).append((start, tensor))
            else:
                dest = params[target].data if size is None else \
                    params[target].data[start:start + size]
                if target.endswith(("embed_tokens.weight", "lm_head.weight")) and \
                        tensor.shape[0] < dest.shape[0]:  # the vocab shard's padding
                    dest[tensor.shape[0]:].zero_()
                    dest = dest[:tensor.shape[0]]
                if dest.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != "
                                     f"expected {tuple(dest.shape)}")
                dest.copy_(tensor)
            loaded.add(target)
        install_quantized(self, quantized, self.model.embed_tokens.weight.device)
        return loaded
