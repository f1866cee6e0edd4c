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

# architecture -> (q/k/v bias forced on, per-head q/k RMSNorm)
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_REQUIRED_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size", "vocab_size")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or a config field is outside what pdserve computes."""


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
    """The decoder-only transformer family pdserve runs (Llama, Mistral, Qwen2, Qwen3).

    The four architectures differ only in ``qkv_bias`` (Qwen2) and ``qk_norm`` (Qwen3);
    ``rope_type`` selects the rotary frequencies (``llama3`` scaling for Llama 3.1).
    Lengths are in tokens.
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

    @classmethod
    def from_pretrained(
        cls, model: str | os.PathLike, *, dtype: str | torch.dtype = "auto",
        max_model_len: int | None = None,
    ) -> ModelConfig:
        """Read and validate the configuration of the local model ``model`` (a checkpoint
        folder or a ``.gguf`` file: ``model_source.open_model``).

        Raises:
            FileNotFoundError: no such model, or a folder without ``config.json``.
            UnsupportedModelError: unknown architecture, activation, RoPE type, an
                active sliding window shorter than ``max_model_len``, MLP bias, a
                ``quantization_config``, or a required field missing; the message names
                the field.
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
        arch = _architecture(raw)
        _check_quantization(raw)
        missing = [k for k in _REQUIRED_FIELDS if raw.get(k) is None]
        if missing:
            raise UnsupportedModelError(f"the model's config lacks {missing[0]!r}")
        force_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        rope = _rope_parameters(raw)
        max_pos = int(raw.get("max_position_embeddings", 2048))
        if max_model_len is None:
            max_model_len = max_pos
        if not 1 <= max_model_len <= max_pos:
            raise ValueError(f"max_model_len={max_model_len} must be in [1, {max_pos}] "
                             "(the checkpoint's max_position_embeddings)")
        _check_unsupported_fields(raw, max_model_len)
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        return cls(
            model=model,
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            intermediate_size=int(raw["intermediate_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            max_position_embeddings=max_pos,
            max_model_len=max_model_len,
            dtype=parse_dtype(dtype, raw.get("dtype") or raw.get("torch_dtype")),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=force_bias or bool(raw.get("attention_bias", False)),
            qk_norm=qk_norm,
            rope_type=rope.get("rope_type", "default"),
            rope_parameters=rope,
        )


def _architecture(raw: dict) -> str:
    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    raise UnsupportedModelError(
        f"architectures={archs} is not supported; pdserve runs {sorted(SUPPORTED_ARCHITECTURES)}"
    )


def _check_quantization(raw: dict) -> None:
    """A checkpoint stored quantized (AWQ, GPTQ, FP8, bitsandbytes, ...) names its scheme in
    ``quantization_config``; pdserve would read its packed tensors as plain weights."""
    quant = raw.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise UnsupportedModelError(
            f"quantization_config (quant_method={method!r}) is not supported: pdserve loads "
            "unquantized safetensors checkpoints and GGUF files (dequantized at load)")


def _rope_parameters(raw: dict) -> dict[str, Any]:
    """Merge transformers 4 (``rope_theta`` + ``rope_scaling``) and 5 (``rope_parameters``)."""
    rope = dict(raw.get("rope_parameters") or {})
    if raw.get("rope_scaling"):
        rope.update(raw["rope_scaling"])
    if "rope_theta" in raw:
        rope.setdefault("rope_theta", raw["rope_theta"])
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        where = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
        raise UnsupportedModelError(
            f"{where}.rope_type={rope_type!r} is not supported; supported: "
            f"{list(SUPPORTED_ROPE_TYPES)}")
    rope["rope_type"] = rope_type
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor != 1.0 is not supported")
    return rope


def _check_unsupported_fields(raw: dict, max_model_len: int) -> None:
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act={act!r} is not supported; supported: ['silu']")
    if raw.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=true is not supported; supported: mlp_bias=false")
    window = raw.get("sliding_window")
    uses_window = raw.get("use_sliding_window", raw.get("model_type") == "mistral")
    layer_types = raw.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        uses_window = uses_window or window is not None
    if uses_window and window is not None and int(window) < max_model_len:
        raise UnsupportedModelError(
            f"sliding_window={window} is shorter than max_model_len={max_model_len}; pdserve "
            "supports full attention only: pass max_model_len <= sliding_window"
        )
