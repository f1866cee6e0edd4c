"""Model and engine configuration, read from a local model.

``ModelConfig.from_pretrained`` reads the model's ``config.json``-shaped configuration
from its source (``engine/model_source.py``: a checkpoint folder's ``config.json``, a GGUF
file's metadata), both the transformers 4 ``rope_scaling``/``rope_theta`` keys and the
transformers 5 ``rope_parameters`` form, and refuses anything pdserve would compute
differently from transformers (``UnsupportedModelError``, naming the field) before any
weight is read.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.engine.families import (
    FAMILIES,
    UnsupportedModelError,
    architecture,
    check_fields,
    gemma_fields,
    layer_windows,
    moe_fields,
    rope_parameters,
)
from pdserve.engine.quant_config import parse_quantization_config

_REQUIRED_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size", "vocab_size")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(dtype: str | torch.dtype, checkpoint_dtype: str | None) -> torch.dtype:
    """Resolve ``"auto"`` / a name / a ``torch.dtype`` to one of float32, bfloat16, float16.

    Raises:
        ValueError: the name is not one of ``auto``, ``float32``, ``bfloat16``, ``float16``
            (``float``, ``half``, ``bf16``, ``fp16``, ``fp32`` are accepted aliases).
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use one of {list(_DTYPES)}")
        return dtype
    aliases = {"float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16",
               "bf16": "bfloat16"}
    name = aliases.get(dtype, dtype)
    if name == "auto":
        name = aliases.get(checkpoint_dtype or "float32", checkpoint_dtype or "float32")
        return _DTYPES.get(name, torch.float32)
    if name not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use 'auto' or one of {list(_DTYPES)}")
    return _DTYPES[name]


