"""A decode step's decoder layers as one chain of the C++ CPU kernels, without the
modules' per-call Python.

At batch 1 the kernels of a small model's layer take tens of microseconds, and the Python
around them about as much: ``nn.Module`` calls, the dispatching wrappers' device, dtype
and stride checks, the op overloads' resolution, the metadata's lookups. On W1's shape
(12 layers, int4) a batch-1 forward pass took 2.2 ms through the modules and 1.45 ms as
a bare chain of the same kernels. On a GPU a CUDA graph removes that cost; on the CPU,
``CpuDecodeLayers`` resolves each layer's kernels once, at load, and a pure decode step
(every token a one-token sequence, the case of every step without a prompt chunk) calls
them directly.

It runs the kernels the modules would, in their order, on the same tensors, so its output
is the modules' bit for bit (``tests/test_cpu_decode.py``). The kernels check their own
arguments in C++ (shapes, dtypes, strides, slot and block ranges) and raise RuntimeError
naming the bad one. Layers it does not cover (Gemma's sandwich norms and norm, a mixture
of experts, tensor parallelism, GeGLU, a norm weight outside the compute dtype)
make ``build`` return None, and the modules run as before; so do steps it does not cover
(a prompt chunk in the batch, a quantized KV cache, LongRoPE positions).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.models.blocks import MLP, Attention, AttentionMetadata
from pdserve.engine.models.layers import RMSNorm
from pdserve.kernels import cpu_ext
from pdserve.kernels.layers import rms_norm as rms_norm_rows
from pdserve.kernels.layers import silu_and_mul

Linear = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class _Layer:
    """One decoder layer's kernels' arguments (``CpuDecodeLayers``)."""

    input_norm: torch.Tensor  # [hidden] in the compute dtype
    post_norm: torch.Tensor
    eps: float
    qkv: Linear  # [T, hidden] -> [T, q + 2 kv]
    o: Linear
    gate_up: Linear
    down: Linear
    sliding_window: int  # 0: full attention
    local_rope: bool  # the local RoPE table (a sliding layer of a model that has one)
    qk_norms: tuple[RMSNorm, RMSNorm] | None  # Qwen3's per-head norms of q and k


class CpuDecodeLayers:
    """The decoder layers of a CPU ``LlamaForCausalLM`` for pure decode steps.

    ``__call__(x [T, hidden], rope, local_rope, kv_cache [L, 2, num_blocks, block_size,
    H_kv, D], meta)`` -> ``(x, residual)``, each ``[T, hidden]`` in the compute dtype, as
    the layer loop of ``LlamaForCausalLM.forward`` returns them; ``rope`` and
    ``local_rope`` are the step's ``[T, D]`` cos and sin pairs. ``applies`` says whether
    a step is one it covers.

    The layers hold the modules' weights: build it after the weights are final (loaded,
    quantized, packed), as ``loader.load_model`` does.
    """

    def __init__(self, layers: list[_Layer], attention: Attention, intermediate_size: int,
                 dtype: torch.dtype) -> None:
        self.layers = layers
        self.dtype = dtype
        self.num_heads, self.num_kv_heads = attention.num_heads, attention.num_kv_heads
        self.head_dim = attention.head_dim
        self.q_size, self.kv_size = attention.q_size, attention.kv_size
        self.scale, self.softcap = attention.scale, attention.softcap or 0.0
        self.intermediate_size = intermediate_size
        self.block_strides = (self.kv_size, self.head_dim, 1)  # [block_size, H_kv, D] packed

    @classmethod
    def build(cls, model: torch.nn.Module) -> CpuDecodeLayers | None:
        """The chain for ``model`` (a ``LlamaForCausalLM`` on the CPU), or None where a
        layer is not one it covers or the C++ kernels are not built."""
        from pdserve.engine.models.llama import DecoderLayer

        decoder = model.model
        dtype = model.config.dtype
        if model.tp.size != 1 or decoder.norm.weight.device.type != "cpu" \
                or not cpu_ext.load():
            return None
        layers = []
        for layer in decoder.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qk_norms = (attn.q_norm, attn.k_norm) if attn.qk_norm else None
            norms = (layer.input_layernorm, layer.post_attention_layernorm, *(qk_norms or ()))
            if (type(layer) is not DecoderLayer or type(attn) is not Attention
                    or type(mlp) is not MLP or mlp.act_and_mul is not silu_and_mul
                    or any(type(n) is not RMSNorm or n.weight.dtype != dtype for n in norms)):
                return None
            layers.append(_Layer(
                norms[0].weight, norms[1].weight, norms[0].eps,
                _rows_kernel(attn.qkv_proj), _rows_kernel(attn.o_proj),
                _rows_kernel(mlp.gate_up_proj), _rows_kernel(mlp.down_proj),
                attn.sliding_window or 0,
                attn.sliding_window is not None and model.local_rotary_emb is not None,
                qk_norms))
        if not layers:
            return None
        first = decoder.layers[0]
        return cls(layers, first.self_attn, first.mlp.intermediate_size, dtype)

    def applies(self, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                kv_scales: torch.Tensor | None) -> bool:
        """Whether the step is a pure decode step of the compute dtype, on a float KV
        cache of that dtype whose blocks are each packed (``kv_cache_layout``), without
        LongRoPE positions."""
        return (meta.num_decode_tokens == x.shape[0] > 0 and kv_scales is None
                and meta.rope_long is None and x.dtype == self.dtype
                and kv_cache.dtype == self.dtype
                and kv_cache.stride()[-3:] == self.block_strides)

    def __call__(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 local_rope: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        ops = torch.ops.pdserve_cpu
        rms_norm, add_rms_norm = ops.rms_norm.default, ops.fused_add_rms_norm.default
        rotary, store_kv = ops.rotary_embedding.default, ops.store_kv.default
        attention, act = ops.paged_decode_attention.default, ops.silu_and_mul.default
        tokens, dtype = x.shape[0], x.dtype
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        sizes = [self.q_size, self.kv_size, self.kv_size]
        seq_lens = meta.decode_seq_lens.to(torch.int32)
        tables, slots = meta.decode_block_tables, meta.slot_mapping
        residual = None
        for layer, cache in zip(self.layers, kv_cache):
            if residual is None:  # the first layer: its input is the embedding alone
                residual, x = x, torch.empty_like(x)
                rms_norm(x, residual, layer.input_norm, layer.eps)
            else:
                add_rms_norm(x, residual, layer.input_norm, layer.eps)
            q, k, v = layer.qkv(x).split(sizes, dim=-1)
            q = q.view(tokens, heads, head_dim)
            k = k.view(tokens, kv_heads, head_dim)
            v = v.view(tokens, kv_heads, head_dim)
            if layer.qk_norms is not None:  # RMSNorm.forward's kernel on [T, heads, D]
                q, k = (_norm_heads(t, norm) for t, norm in zip((q, k), layer.qk_norms))
            rotary(q, k, *(local_rope if layer.local_rope else rope))
            key_cache, value_cache = cache[0], cache[1]
            store_kv(k, v, key_cache, value_cache, slots)
            out = torch.empty(q.shape, dtype=dtype)
            attention(out, q, key_cache, value_cache, tables, seq_lens, self.scale,
                      layer.sliding_window, self.softcap)
            x = layer.o(out.view(tokens, self.q_size))
            add_rms_norm(x, residual, layer.post_norm, layer.eps)
            gate_up = layer.gate_up(x)
            x = torch.empty((tokens, self.intermediate_size), dtype=dtype)
            act(x, gate_up)
            x = layer.down(x)
        return x, residual


def _norm_heads(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """``norm`` over the last dim of ``x [T, heads, D]`` (a view of the fused projection)
    -> a new ``[T, heads, D]``, as ``RMSNorm.forward`` computes it, without its module
    call."""
    return rms_norm_rows(x.reshape(-1, x.shape[-1]), norm.weight, norm.eps).view(x.shape)


def _rows_kernel(linear: torch.nn.Module) -> Linear:
    """``linear``'s bound kernel where it has one (``rows_kernel``), else its ``forward``."""
    rows_kernel = getattr(linear, "rows_kernel", None)
    return rows_kernel() if rows_kernel is not None else linear.forward
