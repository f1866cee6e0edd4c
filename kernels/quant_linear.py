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

GGUF's K-quants scale in two levels: an fp16 per super-block of 256 weights times a 6- or
8-bit integer per group. A weight from one may carry that factoring (``ScaleCodes``) beside
its fp32 scales and mins; the CPU kernel then keeps the int8 codes and one fp32 per
super-block instead of an fp32 per group (Q4_K: 4.75 bits a weight instead of 6; Q6_K:
8.63 instead of 10), and computes the same products. Nor does it keep the mins of a
symmetric int4 weight (``min == -8 * scale``, GGUF Q4_0's): it computes them (4.5 bits a
weight with fp16 scales, not 5).

``linear_quant`` dispatches: CPU tensors to the C++ kernel (``kernels/csrc/
cpu_gemm_quant.cpp``, on a layout packed once at load by ``pack_for_cpu``), CUDA tensors to
the Triton kernel (``kernels/quant_linear_triton.py``), others to ``linear_quant_ref``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QMAX = {8: 127, 4: 7}  # symmetric round-to-nearest: q in [-QMAX - 1, QMAX]


@dataclass(frozen=True)
class ScaleCodes:
    """Two-level scales (or mins) ``values [N, G]`` as ``codes * super``, exactly: ``codes``
    int8 ``[N, G]`` (a group's integer), ``super`` fp32 ``[N, K // super_group]`` (its
    super-block's factor, ``super_group`` weights along K, a multiple of the group size).
    GGUF's K-quants: ``values[n, g] == codes[n, g] * super[n, g * group_size //
    super_group]`` in fp32 (an fp16 times an integer of at most 8 bits is exact there)."""

    codes: torch.Tensor
    super: torch.Tensor
    super_group: int

    def expand(self, group_size: int) -> torch.Tensor:
        """The values ``[N, G]`` fp32."""
        ratio = self.super_group // group_size
        return self.codes.float() * self.super.repeat_interleave(ratio, dim=1)

    def rows(self, reorder) -> ScaleCodes:
        """``reorder`` (a function of a ``[rows, ...]`` tensor) applied to both parts."""
        return ScaleCodes(reorder(self.codes), reorder(self.super), self.super_group)


