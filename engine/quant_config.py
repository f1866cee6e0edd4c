"""A quantized safetensors checkpoint's ``quantization_config`` (its ``config.json``), read
into what pdserve needs to keep the weights quantized (``engine/quant_checkpoint.py``), or
refused naming the field (``ModelConfig.from_dict`` calls it before any weight is read).

Supported (weight-only int4 / int8, "W4A16" / "W8A16"; vLLM's names of the methods):

- ``awq``: AutoAWQ's GEMM layout (``version`` / ``format`` ``gemm``), 4 bits with zero
  points, any group size (-1: one group per output channel). The LM head is never
  quantized; ``modules_to_not_convert`` names others kept float (by substring, as
  transformers matches them).
- ``gptq``: ``checkpoint_format`` (or ``format``) ``gptq`` (v1: zero points stored minus
  one) or ``gptq_v2``, 4 or 8 bits, symmetric or not, int32 packing. The LM head is
  quantized where ``lm_head`` is true; ``modules_in_block_to_quantize`` narrows the
  quantized linears of each layer. ``desc_act`` is checked on the tensors: a ``g_idx``
  that is not ``k // group_size`` is refused at load.
- ``compressed-tensors``: formats ``pack-quantized``, ``int-quantized`` and
  ``naive-quantized``, integer weights of 4 or 8 bits in groups or per output channel,
  symmetric or with zero points, each config group applied to its ``targets`` (``Linear``,
  a module name or a ``re:`` regex) but the modules in ``ignore``, matched as
  compressed-tensors matches them (``compressed_tensors.utils.match``).

Everything else (another method, GEMV / Marlin / exllama layouts, 2-, 3-bit weights,
activation or KV cache quantization, fp8, act-order groups, sparsity, transforms,
per-module overrides) is refused with ``UnsupportedModelError``, naming the field and
what is supported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pdserve.engine.families import UnsupportedModelError

# vLLM's --quantization names of the checkpoint methods pdserve reads
CHECKPOINT_METHODS = ("awq", "gptq", "compressed-tensors")
CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
GPTQ_FORMATS = ("gptq", "gptq_v2")
# the linear layers a checkpoint may store (Phi-3 stores the fused ones)
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "qkv_proj", "gate_up_proj", "lm_head")


@dataclass(frozen=True)
class WeightFormat:
    """How one linear's quantized weight is stored.

    Attributes:
        layout: ``"awq"`` (GEMM), ``"gptq"`` (v1 zero points), ``"gptq_v2"``,
            ``"pack-quantized"`` or ``"int-quantized"`` (compressed-tensors' int-quantized
            and naive-quantized: the same int8 tensor).
        bits: 4 or 8.
        group_size: input features per group, or -1 for one group per output channel.
        symmetric: compressed-tensors only: no zero point is stored.
        desc_act: GPTQ only: the groups may follow the activation order (``g_idx`` says).
    """

    layout: str
    bits: int
    group_size: int
    symmetric: bool = True
    desc_act: bool = False


@dataclass(frozen=True)
class CheckpointQuantization:
    """A checkpoint's supported ``quantization_config``.

    Attributes:
        method: ``quant_method`` (one of ``CHECKPOINT_METHODS``).
        groups: ``(targets, format)`` pairs, the first whose targets match a linear
            gives its format; empty targets match every linear.
        ignore: linears kept float whatever the targets (``Linear``, module names or
            ``re:`` regexes, matched with ``re.match``).
    """

    method: str
    groups: tuple[tuple[tuple[str, ...], WeightFormat], ...]
    ignore: tuple[str, ...] = ()

    def format_of(self, module: str) -> WeightFormat | None:
        """The format the linear ``module`` (its dotted name, as stored) is stored in;
        None for a float one."""
        if any(_matches(module, target) for target in self.ignore):
            return None
        for targets, fmt in self.groups:
            if not targets or any(_matches(module, target) for target in targets):
                return fmt
        return None


def _matches(module: str, target: str) -> bool:
    """compressed-tensors' ``is_match`` for a module: a ``re:`` regex (``re.match``), the
    class name ``Linear`` (the model's linears: ``LINEAR_NAMES``), or the exact module
    name."""
    if target.startswith("re:"):
        return re.match(target.removeprefix("re:"), module) is not None
    if target == "Linear":
        return module.rpartition(".")[2] in LINEAR_NAMES
    return target == module


def _refuse(field: str, value: Any, supported: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"quantization_config.{field}={value!r} is not supported: "
                                 f"pdserve reads {supported}")


def parse_quantization_config(quant: Any) -> CheckpointQuantization | None:
    """``quantization_config`` (a dict, as in ``config.json``) -> its description; None
    for an unquantized checkpoint (no or an empty ``quantization_config``).

    Raises:
        UnsupportedModelError: a method, layout, bit width or option pdserve does not
            read (module docstring), naming the field and what is supported.
    """
    if not quant:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if isinstance(quant, dict) and quant.get("kv_cache_scheme"):
        raise _refuse("kv_cache_scheme", quant["kv_cache_scheme"], "weight quantization "
                      "only (a quantized KV cache is --kv-cache-dtype)")
    if method == "awq":
        return _awq(quant)
    if method == "gptq":
        return _gptq(quant)
    if method == "compressed-tensors":
        return _compressed_tensors(quant)
    raise _refuse("quant_method", method, "unquantized checkpoints and quant_method "
                  f"{', '.join(CHECKPOINT_METHODS)} (weight-only int4/int8)")


def _group_size(quant: dict, *keys: str) -> int:
    for key in keys:
        if quant.get(key) is not None:
            size = int(quant[key])
            if size != -1 and size <= 0:
                raise _refuse(key, size, "a positive group size or -1 (per channel)")
            return size
    raise UnsupportedModelError(f"quantization_config lacks {keys[0]!r}")


def _awq(quant: dict) -> CheckpointQuantization:
    """AutoAWQ's config (``bits`` / ``w_bit``, ``group_size`` / ``q_group_size``,
    ``zero_point``, ``version``; transformers' ``AwqConfig``)."""
    bits = quant.get("bits", quant.get("w_bit", 4))
    if bits != 4:
        raise _refuse("bits", bits, "4-bit AWQ")
    layout = str(quant.get("version") or quant.get("format") or "gemm").lower()
    if layout != "gemm" or quant.get("backend") == "llm-awq":
        raise _refuse("version", quant.get("version") or quant.get("format") or
                      quant.get("backend"), "AWQ's GEMM layout (version 'gemm')")
    if not quant.get("zero_point", True):
        raise _refuse("zero_point", quant["zero_point"], "AWQ with zero points")
    group = _group_size(quant, "group_size", "q_group_size")
    keep = quant.get("modules_to_not_convert") or []
    ignore = ("lm_head", *(f"re:.*{re.escape(name)}" for name in keep))
    return CheckpointQuantization("awq", (((), WeightFormat("awq", 4, group)),), ignore)


def _gptq(quant: dict) -> CheckpointQuantization:
    """GPTQ's config as AutoGPTQ, GPTQModel and transformers' ``GPTQConfig`` write it."""
    bits = quant.get("bits")
    if bits not in (4, 8):
        raise _refuse("bits", bits, "4- or 8-bit GPTQ")
    layout = str(quant.get("checkpoint_format") or quant.get("format") or "gptq").lower()
    if layout not in GPTQ_FORMATS or quant.get("is_marlin_format"):
        raise _refuse("checkpoint_format", "marlin" if quant.get("is_marlin_format")
                      else layout, f"GPTQ checkpoint formats {', '.join(GPTQ_FORMATS)}")
    if str(quant.get("pack_dtype") or "int32") != "int32":
        raise _refuse("pack_dtype", quant["pack_dtype"], "GPTQ packed in int32")
    if quant.get("dynamic"):
        raise _refuse("dynamic", quant["dynamic"], "GPTQ with one format for every layer")
    fmt = WeightFormat(layout, bits, _group_size(quant, "group_size"),
                       bool(quant.get("sym", True)), bool(quant.get("desc_act")))
    per_layer = [name for block in quant.get("modules_in_block_to_quantize") or []
                 for name in block]
    targets = tuple(f"re:.*\\.{re.escape(name)}$" for name in per_layer)
    if quant.get("lm_head") and targets:
        targets = (*targets, "lm_head")
    ignore = () if quant.get("lm_head") else ("lm_head",)
    return CheckpointQuantization("gptq", ((targets, fmt),), ignore)


def _compressed_tensors(quant: dict) -> CheckpointQuantization:
    """compressed-tensors' ``QuantizationConfig`` (as llm-compressor saves it)."""
    for field in ("sparsity_config", "transform_config", "moe_sparsity_config"):
        if quant.get(field):
            raise _refuse(field, quant[field], "compressed-tensors weight quantization "
                          "without sparsity, transforms or KV cache quantization")
    status = quant.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse("quantization_status", status, "compressed checkpoints")
    top_format = quant.get("format")
    groups = []
    for name, scheme in (quant.get("config_groups") or {}).items():
        if not isinstance(scheme, dict):
            raise _refuse(f"config_groups.{name}", scheme, "config groups written out in "
                          "full (targets, weights)")
        groups.append((tuple(scheme.get("targets") or ()),
                       _ct_scheme(f"config_groups.{name}", scheme, top_format)))
    if not groups:
        raise UnsupportedModelError("quantization_config.config_groups is empty: no "
                                    "quantized weights to read")
    return CheckpointQuantization("compressed-tensors", tuple(groups),
                                  tuple(quant.get("ignore") or ()))


def _ct_scheme(where: str, scheme: dict, top_format: str | None) -> WeightFormat:
    layout = scheme.get("format") or top_format
    if layout not in CT_FORMATS:
        raise _refuse(f"{where}.format" if scheme.get("format") else "format", layout,
                      f"compressed-tensors formats {', '.join(CT_FORMATS)}")
    for field in ("input_activations", "output_activations"):
        if scheme.get(field):
            raise _refuse(f"{where}.{field}", scheme[field], "weight-only quantization "
                          "(W4A16, W8A16): activations stay in the model's dtype")
    weights = scheme.get("weights")
    if not weights:
        raise _refuse(f"{where}.weights", weights, "quantized weights")
    # compressed-tensors' QuantizationArgs defaults, for the fields a config leaves out
    defaults = {"type": "int", "num_bits": 8, "dynamic": False,
                "strategy": "group" if weights.get("group_size") else "tensor"}
    weights = {**defaults, **{k: v for k, v in weights.items() if v is not None}}
    checks = (("type", ("int",), "integer weights (no fp8 / fp4)"),
              ("num_bits", (4, 8), "4- or 8-bit weights"),
              ("strategy", ("group", "channel"), "group or channel strategies"),
              ("dynamic", (False, None), "static weight scales"),
              ("actorder", (None, False, "weight", "static"),
               "weights without act-order groups (actorder null or 'weight')"))
    for field, allowed, supported in checks:
        value = weights.get(field)
        if value not in allowed:
            raise _refuse(f"{where}.weights.{field}", value, supported)
    group = _group_size(weights, "group_size") if weights["strategy"] == "group" else -1
    return WeightFormat("int-quantized" if layout == "naive-quantized" else layout,
                        weights["num_bits"], group, bool(weights.get("symmetric", True)))