def cpu_compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype this machine's CPU runs a ``dtype`` checkpoint fastest in, for
    ``dtype="auto"`` on the CPU: float32 for a bfloat16 or float16 checkpoint on an x86
    CPU without AVX-512 (an AVX2 machine has no bfloat16 or float16 arithmetic, so torch's
    half-precision matmuls convert element by element: on a 2-core AMD EPYC (Zen 3) a
    ``[1024, 768] x [768, 2048]`` linear ran at 17 GFLOP/s in bfloat16 and 20 in float16
    against 84 in float32), ``dtype`` itself everywhere else. The weights then take twice
    the memory of the checkpoint's; ``--dtype bfloat16`` keeps them as they are.
    """
    if dtype == torch.float32 or platform.machine().lower() not in ("x86_64", "amd64"):
        return dtype
    if torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported():
        return dtype
    return torch.float32


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The decoder-only transformer pdserve runs, as one decoder with switches
    (``engine/families.py``): Llama (3.1, 3.2), SmolLM, Mistral, Qwen2, Qwen3, Phi-3,
    Gemma 2 and Gemma 3 (text), and the mixtures of experts Mixtral, Qwen2-MoE and
    Qwen3-MoE.

    ``rope_type`` selects the rotary frequencies (``llama3`` for Llama 3.1, ``longrope``
    for Phi-3); ``local_rope_parameters`` are those of the sliding layers where they
    differ (Gemma 3). ``layer_windows``: each layer's sliding window (None: full
    attention). ``hidden_act``: ``silu`` (SwiGLU) or ``gelu_pytorch_tanh`` (GeGLU). The
    Gemma switches: ``gemma_norm`` (RMSNorm as ``(1 + weight)``, scaled in fp32),
    ``sandwich_norm`` (norms after attention and around the MLP), ``embed_scale``,
    ``attn_scale`` (default ``head_dim ** -0.5``), the attention and final logit
    soft-caps. ``fused_checkpoint``: q/k/v and gate/up stored fused (Phi-3). Lengths are
    in tokens.

    Mixture of experts (``num_experts`` > 0; ``engine/models/moe.py``): the layers whose
    ``moe_layers`` entry is True replace the MLP with ``num_experts`` experts of
    ``moe_intermediate_size``, ``num_experts_per_tok`` of them per token; the top-k
    routing weights renormalised where ``norm_topk_prob``, kept in fp32 where
    ``router_weights_fp32`` (Mixtral) else rounded to the activation dtype (Qwen); a
    shared expert of ``shared_expert_intermediate_size`` (0: none) behind a sigmoid gate
    (Qwen2-MoE). The other layers keep the dense MLP of ``intermediate_size``.
    """

    model: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    max_model_len: int
    dtype: torch.dtype
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_type: str = "default"
    rope_parameters: dict[str, Any] = field(default_factory=dict)
    local_rope_parameters: dict[str, Any] | None = None
    layer_windows: tuple[int | None, ...] = ()
    hidden_act: str = "silu"
    gemma_norm: bool = False
    sandwich_norm: bool = False
    embed_scale: float | None = None
    attn_scale: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    fused_checkpoint: bool = False
    # --quantization, else the checkpoint's quant_method: engine/models/quantization.py
    quantization: str | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    router_weights_fp32: bool = False
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[bool, ...] = ()

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` is a sparse MoE block (else the dense MLP)."""
        return bool(self.moe_layers) and self.moe_layers[layer]

    @property
    def softmax_scale(self) -> float:
        """The attention's softmax scale."""
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    @property
    def kv_free_window(self) -> int | None:
        """Tokens back from a query beyond which no layer reads K/V: the largest window
        when every layer slides (their blocks can be freed), else None."""
        if not self.layer_windows or any(w is None for w in self.layer_windows):
            return None
        return max(self.layer_windows)

    @classmethod
    def from_pretrained(
        cls, model: str | os.PathLike, *, dtype: str | torch.dtype = "auto",
        max_model_len: int | None = None,
    ) -> ModelConfig:
        """Read and validate the configuration of the local model ``model`` (a checkpoint
        folder or a ``.gguf`` file: ``model_source.open_model``).

        Raises:
            FileNotFoundError: no such model, or a folder without ``config.json``.
            UnsupportedModelError: unknown architecture, activation, RoPE type or layer
                type, MLP bias, a ``quantization_config`` pdserve does not read
                (``engine/quant_config.py``), or a required field missing
                (``engine/families.py``); the message names the field.
            ValueError: a bad ``dtype`` or ``max_model_len`` outside
                ``[1, max_position_embeddings]``.
        """
        from pdserve.engine.model_source import open_model

        source = open_model(model)
        return cls.from_dict(source.config_dict(), model=str(source.path), dtype=dtype,
                             max_model_len=max_model_len)

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], *, model: str, dtype: str | torch.dtype = "auto",
        max_model_len: int | None = None,
    ) -> ModelConfig:
        """Validate ``raw`` (keyed as ``config.json``) for the model at path ``model``.

        Raises: as ``from_pretrained``.
        """
        arch = architecture(raw)
        quant = parse_quantization_config(raw.get("quantization_config"))
        missing = [k for k in _REQUIRED_FIELDS if raw.get(k) is None]
        if missing:
            raise UnsupportedModelError(f"the model's config lacks {missing[0]!r}")
        family = FAMILIES[arch]
        check_fields(raw, arch)
        if family.gemma and arch == "Gemma3ForCausalLM":
            rope = rope_parameters(raw, "full_attention")
            local_rope = rope_parameters(raw, "sliding_attention")
        else:
            rope, local_rope = rope_parameters(raw), None
        max_pos = int(raw.get("max_position_embeddings", 2048))
        if max_model_len is None:
            max_model_len = max_pos
        if not 1 <= max_model_len <= max_pos:
            raise ValueError(f"max_model_len={max_model_len} must be in [1, {max_pos}] "
                             "(the checkpoint's max_position_embeddings)")
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        head_dim = int(raw.get("head_dim") or hidden // num_heads)
        num_layers = int(raw["num_hidden_layers"])
        extra = gemma_fields(raw, hidden, head_dim) if family.gemma else {}
        extra.update(moe_fields(raw, arch, num_layers))
        if family.moe and quant is not None:
            raise UnsupportedModelError(
                f"quantization_config.quant_method={quant.method!r} is not supported for "
                f"{arch}: pdserve runs mixture-of-experts weights in bf16/fp16/fp32 only")
        return cls(
            model=model,
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            intermediate_size=int(raw["intermediate_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            max_position_embeddings=max_pos,
            max_model_len=max_model_len,
            dtype=parse_dtype(dtype, raw.get("dtype") or raw.get("torch_dtype")),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=(family.qkv_bias and bool(raw.get("qkv_bias", True))
                      or bool(raw.get("attention_bias", False))),
            qk_norm=family.qk_norm,
            rope_type=rope["rope_type"],
            rope_parameters=rope,
            local_rope_parameters=local_rope,
            layer_windows=layer_windows(raw, arch, num_layers),
            hidden_act="gelu_pytorch_tanh" if family.gemma else "silu",
            gemma_norm=family.gemma,
            sandwich_norm=family.gemma,
            fused_checkpoint=family.fused_checkpoint,
            quantization=None if quant is None else quant.method,
            **extra,
        )

