"""A quantized safetensors checkpoint's linears as pdserve's ``QuantWeight``s
(``kernels/quant_linear.py``), repacked once at load without loss, never through a float
copy of the weight.

Each layout stores, for a linear ``W [N, K]`` (out, in features) in ``G = K // group``
groups along K, unsigned integers ``q``, a zero point ``z`` and a scale ``s`` per group,
``W[n, k] = (q[n, k] - z[n, g]) * s[n, g]``, ``g = k // group``:

| layout | tensors of a linear (shapes as stored) |
| --- | --- |
| ``awq`` (AutoAWQ GEMM) | ``qweight`` int32 ``[K, N / 8]``, ``qzeros`` int32 ``[G, N / 8]``, both 8 nibbles a word in AWQ's order: nibble ``j`` holds column ``8 c + AWQ_ORDER[j]``; ``scales`` ``[G, N]`` |
| ``gptq`` / ``gptq_v2`` | ``qweight`` int32 ``[K / p, N]`` (``p = 32 / bits`` values a word along K, value ``j`` in bits ``j * bits``), ``qzeros`` int32 ``[G, N / p]`` (along N), ``scales`` ``[G, N]``, ``g_idx`` ``[K]``; v1 stores ``z - 1`` |
| ``pack-quantized`` | ``weight_packed`` int32 ``[N, K / p]`` (along K), ``weight_scale`` ``[N, G]``, ``weight_shape`` ``[2]``, ``weight_zero_point`` int32 ``[N / p, G]`` (along N) when asymmetric; values stored plus ``2 ** (bits - 1)`` |
| ``int-quantized`` | ``weight`` int8 ``[N, K]`` (signed), ``weight_scale`` ``[N, G]``, ``weight_zero_point`` ``[N, G]`` (signed) when asymmetric |

All become ``q * scale + min`` with ``min = -z * s`` (``kernels/quant_linear.py``: 4-bit
values unsigned, two a byte; 8-bit ones signed, ``q - 128`` with ``min = (128 - z) * s``,
no min where every one is 0). The scales and mins are computed in fp32: exact for fp16 or
bf16 scales (a zero point of at most 9 bits times an 11-bit mantissa), kept fp16 where
both round-trip through it, else fp32. A group the kernels do not take (a per-channel
row of more than 1024 with mins, a group of 48) runs as smaller groups that divide it,
16 or multiples of 32, its scale and min repeated.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pdserve.engine.families import UnsupportedModelError
from pdserve.engine.quant_config import CheckpointQuantization, WeightFormat
from pdserve.kernels.quant_linear import QuantWeight, pack_int4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of an AWQ word holds column AWQ_ORDER[j]
MAX_GROUP_WITH_MIN = 1024  # the C++ kernel's limit (kernels/csrc/cpu_gemm_quant.cpp)
# layout -> (the tensor that marks a linear stored quantized, the tensors it must have,
# those it may have)
TENSORS = {
    "awq": ("qweight", ("qweight", "qzeros", "scales"), ()),
    "gptq": ("qweight", ("qweight", "qzeros", "scales"), ("g_idx",)),
    "gptq_v2": ("qweight", ("qweight", "qzeros", "scales"), ("g_idx",)),
    "pack-quantized": ("weight_packed", ("weight_packed", "weight_scale", "weight_shape"),
                       ("weight_zero_point", "weight_g_idx")),
    "int-quantized": ("weight_scale", ("weight", "weight_scale"),
                      ("weight_zero_point", "weight_g_idx")),
}


def quantized_linears(names: Iterable[str], quant: CheckpointQuantization
                      ) -> dict[str, tuple[WeightFormat, dict[str, str]]]:
    """Which of a checkpoint's tensors (``names``) are linears stored quantized: module
    -> (its format, {last name: stored name} of its ``TENSORS``). A linear
    ``quantization_config`` quantizes but that is stored float (its ``weight`` a float
    tensor) stays float.

    Raises:
        UnsupportedModelError: a module stored quantized that ``quantization_config``
            leaves float (``ignore``, ``targets``, ``modules_to_not_convert``), naming it.
    """
    parts: dict[str, dict[str, str]] = {}
    for name in names:
        module, _, last = name.rpartition(".")
        parts.setdefault(module, {})[last] = name
    markers = {marker for marker, _, _ in TENSORS.values()}
    linears = {}
    for module, stored in parts.items():
        fmt = quant.format_of(module)
        if fmt is not None and TENSORS[fmt.layout][0] in stored:
            _, required, optional = TENSORS[fmt.layout]
            linears[module] = (fmt, {k: v for k, v in stored.items()
                                     if k in required or k in optional})
        elif fmt is None and markers & stored.keys():
            raise UnsupportedModelError(
                f"{module} is stored quantized ({min(markers & stored.keys())}) but "
                f"quantization_config (quant_method {quant.method!r}) leaves it float")
    return linears


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words of ``32 // bits`` unsigned values each (value ``j`` of a word in bits
    ``[j * bits, (j + 1) * bits)``, consecutive words' values consecutive along ``dim``)
    -> int32 values, ``dim`` ``32 // bits`` times longer. ``[R, C]`` -> ``[R, C * p]``
    (dim 1) or ``[R * p, C]`` (dim 0)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)  # [p]
    mask = (1 << bits) - 1  # NOTE: masks the sign bits an arithmetic shift brings in
    words = packed.to(torch.int32)
    if dim == 1:
        return ((words[:, :, None] >> shifts) & mask).reshape(words.shape[0], -1)
    return ((words[:, None, :] >> shifts[None, :, None]) & mask).reshape(-1, words.shape[1])


def _expect(module: str, name: str, tensor: torch.Tensor, shape: tuple[int, ...],
            dtypes: tuple[torch.dtype, ...]) -> None:
    if tuple(tensor.shape) != shape or tensor.dtype not in dtypes:
        raise ValueError(f"{module}.{name}: expected {'/'.join(map(str, dtypes))} {list(shape)}, "
                         f"the checkpoint has {tensor.dtype} {list(tensor.shape)}")


_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INT32 = (torch.int32,)


def _groups(module: str, fmt: WeightFormat, in_features: int) -> tuple[int, int]:
    """(group size, number of groups) of a linear of ``in_features``."""
    group = in_features if fmt.group_size == -1 else fmt.group_size
    if in_features % group:
        raise UnsupportedModelError(f"{module}: quantization_config.group_size={group} does not "
                                    f"divide its {in_features} input features")
    return group, in_features // group


def _kernel_group(module: str, group: int, has_min: bool) -> int:
    """The group size the kernels run, a divisor of ``group`` (each stored group becomes
    ``group // size`` groups of the same scale and min): the largest multiple of 32 that
    divides it, at most ``MAX_GROUP_WITH_MIN`` with mins, else 16.

    Raises:
        UnsupportedModelError: no such divisor (a group of 8, 24, ...), naming the group.
    """
    limit = min(group, MAX_GROUP_WITH_MIN if has_min else group)
    for size in [*range(limit // 32 * 32, 0, -32), 16]:
        if group % size == 0:
            return size
    raise UnsupportedModelError(
        f"{module}: quantization_config.group_size={group} is not supported: pdserve's "
        f"kernels take groups of 16 or multiples of 32 (up to {MAX_GROUP_WITH_MIN} with zero "
        "points), and a group that one of those divides")


def _narrow(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """fp32 tensors as fp16 where every one of them round-trips through it, else fp32."""
    if all(torch.equal(t.half().float(), t) for t in tensors):
        return [t.half() for t in tensors]
    return list(tensors)


def from_unsigned(module: str, q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor,
                  bits: int, group: int) -> QuantWeight:
    """``W = (q - zero) * scale`` as a ``QuantWeight`` (module docstring).

    Args:
        q: ``[N, K]`` integers in ``[0, 2 ** bits)``.
        zero: ``[N, G]`` integers (``G = K // group``).
        scale: ``[N, G]`` fp16, bf16 or fp32.
    Raises:
        UnsupportedModelError: a group size the kernels do not take.
    """
    k = q.shape[1]
    s = scale.float()
    if bits == 4:
        values, minimum = pack_int4(q), -zero.float() * s
    else:
        values, minimum = (q - 128).to(torch.int8), (128 - zero).float() * s
    keep_min = bits == 4 or bool(minimum.any())
    kernel_group = _kernel_group(module, group, keep_min)
    if kernel_group != group:
        s = s.repeat_interleave(group // kernel_group, dim=1)
        minimum = minimum.repeat_interleave(group // kernel_group, dim=1)
    if keep_min:
        s, minimum = _narrow(s, minimum)
        return QuantWeight(values, s, minimum, bits, kernel_group, k)
    return QuantWeight(values, _narrow(s)[0], None, bits, kernel_group, k)


def _awq(module: str, fmt: WeightFormat, t: dict[str, torch.Tensor]) -> QuantWeight:
    k, n = t["qweight"].shape[0], t["scales"].shape[-1]
    group, groups = _groups(module, fmt, k)
    _expect(module, "qweight", t["qweight"], (k, n // 8), _INT32)
    _expect(module, "qzeros", t["qzeros"], (groups, n // 8), _INT32)
    _expect(module, "scales", t["scales"], (groups, n), _SCALE_DTYPES)
    column = torch.argsort(torch.tensor(AWQ_ORDER))  # column i sits in nibble column[i]

    def in_order(packed):  # [R, N / 8] words -> [R, N] values, columns in order
        values = unpack_int32(packed, 4, dim=1).view(packed.shape[0], -1, 8)
        return values[:, :, column].reshape(packed.shape[0], n)

    return from_unsigned(module, in_order(t["qweight"]).T, in_order(t["qzeros"]).T,
                         t["scales"].T, 4, group)


def _gptq(module: str, fmt: WeightFormat, t: dict[str, torch.Tensor]) -> QuantWeight:
    per_word = 32 // fmt.bits
    k, n = t["qweight"].shape[0] * per_word, t["qweight"].shape[1]
    group, groups = _groups(module, fmt, k)
    _expect(module, "qzeros", t["qzeros"], (groups, n // per_word), _INT32)
    _expect(module, "scales", t["scales"], (groups, n), _SCALE_DTYPES)
    _expect(module, "qweight", t["qweight"], (k // per_word, n), _INT32)
    g_idx = t.get("g_idx")
    if g_idx is None and fmt.desc_act:
        raise UnsupportedModelError(f"{module}: desc_act=true without a g_idx tensor: the "
                                    "order of its groups is not known")
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // group):
        raise UnsupportedModelError(
            f"{module}.g_idx is not k // group_size (act-order groups, desc_act=true): pdserve "
            "reads GPTQ checkpoints whose groups are runs of group_size input features")
    zero = unpack_int32(t["qzeros"], fmt.bits, dim=1)  # [G, N]
    if fmt.layout == "gptq":  # NOTE: v1 stores zero - 1 (AutoGPTQ's convention)
        zero = zero + 1
    q = unpack_int32(t["qweight"], fmt.bits, dim=0)  # [K, N]
    return from_unsigned(module, q.T, zero.T, t["scales"].T, fmt.bits, group)


def _check_g_idx(module: str, t: dict[str, torch.Tensor], k: int, group: int) -> None:
    g_idx = t.get("weight_g_idx")
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // group):
        raise UnsupportedModelError(f"{module}.weight_g_idx: act-order groups are not "
                                    "supported (actorder 'group'); pdserve reads groups that "
                                    "are runs of group_size input features")


def _pack_quantized(module: str, fmt: WeightFormat, t: dict[str, torch.Tensor]) -> QuantWeight:
    n, k = (int(v) for v in t["weight_shape"].tolist())
    per_word, offset = 32 // fmt.bits, 1 << (fmt.bits - 1)
    group, groups = _groups(module, fmt, k)
    _expect(module, "weight_packed", t["weight_packed"], (n, -(-k // per_word)), _INT32)
    _expect(module, "weight_scale", t["weight_scale"], (n, groups), _SCALE_DTYPES)
    _check_g_idx(module, t, k, group)
    q = unpack_int32(t["weight_packed"], fmt.bits, dim=1)[:, :k]  # [N, K] stored + offset
    if fmt.symmetric:
        zero = torch.full((n, groups), offset, dtype=torch.int32)
    else:
        packed_zero = _required(module, t, "weight_zero_point")
        _expect(module, "weight_zero_point", packed_zero, (-(-n // per_word), groups), _INT32)
        zero = unpack_int32(packed_zero, fmt.bits, dim=0)[:n]  # [N, G] stored + offset
    return from_unsigned(module, q, zero, t["weight_scale"], fmt.bits, group)


def _int_quantized(module: str, fmt: WeightFormat, t: dict[str, torch.Tensor]) -> QuantWeight:
    weight = t["weight"]
    n, k = weight.shape
    offset = 1 << (fmt.bits - 1)
    group, groups = _groups(module, fmt, k)
    _expect(module, "weight", weight, (n, k), (torch.int8,))
    _expect(module, "weight_scale", t["weight_scale"], (n, groups), _SCALE_DTYPES)
    _check_g_idx(module, t, k, group)
    zero = (torch.zeros((n, groups), dtype=torch.int32) if fmt.symmetric
            else _required(module, t, "weight_zero_point"))
    _expect(module, "weight_zero_point", zero, (n, groups), (torch.int8, torch.int32))
    return from_unsigned(module, weight.to(torch.int32) + offset, zero.to(torch.int32) + offset,
                         t["weight_scale"], fmt.bits, group)


def _required(module: str, t: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in t:
        raise ValueError(f"checkpoint lacks {module}.{name}")
    return t[name]


_REPACK = {"awq": _awq, "gptq": _gptq, "gptq_v2": _gptq, "pack-quantized": _pack_quantized,
           "int-quantized": _int_quantized}


def quant_weight(module: str, fmt: WeightFormat, tensors: dict[str, torch.Tensor]
                 ) -> QuantWeight:
    """The linear ``module``'s stored tensors (``TENSORS[fmt.layout]``, keyed by their
    last name, as stored: never cast) as one ``QuantWeight [N, K]`` (module docstring).

    Raises:
        ValueError: a tensor missing or of another shape or dtype than ``fmt`` says
            (naming it).
        UnsupportedModelError: act-order groups (a ``g_idx`` that is not ``k //
            group_size``), or a group size the kernels do not take.
    """
    for name in TENSORS[fmt.layout][1]:
        _required(module, tensors, name)
    scale = tensors.get("weight_scale")
    if scale is not None and scale.dim() == 1:  # per channel, stored as [N]
        tensors = {**tensors, "weight_scale": scale[:, None]}
    return _REPACK[fmt.layout](module, fmt, tensors)
