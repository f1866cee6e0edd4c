"""Quantized linear layers in the model: ``QuantizedLinear`` (the apply step of vLLM's
``LinearMethod``: the weight stays quantized, dequantized inside the kernel), the
``--quantization`` schemes, and the pass that quantizes a loaded model's linears.

Where quantized weights come from (``engine/models/loader.py``): a GGUF file's quantized
tensors as they are stored (``engine/gguf_quant.py``), a quantized safetensors checkpoint's
(AWQ, GPTQ, compressed-tensors: ``engine/quant_checkpoint.py``), or ``--quantization int8|int4``
applied at load to a checkpoint's float weights (round to nearest in groups of 32: int8
symmetric, int4 with mins; ``kernels.quant_linear.quantize_rtn``). The model code above the linear never learns
which: a ``QuantizedLinear`` takes and returns what an ``nn.Linear`` does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pdserve.engine.quant_config import CHECKPOINT_METHODS
from pdserve.kernels import cpu_ext
from pdserve.kernels.quant_linear import (
    QuantWeight,
    cat_rows,
    dequantize,
    linear_quant_cpu,
    linear_quant_ref,
    pack_for_cpu,
    quantize_rtn,
)

# --quantization -> (bits, group size, symmetric), round to nearest at load, fp16 scales:
# int8 as GGUF's Q8_0, int4 as its Q4_1. On SmolLM2-135M-Instruct (benchmarks/README.md,
# Quantization) int8 per output channel gave 1.0046x bf16's perplexity against 1.0016x in
# groups of 32, and a symmetric int4 in groups of 32 1.37-1.57x against 1.09x with mins.
RTN_SCHEMES = {"int8": (8, 32, True), "int4": (4, 32, False)}
# names vLLM uses that pdserve takes: "gguf" keeps a GGUF file's quantized tensors (as it
# does anyway); the RTN schemes quantize float weights at load; a checkpoint's method
# (awq, gptq, compressed-tensors) keeps its stored integers (as it does anyway)
QUANTIZATION_CHOICES = ("gguf", *RTN_SCHEMES, *CHECKPOINT_METHODS)
# the linears an RTN scheme quantizes (the embedding and the norms stay as they are)
QUANTIZED_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")


def check_quantization(quantization: str | None, stored: str | None) -> str | None:
    """The quantization the engine runs: ``--quantization`` (``quantization``) checked
    against how the model is stored (``stored``: ``ModelSource.quant_method``, ``gguf``, a
    checkpoint's ``quant_method`` or None), else the stored one.

    Raises:
        ValueError: an unknown scheme; ``gguf`` for a model that is no GGUF file; a
            checkpoint method other than the checkpoint's, or for a float checkpoint; an
            RTN scheme for a checkpoint stored quantized (naming ``--quantization``).
    """
    if quantization is None:
        return stored
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"--quantization {quantization!r} is not supported; supported: "
                         f"{list(QUANTIZATION_CHOICES)}")
    if quantization == "gguf" and stored != "gguf":
        raise ValueError("--quantization gguf needs a .gguf model file")
    if quantization in RTN_SCHEMES and stored in CHECKPOINT_METHODS:
        raise ValueError(f"--quantization {quantization!r} quantizes a float checkpoint at "
                         f"load, and this checkpoint is stored quantized (quant_method "
                         f"{stored!r}): leave --quantization out, or give {stored!r}")
    if quantization in CHECKPOINT_METHODS and quantization != stored:
        found = (f"quant_method {stored!r}" if stored in CHECKPOINT_METHODS else
                 "a GGUF file" if stored == "gguf" else "no quantization_config")
        raise ValueError(f"--quantization {quantization!r} needs a checkpoint quantized with "
                         f"{quantization}; the model has {found}")
    return quantization


class QuantizedLinear(nn.Module):
    """``y = x W^T (+ b)`` with ``W`` a ``QuantWeight`` (W8A16 / W4A16), on ``device``.

    ``x: [..., in_features]`` in the model's dtype -> ``[..., out_features]`` in it, fp32
    sums: ``kernels.quant_linear.linear_quant_ref``'s values up to summation order. On the
    CPU the weight is packed once, here, for the C++ kernel; elsewhere the reference runs
    (the Triton kernel on CUDA: ``kernels/quant_linear_triton.py``).
    """

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None,
                 device: torch.device) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.bits, self.group_size = weight.bits, weight.group_size
        self.bias = None if bias is None else bias.detach().to(device)
        # NOTE: on the CPU only the kernel's packed copy is kept
        self._cpu = pack_for_cpu(weight) if device.type == "cpu" and cpu_ext.load() else None
        self.weight = weight.to(device) if self._cpu is None else None
        # bytes of the weight as this layer holds it (the packed copy's scales may be
        # two-level codes, and a symmetric int4 one keeps no mins: ``pack_for_cpu``)
        self.nbytes = self.weight.nbytes if self._cpu is None else sum(
            t.numel() * t.element_size() for t in self._cpu if t is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._cpu is not None:
            return linear_quant_cpu(x, self._cpu, self.bits, self.group_size, self.out_features,
                                    self.bias)
        if x.is_cuda:
            from pdserve.kernels.quant_linear_triton import linear_quant_triton

            return linear_quant_triton(x, self.weight, self.bias)
        return linear_quant_ref(x, self.weight, self.bias)

    def rows_kernel(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """This layer's kernel bound to its weight: ``f(x [T, in_features]) ->
        [T, out_features]``, ``forward``'s values without the module call
        (``engine/models/cpu_decode.py``); ``forward`` itself off the CPU kernel."""
        if self._cpu is None:
            return self.forward
        op, packed, bias = torch.ops.pdserve_cpu.linear_quant.default, self._cpu, self.bias
        bits, group, n = self.bits, self.group_size, self.out_features
        return lambda x: op(x, *packed, bias, bits, group, n)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bits={self.bits}, group_size={self.group_size}")


def quantize_linears(model: nn.Module, scheme: str, device: torch.device) -> int:
    """Replace the model's ``QUANTIZED_LINEARS`` (still ``nn.Linear``) by
    ``QuantizedLinear``s of their weights quantized with ``scheme`` (``RTN_SCHEMES``);
    a tied LM head gets a quantized copy and the embedding keeps its float table. Returns
    the number of layers replaced."""
    bits, group, symmetric = RTN_SCHEMES[scheme]
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name in QUANTIZED_LINEARS and type(child) is nn.Linear:
                weight = quantize_rtn(child.weight.detach(), bits, group, torch.float16,
                                      symmetric)
                setattr(parent, name, QuantizedLinear(weight, child.bias, device))
                replaced += 1
    return replaced


class QuantizedEmbedding(nn.Module):
    """The token embedding kept quantized, as a GGUF file stores it (llama.cpp and vLLM
    keep it so too): ``forward(input_ids [T] int64) -> [T, embedding_dim]`` in ``dtype``,
    each row dequantized when looked up, by ``kernels.quant_linear.dequantize``'s formula
    (fp32 ``q * scale + min``, then cast): the rows the dequantized table held, bit for
    bit, in a quarter to a half of its memory.

    Raises (``forward``):
        IndexError: an id outside ``[0, num_embeddings)``.
    """

    def __init__(self, weight: QuantWeight, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight_q = weight.to(device)
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features
        self.dtype = dtype
        self.nbytes = self.weight_q.nbytes

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return dequantize(self.weight_q, self.dtype, rows=input_ids)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
                f"bits={self.weight_q.bits}, group_size={self.weight_q.group_size}")


class ConcatLinear(nn.Module):
    """A fused projection whose shards are stored in different formats (a GGUF file may
    keep q and k in Q4_K and v in Q6_K, or one shard unquantized): each shard's linear in
    turn, their outputs side by side. ``x: [..., K]`` -> ``[..., sum of shard outputs]``."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(part.out_features for part in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    def rows_kernel(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """``forward``'s values on ``x [T, in_features]`` from the parts' bound kernels
        (``QuantizedLinear.rows_kernel``; a float part's ``forward``), without the module
        calls (``engine/models/cpu_decode.py``)."""
        kernels = [part.rows_kernel() if hasattr(part, "rows_kernel") else part.forward
                   for part in self.parts]
        cat = torch.cat
        return lambda x: cat([kernel(x) for kernel in kernels], dim=-1)


def _shard_linear(rows: list[QuantWeight | torch.Tensor], bias: torch.Tensor | None,
                  device: torch.device) -> nn.Module:
    """One run of shards of the same kind as one linear: quantized ones of one format
    stacked, float ones concatenated into an ``nn.Linear``."""
    if isinstance(rows[0], QuantWeight):
        return QuantizedLinear(cat_rows(rows), bias, device)
    weight = torch.cat(rows)
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=device,
                       dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    return linear


def _format(part) -> tuple:
    return (part.bits, part.group_size, part.min is None) \
        if isinstance(part, QuantWeight) else ("float", part.dtype)


def install_quantized(model: nn.Module,
                      shards: dict[str, list[tuple[int, QuantWeight | torch.Tensor]]],
                      device: torch.device) -> None:
    """Replace each linear named by ``shards`` (``"<module path>.weight"`` -> its shards as
    (first output row, quantized weight or float tensor)) by one ``QuantizedLinear`` of
    the shards stacked in row order, or a ``ConcatLinear`` where their formats differ,
    keeping the linear's bias.

    Raises:
        ValueError: shards that do not tile the linear's rows exactly, or of another
            input width.
    """
    for target, parts in shards.items():
        path = target.removesuffix(".weight")
        linear = model.get_submodule(path)
        parts.sort(key=lambda part: part[0])
        rows = 0
        for start, weight in parts:
            width = weight.in_features if isinstance(weight, QuantWeight) else weight.shape[1]
            if start != rows or width != linear.in_features:
                raise ValueError(f"{target}: shards do not tile its "
                                 f"[{linear.out_features}, {linear.in_features}] weight")
            rows += weight.out_features if isinstance(weight, QuantWeight) else weight.shape[0]
        if rows != linear.out_features:
            raise ValueError(f"{target}: shards hold {rows} of its {linear.out_features} rows")
        runs: list[tuple[int, list]] = []  # (first row, consecutive shards of one format)
        for start, weight in parts:
            if runs and _format(runs[-1][1][-1]) == _format(weight):
                runs[-1][1].append(weight)
            else:
                runs.append((start, [weight]))
        bias = linear.bias.detach() if linear.bias is not None else None
        bounds = [start for start, _ in runs] + [rows]
        modules = [_shard_linear(run, None if bias is None else bias[a:b], device)
                   for (_, run), a, b in zip(runs, bounds, bounds[1:])]
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, name, modules[0] if len(modules) == 1 else ConcatLinear(modules))


def drop_quantized_weights(model: nn.Module, targets: set[str]) -> None:
    """Before the model is materialised: remove the weights of the linears ``targets``
    (``"<module path>.weight"``) that quantized weights will replace, and of the
    embedding a ``QuantizedEmbedding`` will, so no float copy of them is ever allocated
    (an untied copy for a tied LM head)."""
    for target in targets:
        linear = model.get_submodule(target.removesuffix(".weight"))
        del linear.weight
        linear.register_parameter("weight", None)
