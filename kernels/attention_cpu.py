"""The C++ CPU attention kernels' wrappers (``kernels/csrc``): paged decode attention
(``cpu_attention.cpp``, and ``cpu_decode_quant.cpp`` for a quantized cache) and paged
prefill attention for AVX512-BF16 CPUs (``cpu_prefill_attention.cpp``,
``cpu_prefill_quant.cpp``). Their contracts are the references'
(``paged_decode_attention_ref``, ``paged_prefill_attention_ref``), whose modules
dispatch to these.
"""

from __future__ import annotations

import torch

from pdserve.kernels import cpu_ext


def paged_decode_attention_cpu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """``paged_decode_attention_ref`` as a C++ CPU kernel (``kernels/csrc/cpu_attention.cpp``;
    a quantized cache ``kernels/csrc/cpu_decode_quant.cpp``); same contract.

    Algorithm: tasks on torch's intra-op threads, one per sequence (one per (sequence, kv
    head) when there are fewer than 4 sequences per thread), read K and V rows in place
    through the block table, prefetching a few tokens ahead (the reference gathers whole
    blocks and copies them kv-head-major first), for all query heads of a kv head's group
    at once, with an fp32 two-pass softmax; bf16 head dims 64/128/256 use AVX512-BF16
    dot products where the CPU has them. Any head dim up to 512, any block size, int32/int64
    tables; fp32, bf16 and fp16 (the caches in the query's dtype). A sliding window starts
    the task at the block of its first key (the keys before it there masked); soft-capping
    is applied to the scores before the softmax. A quantized cache (int8, fp8) takes the
    same three paths with its rows widened to fp32 as they are read (bf16 ones for the
    AVX512-BF16 dot products, exact), each score times its block's K scale and each
    probability times its block's V scale, the probabilities kept in fp32.

    Raises:
        RuntimeError: naming the argument whose shape, dtype or strides are wrong, a
            sequence length outside its block table or a block id outside the cache (all
            checked in C++, so the per-layer call costs no Python checks), or the C++
            kernels are not built (``pdserve.kernels.cpu_ext.load()`` returned False).
    """
    if query.is_cuda or not cpu_ext.load():
        raise RuntimeError("paged_decode_attention_cpu: needs CPU tensors and the C++ CPU "
                           "kernels (pdserve.kernels.cpu_ext)")
    out = torch.empty(query.shape, dtype=query.dtype)
    if not query.shape[0]:
        return out
    if key_scales is None and value_scales is None:
        torch.ops.pdserve_cpu.paged_decode_attention(
            out, query, key_cache, value_cache, block_tables, seq_lens.to(torch.int32), scale,
            sliding_window or 0, softcap or 0.0)
    else:
        torch.ops.pdserve_cpu.paged_decode_attention_quant(
            out, query, key_cache, value_cache, key_scales, value_scales, block_tables,
            seq_lens.to(torch.int32), scale, sliding_window or 0, softcap or 0.0)
    return out


def paged_prefill_attention_cpu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """``paged_prefill_attention_ref`` as a C++ kernel for AVX512-BF16 CPUs
    (``kernels/csrc/cpu_prefill_attention.cpp``); same contract, for a bf16 query (and
    output), a bf16 or quantized (int8, fp8) cache, and head dims 64, 128 and 256.

    Algorithm: one task per (sequence, kv head) on torch's intra-op threads reads the
    context's K and V rows once through the block table (no gather of whole blocks),
    packs them for ``vdpbf16ps``, and gives every query of the chunk, for all query heads
    of the kv head's group, its causal scores, an fp32 two-pass softmax (probabilities
    rounded to bf16, as the reference's attention does) and ``p V`` with fp32 sums.
    Memory per task: the context's K and V (packed) and one score row per query head.
    With a sliding window the task starts at the block of its first query's first key;
    soft-capped scores are capped before the softmax. A quantized cache's K rows are
    widened to bf16 as they are packed (exact) and each score is times its block's K
    scale; its V rows are packed dequantized to fp32, and ``p V`` runs on fp32
    probabilities with fp32 FMAs.

    Raises:
        RuntimeError: naming the argument whose shape, dtype or strides are wrong, a chunk
            longer than its context, a context past its block table or a block id outside
            the cache, or no such kernel here (``cpu_ext.has_prefill_attention()``).
    """
    if not cpu_ext.has_prefill_attention():
        raise RuntimeError("paged_prefill_attention_cpu: needs the C++ CPU kernels and a CPU "
                           "with AVX512-BF16")
    out = torch.empty(query.shape, dtype=query.dtype)
    if not query.shape[0]:
        return out
    cu, lens = cu_seqlens_q.to(torch.int32), seq_lens.to(torch.int32)
    if key_scales is None and value_scales is None:
        torch.ops.pdserve_cpu.paged_prefill_attention(
            out, query, key_cache, value_cache, block_tables, cu, lens, scale,
            sliding_window or 0, softcap or 0.0)
    else:
        torch.ops.pdserve_cpu.paged_prefill_attention_quant(
            out, query, key_cache, value_cache, key_scales, value_scales, block_tables, cu,
            lens, scale, sliding_window or 0, softcap or 0.0)
    return out
