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

import torch
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.models.blocks import MLP, Attention, AttentionMetadata, make_norm
from pdserve.engine.models.gemma import GemmaDecoderLayer
from pdserve.engine.models.layers import RMSNorm, RotaryEmbedding
from pdserve.engine.models.moe import MoEBlock, load_moe_weight
from pdserve.engine.models.quantization import QuantizedEmbedding, install_quantized
from pdserve.engine.parallel import TensorParallel
from pdserve.kernels.quant_linear import QuantWeight


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
        # the layers as one chain of CPU kernels for decode steps (cpu_decode.py), set by
        # loader.load_model once the weights are final
        self.cpu_decode = None

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
        if self.cpu_decode is not None and self.cpu_decode.applies(x, kv_cache, meta, kv_scales):
            x, residual = self.cpu_decode(x, rope, local_rope, kv_cache, meta)
            return self.model.norm(x, residual)[0]
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
        device = self.model.norm.weight.device
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
            if name == "model.embed_tokens.weight" and isinstance(tensor, QuantWeight):
                # NOTE: a GGUF file's quantized table stays so (gguf_source.iterate_weights)
                self.model.embed_tokens = QuantizedEmbedding(
                    tensor, self.config.dtype, device)
                loaded.add(name)
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
        install_quantized(self, quantized, device)
        return loaded
