"""Weight-only quantized linear layers (W8A16, W4A16): the weight format, round-to-nearest
quantization, the dequantize-then-matmul reference, and the dispatch to the kernels.

A ``QuantWeight`` holds ``W [N, K]`` as integers ``q`` in groups of ``group_size`` along K
(``group_size == K``: one group per output channel), each group with a scale and, for
unsigned formats, a min: ``W[n, k] = q[n, k] * scale[n, g] + min[n, g]``, ``g = k //
group_size``. Two formats cover GGUF's, AWQ's, GPTQ's and round-to-nearest quantization
without loss:

- ``bits=8``: ``q`` int8 ``[N, K]``; ``min`` None (symmetric: GGUF Q8_0, Q6_K; RTN int8
  per channel) or given (GGUF Q5_K, its 5-bit values and per-group min);
- ``bits=4``: ``q`` uint8 ``[N, K // 2]``, two values per byte, column ``k`` in byte
  ``k // 2``'s low nibble when ``k`` is even, its high nibble when odd; ``min`` always given
  (GGUF Q4_1, Q4_K, AWQ and GPTQ zero points; a symmetric int4 stores ``q + 8`` with ``min
  = -8 * scale``, as GGUF Q4_0).

``scale`` and ``min`` are ``[N, K // group_size]``, fp32 or fp16. Activations and outputs
stay in the model's dtype (bf16, fp16 or fp32); products are summed in fp32.

``linear_quant`` dispatches: CPU tensors to the C++ kernel (``kernels/csrc/
cpu_gemm_quant.cpp``, on a layout packed once at load by ``pack_for_cpu``), CUDA tensors to
the Triton kernel (``kernels/quant_linear_triton.py``), others to ``linear_quant_ref``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QMAX = {8: 127, 4: 7}  # symmetric round-to-nearest: q in [-QMAX - 1, QMAX]


@dataclass
class QuantWeight:
    """A quantized ``[out_features, in_features]`` weight (module docstring)."""

    q: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None
    bits: int
    group_size: int
    in_features: int

    def __post_init__(self) -> None:
        n, k, g = self.out_features, self.in_features, self.group_size
        if self.bits not in (8, 4):
            raise ValueError(f"bits={self.bits} must be 8 or 4")
        if g <= 0 or k % g or g % 2:
            raise ValueError(f"group_size={g} must be even and divide in_features={k}")
        expected = (n, k if self.bits == 8 else k // 2)
        want = torch.int8 if self.bits == 8 else torch.uint8
        if tuple(self.q.shape) != expected or self.q.dtype != want:
            raise ValueError(f"q: expected {want} {expected}, got {self.q.dtype} "
                             f"{tuple(self.q.shape)}")
        for name, t in (("scale", self.scale), ("min", self.min)):
            if t is not None and tuple(t.shape) != (n, k // g):
                raise ValueError(f"{name}: expected shape {(n, k // g)}, got {tuple(t.shape)}")
        if self.bits == 4 and self.min is None:
            raise ValueError("a 4-bit weight needs its min (unsigned values)")

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    def to(self, device: torch.device | str) -> QuantWeight:
        return QuantWeight(self.q.to(device), self.scale.to(device),
                           None if self.min is None else self.min.to(device), self.bits,
                           self.group_size, self.in_features)

    @property
    def nbytes(self) -> int:
        """Bytes of the quantized weight with its scales and mins."""
        tensors = [self.q, self.scale] + ([] if self.min is None else [self.min])
        return sum(t.numel() * t.element_size() for t in tensors)


def cat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """Stack quantized weights of one format along the output features (a fused q/k/v or
    gate/up projection from its shards); scales and mins in fp32 where the parts' dtypes
    differ.

    Raises:
        ValueError: the parts differ in bits, group size, in_features or having mins.
    """
    first = parts[0]
    for p in parts[1:]:
        if (p.bits, p.group_size, p.in_features, p.min is None) != (
                first.bits, first.group_size, first.in_features, first.min is None):
            raise ValueError("shards of one fused projection must share their quantization "
                             f"format: {p.bits}-bit g{p.group_size} vs {first.bits}-bit "
                             f"g{first.group_size}")
    # NOTE: fp16 scales widen to fp32 without loss where the parts' dtypes differ
    dtype = first.scale.dtype if all(p.scale.dtype == first.scale.dtype for p in parts) \
        else torch.float32
    return QuantWeight(torch.cat([p.q for p in parts]),
                       torch.cat([p.scale.to(dtype) for p in parts]),
                       None if first.min is None else torch.cat([p.min.to(dtype) for p in parts]),
                       first.bits, first.group_size, first.in_features)


def unpack_int4(q: torch.Tensor) -> torch.Tensor:
    """``[N, K // 2]`` uint8 -> ``[N, K]`` uint8 values in [0, 15] (low nibble first)."""
    return torch.stack([q & 0xF, q >> 4], dim=-1).flatten(-2)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` integers in [0, 15] -> ``[N, K // 2]`` uint8, even columns in the low
    nibbles."""
    v = values.to(torch.uint8)
    return v[:, 0::2] | (v[:, 1::2] << 4)


def dequantize(w: QuantWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[N, K]`` in ``dtype``: ``q * scale + min`` per group, computed in fp32."""
    q = (w.q if w.bits == 8 else unpack_int4(w.q)).float()  # [N, K]
    groups = q.view(w.out_features, -1, w.group_size)  # [N, G, g]
    out = groups * w.scale.float()[:, :, None]
    if w.min is not None:
        out = out + w.min.float()[:, :, None]
    return out.view(w.out_features, w.in_features).to(dtype)


def quantize_rtn(weight: torch.Tensor, bits: int, group_size: int | None = None,
                 scale_dtype: torch.dtype = torch.float32,
                 symmetric: bool = True) -> QuantWeight:
    """Round-to-nearest quantization of ``weight [N, K]`` per group (``group_size``,
    default the whole row: per output channel).

    Symmetric (vLLM's and llama.cpp Q8_0's RTN): ``scale = absmax / QMAX[bits]``, ``q =
    round(w / scale)``; an all-zero group gets scale 0; 4-bit values are stored unsigned
    (``q + 8``, ``min = -8 * scale``). Asymmetric (GGUF Q4_1's; ``symmetric=False``, 4-bit
    only): ``scale = (max - min) / 15``, ``q = round((w - min) / scale)``, the group's min
    kept: every level of the grid falls within the group's range.

    Raises:
        ValueError: ``bits`` not 8 or 4, an asymmetric 8-bit one, or a group size that
            does not divide K.
    """
    n, k = weight.shape
    g = group_size or k
    if bits not in QMAX:
        raise ValueError(f"bits={bits} must be 8 or 4")
    if k % g or g % 2:
        raise ValueError(f"group_size={g} must be even and divide in_features={k}")
    if not symmetric and bits != 4:
        raise ValueError("asymmetric round-to-nearest is 4-bit only")
    w = weight.float().view(n, k // g, g)
    if not symmetric:
        low = w.amin(dim=-1)
        scale = (w.amax(dim=-1) - low) / 15  # [N, G]
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round((w - low[:, :, None]) / safe[:, :, None]).clamp(0, 15).view(n, k)
        return QuantWeight(pack_int4(q.to(torch.uint8)), scale.to(scale_dtype),
                           low.to(scale_dtype), 4, g, k)
    scale = w.abs().amax(dim=-1) / QMAX[bits]  # [N, G]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / safe[:, :, None]).clamp(-QMAX[bits] - 1, QMAX[bits]).view(n, k)
    scale = scale.to(scale_dtype)
    if bits == 8:
        return QuantWeight(q.to(torch.int8), scale, None, 8, g, k)
    return QuantWeight(pack_int4((q + 8).to(torch.uint8)), scale, (-8 * scale.float()).to(
        scale_dtype), 4, g, k)


def linear_quant_ref(x: torch.Tensor, w: QuantWeight,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ dequantize(w).T (+ bias)`` in fp32, returned in ``x``'s dtype: the
    reference every quantized kernel equals within fp32 summation order."""
    y = x.float() @ dequantize(w).to(x.device).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def pack_for_cpu(w: QuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``w`` in the C++ kernel's layout (``kernels/csrc/cpu_gemm_quant.cpp``): panels of
    32 output features ``[P, K * bits / 8, 32]`` uint8 and their groups' scales and mins
    ``[P, groups, 32]`` (mins None when ``w`` has none).

    Raises:
        RuntimeError: the C++ CPU kernels are not built here.
    """
    from pdserve.kernels import cpu_ext

    if not cpu_ext.load():
        raise RuntimeError("pack_for_cpu: needs the C++ CPU kernels (pdserve.kernels.cpu_ext)")
    packed, scales, mins = torch.ops.pdserve_cpu.pack_quant_weight(
        w.q, w.scale, w.min, w.bits, w.group_size)
    return packed, scales, (mins if mins is not None and mins.numel() else None)


def set_cpu_bf16_path(mode: int) -> bool:
    """Which CPU calls ``linear_quant_cpu`` serves by vdpbf16ps on the raw integers
    (``kernels/csrc/cpu_gemm_quant_bf16.cpp``: bf16 ``x`` of at least 5 rows, or of 1-4
    rows times an int4 weight, a build with AVX512-BF16) instead of its fp32 FMA tiles:
    ``-1`` where the CPU is AMD's (the default; measured there), ``0`` none, ``1`` all it
    can (tests and ``benchmarks/cpu_quant_linear.py`` compare both paths on one CPU).
    Process-wide. Returns whether this build has the path (without AVX512-BF16 every call
    takes the FMA tiles, whatever ``mode`` says).

    Raises:
        RuntimeError: the C++ CPU kernels are not built here, or ``mode`` is not -1, 0 or 1.
    """
    from pdserve.kernels import cpu_ext

    if not cpu_ext.load():
        raise RuntimeError("set_cpu_bf16_path: needs the C++ CPU kernels (pdserve.kernels.cpu_ext)")
    return bool(torch.ops.pdserve_cpu.set_linear_quant_bf16(mode))


def linear_quant_cpu(x: torch.Tensor, packed: tuple, bits: int, group_size: int,
                     out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``linear_quant_ref`` by the C++ kernel on ``packed = pack_for_cpu(w)`` (``bits``,
    ``group_size``, ``out_features``: ``w``'s): ``x [..., K]`` bf16, fp16 or fp32 ->
    ``[..., N]`` in ``x``'s dtype, fp32 sums.

    Raises:
        RuntimeError: a shape or dtype the kernel does not take (it names it).
    """
    if x.dim() == 2:  # NOTE: a model's [T, hidden]: no reshape and view, ~2 us a call less
        return torch.ops.pdserve_cpu.linear_quant(x, *packed, bias, bits, group_size,
                                                  out_features)
    rows = x.reshape(-1, x.shape[-1])
    y = torch.ops.pdserve_cpu.linear_quant(rows, *packed, bias, bits, group_size, out_features)
    return y.view(*x.shape[:-1], out_features)
