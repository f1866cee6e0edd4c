"""Block gather / scatter for KV transfer.

``gather_blocks`` packs blocks of the whole-worker KV cache into one buffer;
``scatter_blocks`` unpacks such a buffer into given block ids. CUDA tensors use Triton;
CPU tensors the C++ kernels of ``csrc/cpu_block_copy.cpp`` (one ``memcpy`` per block row)
when they are built (``cpu_ext.load()``), the references otherwise.

Layouts: the cache and the packed buffer are 6-D ``[num_layers, 2, N, block_size,
num_kv_heads, head_dim]`` tensors (the first two dims may be any sizes, e.g. ``[1, 1]`` for
one plane) of evenly spaced planes, ``stride(0) == size(1) * stride(1)`` (so plane
``layer * 2 + kv`` lies at ``plane * stride(1)``), and packed ``[block_size, num_kv_heads,
head_dim]`` rows; the block stride ``stride(2)`` is free. Layer-major contiguous tensors
fit, and so do block-major ones: ``buf.permute(1, 2, 0, 3, 4, 5)`` of a contiguous ``[N,
num_layers, 2, ...]`` ``buf``, the worker's cache (``engine/model_runner.py``). Size-1 dims
may have any stride.
"""

from __future__ import annotations

import torch

from pdserve.kernels import cpu_ext
from pdserve.kernels._triton_utils import (
    FLOAT_DTYPES,
    cdiv,
    check_shape,
    check_tensor,
    jit,
    require_triton,
    tl,
    use_triton,
)

# NOTE: elements per program. One block of one layer's K (or V) is
# block_size * num_kv_heads * head_dim elements (16 * 8 * 128 = 16384), so a program copies
# 8 KiB of fp16 at a time and a block row takes a few programs.
_CHUNK = 4096


_LAYOUT = ("[num_layers, 2, N, block_size, num_kv_heads, head_dim] with packed "
           "[block_size, num_kv_heads, head_dim] rows and stride(0) == size(1) * stride(1)")


def _plane_strides(tensor: torch.Tensor) -> tuple[int, int] | None:
    """``(plane stride, block stride)`` in elements of a 6-D tensor of the module's
    layout (see the module docstring); None for a tensor of any other layout."""
    if tensor.dim() != 6:
        return None
    expected = 1
    for size, stride in zip(reversed(tensor.shape[3:]), reversed(tensor.stride()[3:])):
        if size > 1 and stride != expected:
            return None
        expected *= size
    num_layers, two = tensor.shape[:2]
    if two <= 1:
        return tensor.stride(0), tensor.stride(2)
    if num_layers > 1 and tensor.stride(0) != two * tensor.stride(1):
        return None
    return tensor.stride(1), tensor.stride(2)


def _check_layout(name: str, tensor: torch.Tensor) -> tuple[int, int]:
    """``_plane_strides(tensor)``; raise ValueError naming ``name`` where it is None."""
    strides = _plane_strides(tensor)
    if strides is None:
        raise ValueError(f"{name}: expected {_LAYOUT}, got shape {tuple(tensor.shape)}, "
                         f"strides {tensor.stride()}")
    return strides


def _as_rows(tensor: torch.Tensor) -> torch.Tensor | None:
    """A tensor of the module's layout as a ``[planes, N, words]`` view (planes
    ``num_layers * 2``, any plane and block strides); None for another layout.

    On the CPU the words are int64 where the strides and the block's bytes allow it (exact
    bit copies; ``index_copy_`` moves 8 bytes per element: the scatter of 24 planes x 64
    random bf16 blocks, 12 MiB, measured 2.8 ms against 3.1 ms with bf16 elements, the
    gather no change at 1.9 ms; both are bound by random 4 KiB row accesses, about 2-3x a
    contiguous memcpy of the same bytes), else the tensor's own dtype."""
    strides = _plane_strides(tensor)
    if strides is None or tensor.numel() == 0:
        return None
    num_layers, two, num_rows, *block_shape = tensor.shape
    row = block_shape[0] * block_shape[1] * block_shape[2]
    flat = tensor.as_strided((num_layers * two, num_rows, row), (*strides, 1))
    size = flat.element_size()
    if (not tensor.is_cuda and size < 8 and (row * size) % 8 == 0 and flat.data_ptr() % 8 == 0
            and all(stride * size % 8 == 0 for stride in strides)):
        return flat.view(torch.int64)
    return flat


