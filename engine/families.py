"""The model families pdserve computes, as switches on one decoder (../shared/DESIGN.md,
Models): what each architecture turns on, and how its ``config.json`` says so.

Everything here reads a ``config.json``-shaped dict (transformers 4 and 5 spellings) and
raises ``UnsupportedModelError`` naming the field where a model needs what pdserve does not
compute; ``ModelConfig.from_dict`` (``engine/config.py``) calls it before any weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or a config field is outside what pdserve computes."""


@dataclass(frozen=True, slots=True)
class Family:
    """What an architecture switches on.

    ``qkv_bias``: biases on the q/k/v projections (Qwen2). ``qk_norm``: per-head RMSNorm on
    q and k before RoPE (Qwen3, Gemma 3). ``gemma``: Gemma 2/3's decoder: RMSNorm as ``(1 +
    weight)`` scaled in fp32, norms after attention and around the MLP ("sandwich"), GeGLU
    (``gelu_pytorch_tanh``), embeddings times ``sqrt(hidden_size)``, the attention scale
    ``query_pre_attn_scalar ** -0.5`` and logit soft-capping. ``fused_checkpoint``: the
    checkpoint stores ``qkv_proj`` and ``gate_up_proj`` already fused (Phi-3).
    ``window_all_layers``: a ``sliding_window`` in the config applies to every layer
    (Mistral, Phi-3); elsewhere ``layer_types`` says which layers slide. ``moe``: a
    sparse mixture-of-experts family (``engine/models/moe.py``), how it routes:
    ``"mixtral"`` (top-k weights renormalised, kept in fp32) or ``"qwen"`` (renormalised
    iff ``norm_topk_prob``, rounded to the activation dtype; Qwen2-MoE's shared expert).
    """

    qkv_bias: bool = False
    qk_norm: bool = False
    gemma: bool = False
    fused_checkpoint: bool = False
    window_all_layers: bool = False
    moe: str | None = None


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(),
    "MistralForCausalLM": Family(window_all_layers=True),
    "Qwen2ForCausalLM": Family(qkv_bias=True),
    "Qwen3ForCausalLM": Family(qk_norm=True),
    "Phi3ForCausalLM": Family(fused_checkpoint=True, window_all_layers=True),
    "Gemma2ForCausalLM": Family(gemma=True),
    "Gemma3ForCausalLM": Family(gemma=True, qk_norm=True),
    "MixtralForCausalLM": Family(window_all_layers=True, moe="mixtral"),
    "Qwen2MoeForCausalLM": Family(qkv_bias=True, moe="qwen"),
    "Qwen3MoeForCausalLM": Family(qk_norm=True, window_all_layers=True, moe="qwen"),
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
_ROPE_ALIASES = {"su": "longrope"}  # NOTE: Phi-3's first configs named LongRoPE "su"
_ACTIVATIONS = {False: "silu", True: "gelu_pytorch_tanh"}  # by Family.gemma


def architecture(raw: dict) -> str:
    """The first of ``raw["architectures"]`` that pdserve runs.

    Raises:
        UnsupportedModelError: none of them, naming ``architectures``.
    """
    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in FAMILIES:
            return arch
    raise UnsupportedModelError(
        f"architectures={archs} is not supported; pdserve runs {sorted(FAMILIES)}")


