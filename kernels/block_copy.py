"""Block gather / scatter for KV transfer.

``gather_blocks`` packs blocks of the whole-worker KV cache into one contiguous buffer;
``scatter_blocks`` unpacks such a buffer into given block ids. CUDA tensors use Triton;
contiguous CPU tensors the C++ kernels of ``csrc/cpu_block_copy.cpp`` (one ``memcpy`` per
block row) when they are built (``cpu_ext.load()``), other CPU tensors the references.
"""

from __future__ import annotations

import torch

from pdserve.kernels import cpu_ext
from pdserve.kernels._triton_utils import (
    FLOAT_DTYPES,
    cdiv,
    check_contiguous,
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


def _as_rows(tensor: torch.Tensor, num_planes: int, num_rows: int) -> torch.Tensor:
    """A contiguous ``[..., rows, block...]`` tensor as ``[num_planes, num_rows, words]``.

    On the CPU the words are int64 where the block's bytes allow it (exact bit copies;
    ``index_copy_`` moves 8 bytes per element: the scatter of 24 planes x 64 random bf16
    blocks, 12 MiB, measured 2.8 ms against 3.1 ms with bf16 elements, the gather no
    change at 1.9 ms; both are bound by random 4 KiB row accesses, about 2-3x a
    contiguous memcpy of the same bytes), else the tensor's own dtype."""
    row = tensor.numel() // max(num_planes * num_rows, 1)
    flat = tensor.reshape(num_planes, num_rows, row)
    row_bytes = flat.shape[2] * flat.element_size()
    if (not tensor.is_cuda and row_bytes % 8 == 0 and flat.element_size() < 8
            and flat.data_ptr() % 8 == 0):
        return flat.view(torch.int64)
    return flat


def _check_out(out: torch.Tensor | None, kv_cache: torch.Tensor, n: int) -> None:
    """Raise ValueError unless ``out`` is None or a contiguous ``[num_layers, 2, n,
    block...]`` tensor of the cache's dtype on its device."""
    if out is None:
        return
    expected = (*kv_cache.shape[:2], n, *kv_cache.shape[3:])
    if (not isinstance(out, torch.Tensor) or tuple(out.shape) != expected
            or out.dtype != kv_cache.dtype or out.device != kv_cache.device
            or not out.is_contiguous()):
        raise ValueError(f"out: expected a contiguous {expected} {kv_cache.dtype} tensor on "
                         f"{kv_cache.device}, got {out!r:.200}")


def gather_blocks_ref(kv_cache: torch.Tensor, block_ids: torch.Tensor,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack blocks into a contiguous buffer (``out``, or a new one).

    Args:
        kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``,
            contiguous.
        block_ids: ``[n]`` int64 block ids (any order, may be empty).
        out: ``[num_layers, 2, n, block_size, num_kv_heads, head_dim]``, contiguous, the
            cache's dtype and device; written and returned (None: a new tensor).

    Returns:
        ``[num_layers, 2, n, block_size, num_kv_heads, head_dim]``, same dtype/device.

    Raises:
        ValueError: ``out`` has the wrong shape, dtype or device, or is not contiguous.
    """
    num_layers, two, num_blocks, *block_shape = kv_cache.shape
    ids = block_ids.to(kv_cache.device, torch.long)
    _check_out(out, kv_cache, ids.shape[0])
    if kv_cache.numel() == 0 or not kv_cache.is_contiguous():
        packed = kv_cache.index_select(2, ids)
    else:
        rows = _as_rows(kv_cache, num_layers * two, num_blocks).index_select(1, ids)
        packed = rows.view(kv_cache.dtype).view(num_layers, two, ids.shape[0], *block_shape)
    return packed if out is None else out.copy_(packed)


def scatter_blocks_ref(kv_cache: torch.Tensor, block_ids: torch.Tensor, src: torch.Tensor) -> None:
    """Unpack ``src`` into ``kv_cache`` at ``block_ids`` in place.

    Args:
        kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``,
            contiguous.
        block_ids: ``[n]`` int64 distinct block ids.
        src: ``[num_layers, 2, n, block_size, num_kv_heads, head_dim]``, cast to the
            cache's dtype.
    """
    num_layers, two, num_blocks = kv_cache.shape[:3]
    ids = block_ids.to(kv_cache.device, torch.long)
    src = src.to(kv_cache.dtype)
    if ids.numel() == 0:
        return
    if kv_cache.numel() == 0 or not kv_cache.is_contiguous():
        kv_cache.index_copy_(2, ids, src)
        return
    planes = num_layers * two
    _as_rows(kv_cache, planes, num_blocks).index_copy_(
        1, ids, _as_rows(src.contiguous(), planes, ids.shape[0]))


@jit
def _copy_blocks_kernel(
    src_ptr, dst_ptr, block_ids_ptr,
    src_blocks, dst_blocks,  # blocks per (layer, K/V) plane in src and in dst
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
    src = src_ptr + (plane * src_blocks + src_block) * ROW + offsets
    dst = dst_ptr + (plane * dst_blocks + dst_block) * ROW + offsets
    values = tl.load(src, mask=mask)
    tl.store(dst, values.to(dst_ptr.dtype.element_ty), mask=mask)


def _check_cache_and_ids(op: str, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    require_triton(op)
    check_tensor("kv_cache", kv_cache, 6, FLOAT_DTYPES)
    check_contiguous("kv_cache", kv_cache)
    _check_ids(block_ids)


def _check_ids(block_ids: torch.Tensor) -> None:
    """Raise ValueError unless ``block_ids`` is a 1-D integer tensor."""
    if not isinstance(block_ids, torch.Tensor) or block_ids.dim() != 1:
        raise ValueError(f"block_ids: expected a 1-D tensor, got {block_ids!r}")
    if block_ids.dtype.is_floating_point or block_ids.dtype.is_complex:
        raise ValueError(f"block_ids: expected an integer dtype, got {block_ids.dtype}")


def _launch(src, dst, block_ids, src_blocks, dst_blocks, gather: bool) -> None:
    num_layers, two, _, *block_shape = src.shape
    row = block_shape[0] * block_shape[1] * block_shape[2]
    chunk = min(_CHUNK, 1 << (row - 1).bit_length())
    grid = (num_layers * two, block_ids.shape[0], cdiv(row, chunk))
    _copy_blocks_kernel[grid](
        src, dst, block_ids, src_blocks, dst_blocks, ROW=row, CHUNK=chunk, GATHER=gather
    )


def gather_blocks_triton(kv_cache: torch.Tensor, block_ids: torch.Tensor,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """``gather_blocks_ref`` as one Triton copy kernel; same contract (``out`` included).

    ``block_ids`` may be on another device (it is moved, as in the reference); ids are not
    range-checked.

    Raises:
        ValueError: naming ``kv_cache`` (not 6-D, not contiguous, not fp16/bf16/fp32),
            ``block_ids`` (not a 1-D integer tensor) or ``out``.
        RuntimeError: triton is not installed.
    """
    _check_cache_and_ids("gather_blocks_triton", kv_cache, block_ids)
    num_layers, two, num_blocks, *block_shape = kv_cache.shape
    n = block_ids.shape[0]
    _check_out(out, kv_cache, n)
    if out is None:
        out = kv_cache.new_empty((num_layers, two, n, *block_shape))
    if n == 0 or out.numel() == 0:
        return out
    block_ids = block_ids.to(kv_cache.device, torch.int64)
    _launch(kv_cache, out, block_ids, num_blocks, n, gather=True)
    return out


def scatter_blocks_triton(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, src: torch.Tensor
) -> None:
    """``scatter_blocks_ref`` as one Triton copy kernel; same contract (``src`` is cast to
    the cache dtype). Ids must be distinct; they are not range-checked.

    Raises:
        ValueError: naming ``kv_cache``, ``block_ids`` or ``src`` (wrong shape, dtype,
            device, or not contiguous).
        RuntimeError: triton is not installed.
    """
    _check_cache_and_ids("scatter_blocks_triton", kv_cache, block_ids)
    num_layers, two, num_blocks, *block_shape = kv_cache.shape
    n = block_ids.shape[0]
    check_tensor("src", src, 6, FLOAT_DTYPES, kv_cache.device)
    check_shape("src", src, (num_layers, two, n, *block_shape))
    check_contiguous("src", src)
    if n == 0 or src.numel() == 0:
        return
    block_ids = block_ids.to(kv_cache.device, torch.int64)
    _launch(src, kv_cache, block_ids, n, num_blocks, gather=False)


def _cpu_ids(block_ids: torch.Tensor) -> torch.Tensor:
    _check_ids(block_ids)
    return block_ids.to("cpu", torch.int64).contiguous()


def gather_blocks_cpu(kv_cache: torch.Tensor, block_ids: torch.Tensor,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """``gather_blocks_ref`` as one ``memcpy`` per block row (``csrc/cpu_block_copy.cpp``);
    same contract and result, any dtype.

    Gathering 24 planes x 64 random bf16 blocks (12 MiB) takes about as long as copying
    the same 12 MiB contiguously, where ``index_select`` of the reference took 2-3x that.

    Args:
        kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``,
            contiguous, on the CPU.
        block_ids: ``[n]`` integer block ids in ``[0, num_blocks)`` (any order, may be
            empty; moved to the CPU as int64).
        out: ``[num_layers, 2, n, block_size, num_kv_heads, head_dim]``, contiguous, the
            cache's dtype, on the CPU; written and returned (None: a new tensor). A
            reused ``out`` spares the page faults of fresh memory, which cost more than
            the copy from a few MiB up.

    Returns:
        ``[num_layers, 2, n, block_size, num_kv_heads, head_dim]``, the cache's dtype.

    Raises:
        ValueError: ``block_ids`` is not a 1-D integer tensor, or ``out`` does not fit.
        RuntimeError: the C++ kernels are not built (``cpu_ext.load()`` is False), or
            ``kv_cache`` is not a contiguous 6-D CPU cache, or an id is out of range.
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
    same contract (``src`` is cast to the cache's dtype and made contiguous first).

    Args:
        kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``,
            contiguous, on the CPU; written in place.
        block_ids: ``[n]`` distinct integer block ids in ``[0, num_blocks)``.
        src: ``[num_layers, 2, n, block_size, num_kv_heads, head_dim]`` on the CPU.

    Raises:
        ValueError: ``block_ids`` is not a 1-D integer tensor.
        RuntimeError: the C++ kernels are not built, a tensor has the wrong shape or is
            not on the CPU, or an id is out of range.
    """
    ids = _cpu_ids(block_ids)
    src = src.to(kv_cache.dtype).contiguous()
    _cpu_ops("scatter_blocks_cpu").scatter_block_rows(kv_cache, ids, src)


def _cpu_ops(op: str):
    if not cpu_ext.load():
        raise RuntimeError(f"{op}: the C++ CPU kernels are not built (see cpu_ext)")
    return torch.ops.pdserve_cpu


def _use_cpu_kernel(kv_cache: torch.Tensor) -> bool:
    return (kv_cache.device.type == "cpu" and kv_cache.dim() == 6 and kv_cache.is_contiguous()
            and cpu_ext.load())


def gather_blocks(kv_cache, block_ids, out=None):
    """Dispatching entry point; see ``gather_blocks_ref`` (``out``: where to pack, or
    None for a new tensor).

    CUDA caches go to ``gather_blocks_triton``, contiguous CPU caches to
    ``gather_blocks_cpu`` when the C++ kernels are built, others to the reference.
    """
    if use_triton(kv_cache):
        return gather_blocks_triton(kv_cache, block_ids, out)
    if _use_cpu_kernel(kv_cache):
        return gather_blocks_cpu(kv_cache, block_ids, out)
    return gather_blocks_ref(kv_cache, block_ids, out)


def scatter_blocks(kv_cache, block_ids, src) -> None:
    """Dispatching entry point; see ``scatter_blocks_ref``.

    CUDA caches go to ``scatter_blocks_triton``, contiguous CPU caches to
    ``scatter_blocks_cpu`` when the C++ kernels are built, others to the reference.
    """
    if use_triton(kv_cache):
        scatter_blocks_triton(kv_cache, block_ids, src)
    elif _use_cpu_kernel(kv_cache):
        scatter_blocks_cpu(kv_cache, block_ids, src)
    else:
        scatter_blocks_ref(kv_cache, block_ids, src)