def _check_out(out: torch.Tensor | None, kv_cache: torch.Tensor, n: int) -> None:
    """Raise ValueError unless ``out`` is None or a ``[num_layers, 2, n, block...]``
    tensor of the cache's dtype on its device, of the module's layout."""
    if out is None:
        return
    expected = (*kv_cache.shape[:2], n, *kv_cache.shape[3:])
    if (not isinstance(out, torch.Tensor) or tuple(out.shape) != expected
            or out.dtype != kv_cache.dtype or out.device != kv_cache.device):
        raise ValueError(f"out: expected a {expected} {kv_cache.dtype} tensor on "
                         f"{kv_cache.device}, got {out!r:.200}")
    _check_layout("out", out)


def gather_blocks_ref(kv_cache: torch.Tensor, block_ids: torch.Tensor,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack blocks into a buffer (``out``, or a new contiguous one).

    Args:
        kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``, of
            the module's layout (layer- or block-major; other strides take a slower path).
        block_ids: ``[n]`` int64 block ids (any order, may be empty).
        out: ``[num_layers, 2, n, block_size, num_kv_heads, head_dim]`` of the module's
            layout (e.g. contiguous, or block-major), the cache's dtype and device;
            written and returned (None: a new contiguous tensor).

    Returns:
        ``[num_layers, 2, n, block_size, num_kv_heads, head_dim]``, same dtype/device.

    Raises:
        ValueError: ``out`` has the wrong shape, dtype, device or layout.
    """
    num_layers, two, _, *block_shape = kv_cache.shape
    ids = block_ids.to(kv_cache.device, torch.long)
    _check_out(out, kv_cache, ids.shape[0])
    rows = _as_rows(kv_cache)
    if rows is None:
        packed = kv_cache.index_select(2, ids)
    else:
        packed = rows.index_select(1, ids).view(kv_cache.dtype).view(
            num_layers, two, ids.shape[0], *block_shape)
    return packed if out is None else out.copy_(packed)


def scatter_blocks_ref(kv_cache: torch.Tensor, block_ids: torch.Tensor, src: torch.Tensor) -> None:
    """Unpack ``src`` into ``kv_cache`` at ``block_ids`` in place.

    Args:
        kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``, of
            the module's layout (other strides take a slower path); written in place.
        block_ids: ``[n]`` int64 distinct block ids.
        src: ``[num_layers, 2, n, block_size, num_kv_heads, head_dim]``, any strides,
            cast to the cache's dtype.
    """
    ids = block_ids.to(kv_cache.device, torch.long)
    src = src.to(kv_cache.dtype)
    if ids.numel() == 0:
        return
    rows = _as_rows(kv_cache)
    if rows is None:
        kv_cache.index_copy_(2, ids, src)
        return
    src_rows = _as_rows(src)
    if src_rows is None:
        src_rows = _as_rows(src.contiguous())
    if src_rows.dtype != rows.dtype:  # NOTE: one side's strides do not allow int64 words
        rows, src_rows = rows.view(kv_cache.dtype), src_rows.view(kv_cache.dtype)
    rows.index_copy_(1, ids, src_rows)


@jit
def _copy_blocks_kernel(
    src_ptr, dst_ptr, block_ids_ptr,
    src_plane_stride, src_block_stride,  # elements between planes / blocks of src
    dst_plane_stride, dst_block_stride,  # and of dst
    ROW: tl.constexpr,  # elements per block: block_size * num_kv_heads * head_dim
    CHUNK: tl.constexpr,
    GATHER: tl.constexpr,  # True: src block block_ids[i] -> dst block i; False: the reverse
):
    """One program copies ``CHUNK`` elements of block ``i`` of one (layer, K/V) plane."""
    plane = tl.program_id(0).to(tl.int64)  # layer * 2 + (0 for K, 1 for V)
    i = tl.program_id(1)
    chunk = tl.program_id(2)
    block_id = tl.load(block_ids_ptr + i).to(tl.int64)
    if GATHER:
        src_block, dst_block = block_id, i.to(tl.int64)
    else:
        src_block, dst_block = i.to(tl.int64), block_id
    offsets = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offsets < ROW
    src = src_ptr + plane * src_plane_stride + src_block * src_block_stride + offsets
    dst = dst_ptr + plane * dst_plane_stride + dst_block * dst_block_stride + offsets
    values = tl.load(src, mask=mask)
    tl.store(dst, values.to(dst_ptr.dtype.element_ty), mask=mask)


def _check_cache_and_ids(op: str, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    require_triton(op)
    check_tensor("kv_cache", kv_cache, 6, FLOAT_DTYPES)
    _check_layout("kv_cache", kv_cache)
    _check_ids(block_ids)


def _check_ids(block_ids: torch.Tensor) -> None:
    """Raise ValueError unless ``block_ids`` is a 1-D integer tensor."""
    if not isinstance(block_ids, torch.Tensor) or block_ids.dim() != 1:
        raise ValueError(f"block_ids: expected a 1-D tensor, got {block_ids!r}")
    if block_ids.dtype.is_floating_point or block_ids.dtype.is_complex:
        raise ValueError(f"block_ids: expected an integer dtype, got {block_ids.dtype}")


def _launch(src, dst, block_ids, gather: bool) -> None:
    num_layers, two, _, *block_shape = src.shape
    row = block_shape[0] * block_shape[1] * block_shape[2]
    chunk = min(_CHUNK, 1 << (row - 1).bit_length())
    grid = (num_layers * two, block_ids.shape[0], cdiv(row, chunk))
    _copy_blocks_kernel[grid](
        src, dst, block_ids, *_plane_strides(src), *_plane_strides(dst),
        ROW=row, CHUNK=chunk, GATHER=gather,
    )


def gather_blocks_triton(kv_cache: torch.Tensor, block_ids: torch.Tensor,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """``gather_blocks_ref`` as one Triton copy kernel; same contract (``out`` included).

    ``block_ids`` may be on another device (it is moved, as in the reference); ids are not
    range-checked.

    Raises:
        ValueError: naming ``kv_cache`` (not 6-D, not of the module's layout, not
            fp16/bf16/fp32), ``block_ids`` (not a 1-D integer tensor) or ``out``.
        RuntimeError: triton is not installed.
    """
    _check_cache_and_ids("gather_blocks_triton", kv_cache, block_ids)
    num_layers, two, _, *block_shape = kv_cache.shape
    n = block_ids.shape[0]
    _check_out(out, kv_cache, n)
    if out is None:
        out = kv_cache.new_empty((num_layers, two, n, *block_shape))
    if n == 0 or out.numel() == 0:
        return out
    block_ids = block_ids.to(kv_cache.device, torch.int64)
    _launch(kv_cache, out, block_ids, gather=True)
    return out


def scatter_blocks_triton(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, src: torch.Tensor
) -> None:
    """``scatter_blocks_ref`` as one Triton copy kernel; same contract (``src`` is cast to
    the cache dtype). Ids must be distinct; they are not range-checked.

    Raises:
        ValueError: naming ``kv_cache``, ``block_ids`` or ``src`` (wrong shape, dtype,
            device, or not of the module's layout).
        RuntimeError: triton is not installed.
    """
    _check_cache_and_ids("scatter_blocks_triton", kv_cache, block_ids)
    num_layers, two, _, *block_shape = kv_cache.shape
    n = block_ids.shape[0]
    check_tensor("src", src, 6, FLOAT_DTYPES, kv_cache.device)
    check_shape("src", src, (num_layers, two, n, *block_shape))
    _check_layout("src", src)
    if n == 0 or src.numel() == 0:
        return
    block_ids = block_ids.to(kv_cache.device, torch.int64)
    _launch(src, kv_cache, block_ids, gather=False)


def _cpu_ids(block_ids: torch.Tensor) -> torch.Tensor:
    _check_ids(block_ids)
    return block_ids.to("cpu", torch.int64).contiguous()


def gather_blocks_cpu(kv_cache: torch.Tensor, block_ids: torch.Tensor,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """``gather_blocks_ref`` as one ``memcpy`` per block row (``csrc/cpu_block_copy.cpp``);
    same contract and result, any dtype.

    Gathering 24 planes x 64 random bf16 blocks (12 MiB) takes about as long as copying
    the same 12 MiB contiguously, where ``index_select`` of the reference took 2-3x that.
    Where both the cache and ``out`` are block-major (plane stride == one row) a block's
    rows of all planes go in one ``memcpy``.

    Args:
        kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` of
            the module's layout (layer- or block-major), on the CPU.
        block_ids: ``[n]`` integer block ids in ``[0, num_blocks)`` (any order, may be
            empty; moved to the CPU as int64).
        out: ``[num_layers, 2, n, block_size, num_kv_heads, head_dim]`` of the module's
            layout, the cache's dtype, on the CPU; written and returned (None: a new
            contiguous tensor). A reused ``out`` spares the page faults of fresh memory,
            which cost more than the copy from a few MiB up.

    Returns:
        ``[num_layers, 2, n, block_size, num_kv_heads, head_dim]``, the cache's dtype.

    Raises:
        ValueError: ``block_ids`` is not a 1-D integer tensor, or ``out`` does not fit.
        RuntimeError: the C++ kernels are not built (``cpu_ext.load()`` is False), or
            ``kv_cache`` is not a 6-D CPU cache of the module's layout, or an id is out
            of range.
    """
    ids = _cpu_ids(block_ids)
    num_layers, two, _, *block_shape = kv_cache.shape
    _check_out(out, kv_cache, ids.shape[0])
    if out is None:
        out = kv_cache.new_empty((num_layers, two, ids.shape[0], *block_shape))
    _cpu_ops("gather_blocks_cpu").gather_block_rows(out, kv_cache, ids)
    return out


def scatter_blocks_cpu(kv_cache: torch.Tensor, block_ids: torch.Tensor, src: torch.Tensor) -> None:
    """``scatter_blocks_ref`` as one ``memcpy`` per block row (``csrc/cpu_block_copy.cpp``);
    same contract (``src`` is cast to the cache's dtype, and made contiguous where it is
    not of the module's layout). Both block-major: one ``memcpy`` per block.

    Args:
        kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` of
            the module's layout (layer- or block-major), on the CPU; written in place.
        block_ids: ``[n]`` distinct integer block ids in ``[0, num_blocks)``.
        src: ``[num_layers, 2, n, block_size, num_kv_heads, head_dim]`` on the CPU.

    Raises:
        ValueError: ``block_ids`` is not a 1-D integer tensor.
        RuntimeError: the C++ kernels are not built, a tensor has the wrong shape or is
            not on the CPU, ``kv_cache`` is not of the module's layout, or an id is out
            of range.
    """
    ids = _cpu_ids(block_ids)
    src = src.to(kv_cache.dtype)
    if _plane_strides(src) is None:
        src = src.contiguous()
    _cpu_ops("scatter_blocks_cpu").scatter_block_rows(kv_cache, ids, src)


def _cpu_ops(op: str):
    if not cpu_ext.load():
        raise RuntimeError(f"{op}: the C++ CPU kernels are not built (see cpu_ext)")
    return torch.ops.pdserve_cpu


def _use_cpu_kernel(kv_cache: torch.Tensor) -> bool:
    return (kv_cache.device.type == "cpu" and _plane_strides(kv_cache) is not None
            and cpu_ext.load())


def gather_blocks(kv_cache, block_ids, out=None):
    """Dispatching entry point; see ``gather_blocks_ref`` (``out``: where to pack, or
    None for a new tensor).

    CUDA caches go to ``gather_blocks_triton``, CPU caches of the module's layout to
    ``gather_blocks_cpu`` when the C++ kernels are built, others to the reference.
    """
    if use_triton(kv_cache):
        return gather_blocks_triton(kv_cache, block_ids, out)
    if _use_cpu_kernel(kv_cache):
        return gather_blocks_cpu(kv_cache, block_ids, out)
    return gather_blocks_ref(kv_cache, block_ids, out)


def scatter_blocks(kv_cache, block_ids, src) -> None:
    """Dispatching entry point; see ``scatter_blocks_ref``.

    CUDA caches go to ``scatter_blocks_triton``, CPU caches of the module's layout to
    ``scatter_blocks_cpu`` when the C++ kernels are built, others to the reference.
    """
    if use_triton(kv_cache):
        scatter_blocks_triton(kv_cache, block_ids, src)
    elif _use_cpu_kernel(kv_cache):
        scatter_blocks_cpu(kv_cache, block_ids, src)
    else:
        scatter_blocks_ref(kv_cache, block_ids, src)
