"""Quantized safetensors checkpoints for the tests, written in each library's on-disk
layout from its spec (AutoAWQ's ``awq/utils/packing_utils.py``, AutoGPTQ's / GPTQModel's
``pack``, compressed-tensors' ``pack_to_int32``), independently of pdserve's reader.

``write_quantized`` turns a tiny float checkpoint into a quantized one (round to nearest
per group, with zero points where the format has them) and a float twin holding exactly
the dequantized weights, the oracle transformers runs.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble j of a word holds column AWQ_ORDER[j]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class Quantized:
    """A linear's integers: ``W = (q - zero) * scale`` per group of ``group`` along K.

    q: ``[N, K]`` int64 in ``[0, 2 ** bits)``; zero: ``[N, G]`` int64; scale ``[N, G]``.
    """

    q: torch.Tensor
    zero: torch.Tensor
    scale: torch.Tensor
    bits: int
    group: int
    layout: str = ""
    symmetric: bool = False

    def dequantize(self) -> torch.Tensor:
        """``[N, K]`` fp32, computed exactly (fp16/bf16 scales times small integers)."""
        diff = (self.q - self.zero.repeat_interleave(self.group, dim=1)).double()
        return (diff * self.scale.double().repeat_interleave(self.group, dim=1)).float()


def quantize(weight: torch.Tensor, bits: int, group: int, symmetric: bool,
             scale_dtype: torch.dtype = torch.float16) -> Quantized:
    """Round to nearest per group (``group`` -1: per output channel); symmetric puts the
    zero at ``2 ** (bits - 1)``."""
    n, k = weight.shape
    g = k if group == -1 else group
    x = weight.float().view(n, k // g, g)
    top = 2 ** bits - 1
    if symmetric:
        scale = (x.abs().amax(-1) / (2 ** (bits - 1) - 1)).to(scale_dtype)
        zero = torch.full((n, k // g), 2 ** (bits - 1), dtype=torch.int64)
    else:
        low, high = x.amin(-1).clamp(max=0), x.amax(-1).clamp(min=0)
        scale = ((high - low) / top).to(scale_dtype)
        zero = torch.round(-low / scale.float()).clamp(0, top).long()
    q = torch.round(x / scale.float()[..., None]) + zero[..., None]
    return Quantized(q.clamp(0, top).long().view(n, k), zero, scale, bits, g)


def pack_words(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned ``values`` packed ``32 // bits`` to an int32 word along ``dim``, value
    ``j`` of a word in bits ``[j * bits, (j + 1) * bits)``."""
    per = 32 // bits
    v = values.long() if dim == 1 else values.long().T
    v = v.reshape(v.shape[0], -1, per)
    word = sum(v[:, :, j] << (bits * j) for j in range(per))
    word = torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)
    return word if dim == 1 else word.T.contiguous()


def awq_tensors(qz: Quantized) -> dict[str, torch.Tensor]:
    """AutoAWQ's GEMM layout: transposed, 8 columns a word in AWQ's order."""
    def pack(t):  # [R, N] -> [R, N / 8]
        return pack_words(t.view(t.shape[0], -1, 8)[:, :, AWQ_ORDER].reshape(t.shape[0], -1), 4,
                          dim=1)
    return {"qweight": pack(qz.q.T), "qzeros": pack(qz.zero.T),
            "scales": qz.scale.T.contiguous().half()}


def gptq_tensors(qz: Quantized, v2: bool) -> dict[str, torch.Tensor]:
    """GPTQ's layout: qweight packed along K, qzeros along N (v1: zero - 1)."""
    k = qz.q.shape[1]
    zero = qz.zero if v2 else (qz.zero - 1) & (2 ** qz.bits - 1)
    return {"qweight": pack_words(qz.q.T, qz.bits, dim=0),
            "qzeros": pack_words(zero.T, qz.bits, dim=1),
            "scales": qz.scale.T.contiguous(),
            "g_idx": (torch.arange(k) // qz.group).to(torch.int32)}


def ct_pack_to_int32(signed: torch.Tensor, bits: int, packed_dim: int) -> torch.Tensor:
    """compressed-tensors' own ``pack_to_int32`` (a dev dependency: the oracle)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    return pack_to_int32(signed.to(torch.int8), bits, packed_dim=packed_dim)


def ct_tensors(qz: Quantized, layout: str, symmetric: bool) -> dict[str, torch.Tensor]:
    """compressed-tensors' pack-quantized or int-quantized tensors (values signed)."""
    offset = 2 ** (qz.bits - 1)
    signed, zero = qz.q - offset, qz.zero - offset
    if layout == "pack-quantized":
        out = {"weight_packed": ct_pack_to_int32(signed, qz.bits, 1),
               "weight_shape": torch.tensor(list(qz.q.shape))}
        if not symmetric:
            out["weight_zero_point"] = ct_pack_to_int32(zero, qz.bits, 0)
    else:
        out = {"weight": signed.to(torch.int8)}
        if not symmetric:
            out["weight_zero_point"] = zero.to(torch.int8)
    out["weight_scale"] = qz.scale
    return out


def write_quantized(float_path: Path, out: Path, layout: str, bits: int, group: int,
                    symmetric: bool, quantization_config: dict, quantize_head: bool = False,
                    keep_float=lambda module: False, scale_dtype: torch.dtype = torch.float16,
                    overrides=lambda module: {}) -> tuple[Path, Path, dict[str, Quantized]]:
    """The float checkpoint at ``float_path`` quantized into ``out`` in ``layout`` (its
    decoder linears but those ``keep_float(module)`` names, the LM head where
    ``quantize_head``: a tied one as its own tensor; ``overrides(module)`` may change a
    module's ``layout``, ``bits``, ``group``, ``symmetric``), and its dequantized twin
    ``out-float``. Returns (quantized folder, float twin, module -> its integers)."""
    weights = load_file(float_path / "model.safetensors")
    if quantize_head and "lm_head.weight" not in weights:  # tied: the head stored apart
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    twin_path = out.with_name(out.name + "-float")
    for path in (out, twin_path):
        shutil.copytree(float_path, path)
    stored, twin, integers = {}, dict(weights), {}
    for name, tensor in weights.items():
        module = name.removesuffix(".weight")
        is_linear = name.endswith(".weight") and (module.rpartition(".")[2] in LINEARS or
                                                  (module == "lm_head" and quantize_head))
        if not is_linear or keep_float(module):
            stored[name] = tensor
            continue
        spec = {"layout": layout, "bits": bits, "group": group, "symmetric": symmetric,
                **overrides(module)}
        qz = quantize(tensor, spec["bits"], spec["group"], spec["symmetric"], scale_dtype)
        qz.layout, qz.symmetric = spec["layout"], spec["symmetric"]
        integers[module] = qz
        twin[name] = qz.dequantize()
        parts = (awq_tensors(qz) if qz.layout == "awq" else
                 gptq_tensors(qz, qz.layout == "gptq_v2") if qz.layout.startswith("gptq") else
                 ct_tensors(qz, qz.layout, qz.symmetric))
        stored.update({f"{module}.{part}": t.contiguous() for part, t in parts.items()})
    save_file(stored, out / "model.safetensors")
    save_file(twin, twin_path / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config))
    if "lm_head" in integers:  # the twin's head is its own dequantized copy
        twin_config = json.loads((twin_path / "config.json").read_text())
        twin_config["tie_word_embeddings"] = False
        (twin_path / "config.json").write_text(json.dumps(twin_config))
    return out, twin_path, integers