@dataclass
class QuantWeight:
    """A quantized ``[out_features, in_features]`` weight (module docstring); ``scale_codes``
    and ``min_codes``: ``scale``'s and ``min``'s two-level factoring where the source has
    one (``ScaleCodes``; the CPU kernel keeps that, every other path ``scale`` and
    ``min``)."""

    q: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None
    bits: int
    group_size: int
    in_features: int
    scale_codes: ScaleCodes | None = None
    min_codes: ScaleCodes | None = None

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
        for name, codes, of in (("scale_codes", self.scale_codes, self.scale),
                                ("min_codes", self.min_codes, self.min)):
            if codes is None:
                continue
            sg = codes.super_group
            if of is None or sg % g or k % sg or codes.codes.dtype != torch.int8 \
                    or tuple(codes.codes.shape) != (n, k // g) \
                    or codes.super.dtype != torch.float32 \
                    or tuple(codes.super.shape) != (n, k // sg):
                raise ValueError(f"{name}: expected int8 codes {(n, k // g)} and fp32 super "
                                 f"{(n, k // sg)} of super_group {sg} (a multiple of "
                                 f"group_size {g} dividing {k}) beside its values")
        if self.min_codes is not None and self.scale_codes is None or \
                self.scale_codes is not None and (self.min is None) != (self.min_codes is None):
            raise ValueError("scale_codes go with min_codes where the weight has mins, and "
                             "min_codes with scale_codes (the kernel takes codes for both "
                             "or for neither)")

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    def to(self, device: torch.device | str) -> QuantWeight:
        """On ``device``, with the fp32/fp16 scales and mins only (the codes serve the CPU
        kernel's packing)."""
        return QuantWeight(self.q.to(device), self.scale.to(device),
                           None if self.min is None else self.min.to(device), self.bits,
                           self.group_size, self.in_features)

    @property
    def nbytes(self) -> int:
        """Bytes of the quantized weight with its scales and mins (as codes and
        super-block factors where it has them)."""
        tensors = [self.q]
        for values, codes in ((self.scale, self.scale_codes), (self.min, self.min_codes)):
            tensors += [] if values is None else [values] if codes is None else [
                codes.codes, codes.super]
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

    def codes(field: str) -> ScaleCodes | None:  # kept where every part has them alike
        found = [getattr(p, field) for p in parts]
        if any(c is None or c.super_group != found[0].super_group for c in found):
            return None
        return ScaleCodes(torch.cat([c.codes for c in found]),
                          torch.cat([c.super for c in found]), found[0].super_group)

    scale_codes = codes("scale_codes")
    min_codes = codes("min_codes") if scale_codes is not None else None
    if first.min is not None and min_codes is None:
        scale_codes = None  # NOTE: the kernel takes codes for both or for neither
    return QuantWeight(torch.cat([p.q for p in parts]),
                       torch.cat([p.scale.to(dtype) for p in parts]),
                       None if first.min is None else torch.cat([p.min.to(dtype) for p in parts]),
                       first.bits, first.group_size, first.in_features, scale_codes, min_codes)


def unpack_int4(q: torch.Tensor) -> torch.Tensor:
    """``[N, K // 2]`` uint8 -> ``[N, K]`` uint8 values in [0, 15] (low nibble first)."""
    return torch.stack([q & 0xF, q >> 4], dim=-1).flatten(-2)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` integers in [0, 15] -> ``[N, K // 2]`` uint8, even columns in the low
    nibbles."""
    v = values.to(torch.uint8)
    return v[:, 0::2] | (v[:, 1::2] << 4)


def dequantize(w: QuantWeight, dtype: torch.dtype = torch.float32,
               rows: torch.Tensor | None = None) -> torch.Tensor:
    """``[N, K]`` in ``dtype``: ``q * scale + min`` per group, computed in fp32; with
    ``rows`` (int64 ``[R]``, an embedding's lookup) only those rows, ``[R, K]``.

    Raises:
        IndexError: a row outside ``[0, N)``.
    """
    q, scale, minimum = w.q, w.scale, w.min
    if rows is not None:
        q, scale = q.index_select(0, rows), scale.index_select(0, rows)
        minimum = None if minimum is None else minimum.index_select(0, rows)
    n = q.shape[0]
    values = (q if w.bits == 8 else unpack_int4(q)).float()  # [n, K]
    groups = values.view(n, w.in_features // w.group_size, w.group_size)  # [n, G, g]
    out = groups * scale.float()[:, :, None]
    if minimum is not None:
        out = out + minimum.float()[:, :, None]
    return out.view(n, w.in_features).to(dtype)


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


def pack_for_cpu(w: QuantWeight) -> tuple[torch.Tensor, ...]:
    """``w`` in the C++ kernel's layout (``kernels/csrc/cpu_gemm_quant.cpp``): ``(packed,
    scales, mins, scale_super, min_super)``: panels of 32 output features ``[P, K * bits /
    8, 32]`` uint8 and their groups' scales and mins ``[P, groups, 32]``, fp32/fp16, or
    int8 codes with their super-blocks' fp32 factors ``[P, K // super_group, 32]``
    (``ScaleCodes``); None for what ``w`` has not. A symmetric int4 weight (``min == -8 *
    scale`` exactly, GGUF Q4_0's) is packed without its mins, which the kernel computes.

    Raises:
        RuntimeError: the C++ CPU kernels are not built here.
    """
    from pdserve.kernels import cpu_ext

    if not cpu_ext.load():
        raise RuntimeError("pack_for_cpu: needs the C++ CPU kernels (pdserve.kernels.cpu_ext)")
    ops = torch.ops.pdserve_cpu
    scale, minimum, supers = w.scale, w.min, (None, None)
    if w.scale_codes is not None:
        scale = w.scale_codes.codes
        minimum = None if w.min_codes is None else w.min_codes.codes
        supers = (ops.pack_quant_groups(w.scale_codes.super),
                  None if w.min_codes is None else ops.pack_quant_groups(w.min_codes.super))
    elif w.bits == 4 and w.min is not None and torch.equal(w.min.float(), -8 * w.scale.float()):
        minimum = None
    packed, scales, mins = ops.pack_quant_weight(w.q, scale, minimum, w.bits, w.group_size)
    return packed, scales, (mins if mins is not None and mins.numel() else None), *supers


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


def set_cpu_slice_rows(rows: int) -> int:
    """The least row count of ``x`` whose ``linear_quant_cpu`` calls on the fp32 FMA path
    dequantize each 128-k slice of a 32-feature panel once, into fp32 in L1, and run the
    packed linear's 12 x 32 register tiles over it (``kernels/csrc/cpu_gemm_quant.cpp``;
    AVX-512 builds), instead of dequantizing each k again for each 8 rows. ``rows`` < 1
    restores the default (9); tests and ``benchmarks/cpu_quant_linear.py`` move it to
    compare the two on one CPU. Process-wide. Returns the count it replaces.

    Raises:
        RuntimeError: the C++ CPU kernels are not built here.
    """
    from pdserve.kernels import cpu_ext

    if not cpu_ext.load():
        raise RuntimeError("set_cpu_slice_rows: needs the C++ CPU kernels (pdserve.kernels.cpu_ext)")
    return int(torch.ops.pdserve_cpu.set_linear_quant_slice_rows(rows))


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