def rope_parameters(raw: dict, layer_type: str | None = None) -> dict[str, Any]:
    """The RoPE parameters (``rope_type``, ``rope_theta``, scaling fields) of the model, or
    of its ``layer_type`` layers where the config keys them by layer type (Gemma 3 in
    transformers 5; in older configs its sliding layers' base is ``rope_local_base_freq``
    and ``rope_scaling`` applies to its full layers only).

    Raises:
        UnsupportedModelError: an unknown rope type, or a partial rotary factor.
    """
    params = dict(raw.get("rope_parameters") or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    elif layer_type is not None and any(isinstance(v, dict) for v in params.values()):
        params = {}
    local = layer_type == "sliding_attention"
    if raw.get("rope_scaling") and not local:
        params.update(raw["rope_scaling"])
    if local and raw.get("rope_local_base_freq") is not None:
        params.setdefault("rope_theta", raw["rope_local_base_freq"])
    if "rope_theta" in raw:
        params.setdefault("rope_theta", raw["rope_theta"])
    rope_type = params.get("rope_type") or params.get("type") or "default"
    rope_type = _ROPE_ALIASES.get(rope_type, rope_type)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        where = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
        raise UnsupportedModelError(
            f"{where}.rope_type={rope_type!r} is not supported; supported: "
            f"{list(SUPPORTED_ROPE_TYPES)}")
    params["rope_type"] = rope_type
    if rope_type == "longrope":
        params.setdefault("original_max_position_embeddings",
                          raw.get("original_max_position_embeddings"))
        for key in ("short_factor", "long_factor", "original_max_position_embeddings"):
            if params.get(key) is None:
                raise UnsupportedModelError(f"rope_scaling.{key} is missing for longrope")
    if float(params.get("partial_rotary_factor") or raw.get("partial_rotary_factor")
             or 1.0) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor != 1.0 is not supported")
    return params


def layer_windows(raw: dict, arch: str, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window in tokens (None: full attention), as transformers reads
    them: ``layer_types`` where the config has it; else Mistral and Phi-3 slide every
    layer when ``sliding_window`` is set, Qwen2 the layers from ``max_window_layers`` on
    when ``use_sliding_window``, Gemma 2 every other layer from the first, Gemma 3 all
    but every ``sliding_window_pattern``-th (6).

    Raises:
        UnsupportedModelError: ``layer_types`` of another length or with another type.
    """
    window = raw.get("sliding_window")
    types = raw.get("layer_types")
    if arch == "Qwen3MoeForCausalLM" and not raw.get("use_sliding_window"):
        window = None  # NOTE: transformers drops the window unless use_sliding_window
    if window is None:
        return (None,) * num_layers
    if types is None:
        types = _default_layer_types(raw, arch, num_layers)
    if len(types) != num_layers:
        raise UnsupportedModelError(f"layer_types has {len(types)} entries for "
                                    f"num_hidden_layers={num_layers}")
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise UnsupportedModelError(f"layer_types={unknown[0]!r} is not supported; supported: "
                                    "['full_attention', 'sliding_attention']")
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def _default_layer_types(raw: dict, arch: str, num_layers: int) -> list[str]:
    full, sliding = "full_attention", "sliding_attention"
    if FAMILIES[arch].window_all_layers:
        return [sliding] * num_layers
    if arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"):
        first = int(raw.get("max_window_layers") or 0)
        return [sliding if raw.get("use_sliding_window") and i >= first else full
                for i in range(num_layers)]
    if arch == "Gemma2ForCausalLM":
        return [sliding if i % 2 == 0 else full for i in range(num_layers)]
    if arch == "Gemma3ForCausalLM":
        pattern = int(raw.get("sliding_window_pattern") or 6)
        return [sliding if (i + 1) % pattern else full for i in range(num_layers)]
    return [full] * num_layers


def check_fields(raw: dict, arch: str) -> None:
    """Refuse what this family's config asks for that pdserve does not compute.

    Raises:
        UnsupportedModelError: naming the field.
    """
    family = FAMILIES[arch]
    act_key = "hidden_activation" if family.gemma else "hidden_act"
    act = raw.get(act_key) or raw.get("hidden_act") or _ACTIVATIONS[family.gemma]
    if act != _ACTIVATIONS[family.gemma]:
        raise UnsupportedModelError(f"{act_key}={act!r} is not supported for {arch}; "
                                    f"supported: [{_ACTIVATIONS[family.gemma]!r}]")
    if raw.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=true is not supported; supported: mlp_bias=false")
    if raw.get("use_bidirectional_attention"):
        raise UnsupportedModelError("use_bidirectional_attention=true is not supported")
    if not family.gemma:
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if raw.get(key):
                raise UnsupportedModelError(f"{key}={raw[key]} is not supported for {arch}")


def gemma_fields(raw: dict, hidden_size: int, head_dim: int) -> dict[str, Any]:
    """Gemma 2/3's ``ModelConfig`` fields: the embedding scale, the attention scale from
    ``query_pre_attn_scalar`` and the two soft-caps (None where off)."""
    return {
        "embed_scale": hidden_size ** 0.5,
        "attn_scale": float(raw.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        "attn_logit_softcapping": raw.get("attn_logit_softcapping") or None,
        "final_logit_softcapping": raw.get("final_logit_softcapping") or None,
    }


def moe_fields(raw: dict, arch: str, num_layers: int) -> dict[str, Any]:
    """A mixture-of-experts family's ``ModelConfig`` fields (empty for a dense family): the
    expert count (``num_local_experts`` / ``num_experts``), ``num_experts_per_tok``, each
    expert's intermediate size (Mixtral: ``intermediate_size``; Qwen:
    ``moe_intermediate_size``), the routing (``norm_topk_prob``), Qwen2-MoE's shared
    expert (``shared_expert_intermediate_size``, 0: none) and which layers are sparse:
    Qwen's layer ``i`` unless it is in ``mlp_only_layers`` or ``(i + 1) %
    decoder_sparse_step``; Mixtral's every layer.

    Raises:
        UnsupportedModelError: a missing or inconsistent expert field, naming it.
    """
    family = FAMILIES[arch]
    if family.moe is None:
        return {}
    experts = raw.get("num_local_experts") or raw.get("num_experts")
    top_k = raw.get("num_experts_per_tok")
    if not experts:
        raise UnsupportedModelError(f"{arch}: the config lacks num_local_experts/num_experts")
    if not top_k or not 1 <= int(top_k) <= int(experts):
        raise UnsupportedModelError(f"num_experts_per_tok={top_k} must be in [1, {experts}]")
    if family.moe == "mixtral":
        inter, shared, norm = int(raw["intermediate_size"]), 0, True
        sparse = (True,) * num_layers
    else:
        inter = raw.get("moe_intermediate_size")
        if not inter:
            raise UnsupportedModelError(f"{arch}: the config lacks moe_intermediate_size")
        inter = int(inter)
        norm = bool(raw.get("norm_topk_prob", False))
        shared = (int(raw.get("shared_expert_intermediate_size") or 0)
                  if arch == "Qwen2MoeForCausalLM" else 0)
        step = int(raw.get("decoder_sparse_step") or 1)
        if step < 1:
            raise UnsupportedModelError(f"decoder_sparse_step={step} must be >= 1")
        dense = set(raw.get("mlp_only_layers") or ())
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    return {"num_experts": int(experts), "num_experts_per_tok": int(top_k),
            "moe_intermediate_size": inter, "norm_topk_prob": norm,
            "router_weights_fp32": family.moe == "mixtral",
            "shared_expert_intermediate_size": shared, "moe_layers": sparse}
