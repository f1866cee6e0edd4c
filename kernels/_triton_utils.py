"""Helpers shared by the Triton kernels: a guarded import, argument checks, launch choices.

Every kernel module imports ``jit`` and ``tl`` from here, so it imports (and its CPU
reference runs) where triton is not installed; only calling a ``*_triton`` wrapper then
fails, with a ``RuntimeError``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # NOTE: the CPU path (the references) never needs triton.
    triton = None
    tl = None

HAS_TRITON = triton is not None
LOG2E = math.log2(math.e)
# NOTE: a global read inside a Triton kernel must be a constexpr
LOG2E_CONST = tl.constexpr(LOG2E) if HAS_TRITON else LOG2E
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def jit(fn: Callable) -> Callable:
    """``triton.jit`` where triton is installed; otherwise ``fn`` unchanged (never launched).

    NOTE: ``triton.jit`` picks the interpreter or the compiler when it decorates, from
    ``TRITON_INTERPRET``; the CPU tests set it before importing the kernel modules.
    """
    return fn if triton is None else triton.jit(fn)


@jit
def soft_cap(scores, cap):
    """``cap * tanh(scores / cap)`` inside a Triton kernel (Gemma 2's logit soft-capping),
    with tanh from ``exp`` (libdevice's is not in triton's interpreter): ``sign(x) *
    (1 - e^-2|x|) / (1 + e^-2|x|)``, which never overflows; absolute error ~1 fp32 ulp of
    ``cap``."""
    x = scores / cap
    t = tl.exp(-2.0 * tl.abs(x))
    magnitude = (1.0 - t) / (1.0 + t)
    return cap * tl.where(x < 0, -magnitude, magnitude)


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether the dispatching entry points send ``tensor``'s op to Triton: CUDA tensors
    when triton is installed (without it, CUDA tensors fall back to the reference)."""
    return tensor.is_cuda and HAS_TRITON


def require_triton(op: str) -> None:
    """Raise ``RuntimeError`` when triton is missing and ``op``'s Triton path was asked for."""
    if triton is None:
        raise RuntimeError(f"{op}: triton is not installed; use the reference on CPU tensors")


def interpreting() -> bool:
    """Whether triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


def dot_options(dtype: torch.dtype) -> dict:
    """Constexpr launch options for ``tl.dot`` on ``dtype`` operands.

    ``UPCAST``: cast dot operands to fp32 first. NOTE: triton 3.9's interpreter multiplies
    bf16 operands as their raw uint16 bits, so under the interpreter they are widened.
    ``PRECISION``: fp32 operands use exact ``"ieee"`` products, not tf32, to match the
    fp32 reference; fp16/bf16 operands take the tensor cores whatever this says.
    """
    return {"UPCAST": interpreting(), "PRECISION": "ieee" if dtype == torch.float32 else "tf32"}


def check_tensor(
    name: str,
    tensor: object,
    ndim: int,
    dtypes: Iterable[torch.dtype],
    device: torch.device | None = None,
) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``tensor`` has ``ndim``, a listed dtype
    and lies on ``device``."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(tensor.shape)}")
    dtypes = tuple(dtypes)
    if tensor.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {tensor.dtype} not in {dtypes}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name}: on {tensor.device}, expected {device}")


def check_shape(name: str, tensor: torch.Tensor, expected: tuple) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``tensor.shape == expected``."""
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)}, got {tuple(tensor.shape)}")


def check_contiguous(name: str, tensor: torch.Tensor) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``tensor`` is contiguous."""
    if not tensor.is_contiguous():
        raise ValueError(f"{name}: must be contiguous, got strides {tensor.stride()}")


def check_inner_contiguous(name: str, tensor: torch.Tensor, num_dims: int) -> None:
    """Raise ``ValueError`` unless the last ``num_dims`` dims of ``tensor`` are packed
    (row-major, no gaps); the leading dims may have any stride."""
    expected = 1
    for size, stride in reversed(list(zip(tensor.shape, tensor.stride()))[-num_dims:]):
        if size > 1 and stride != expected:
            raise ValueError(
                f"{name}: last {num_dims} dims must be contiguous, got strides {tensor.stride()}"
            )
        expected *= size


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors on a CUDA ``device``; 1 elsewhere (the interpreter)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
