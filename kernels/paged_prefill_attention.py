"""Prefill attention over a paged prefix: causal varlen attention for prompt chunks.

Each sequence contributes ``q_len`` new query tokens whose K/V are already stored in the
paged cache after its ``seq_len - q_len`` earlier (computed or prefix-cached) tokens.
``paged_prefill_attention`` dispatches CUDA tensors to Triton, CPU tensors to the C++
kernel or the reference. A quantized cache comes with its scales and is attended in fp32,
as in ``paged_decode_attention``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_ext
from pdserve.kernels._triton_utils import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    LOG2E_CONST,
    check_contiguous,
    check_inner_contiguous,
    check_shape,
    check_tensor,
    dot_options,
    jit,
    next_power_of_2,
    require_triton,
    soft_cap,
    tl,
    use_triton,
)
from pdserve.kernels.attention_cpu import paged_prefill_attention_cpu
from pdserve.kernels.kv_quant import (
    QUANTIZED_DTYPES,
    check_kv_scales,
    dequantize_ref,
    kv_decode,
    triton_kv_args,
)


def _sequence_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    key_scales: torch.Tensor | None,
    value_scales: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first ``seq_len`` cached K and V rows, gathered from its blocks.

    Args:
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_table: ``[max_blocks_per_seq]`` int32/int64, the sequence's row of the block
            table; entries before a sliding window may be padding (-1).
        seq_len: the sequence's context length, in tokens.
        key_scales, value_scales: a quantized cache's ``[num_blocks, num_kv_heads]`` fp32
            scales (K and V come back dequantized, fp32), or None for a float cache.

    Returns:
        ``(k, v)``, each ``[seq_len, num_kv_heads, head_dim]`` (the cache's dtype, or fp32
        when dequantized).
    """
    block_size = key_cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    # Entries before the window may be padding (-1): read block 0 there, which the
    # caller masks.
    blocks = block_table[:num_blocks].long().clamp(min=0)
    k = key_cache.index_select(0, blocks)  # [blocks, block_size, H_kv, D]
    v = value_cache.index_select(0, blocks)
    if key_scales is not None:  # dequantized, attended in fp32
        k = dequantize_ref(k, key_scales.index_select(0, blocks))
        v = dequantize_ref(v, value_scales.index_select(0, blocks))
    return k.flatten(0, 1)[:seq_len], v.flatten(0, 1)[:seq_len]


def paged_prefill_attention_ref(
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
    """Causal attention of each chunk's queries over its sequence's paged K/V.

    Args:
        query: ``[num_tokens, num_heads, head_dim]``, the chunks laid end to end.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32.
        cu_seqlens_q: ``[num_seqs + 1]`` int32, prefix sums of the chunk lengths
            (``cu_seqlens_q[-1] == num_tokens``).
        seq_lens: ``[num_seqs]`` int32, each sequence's context length after this chunk
            (prefix + chunk), in tokens. Query ``i`` of sequence ``s`` sits at position
            ``seq_lens[s] - q_len + i`` and sees keys ``0 ..`` that position.
        scale: softmax scale.
        sliding_window: tokens a query sees, itself included (transformers' ``kv_idx >
            q_idx - sliding_window``); block table entries before the chunk's first
            window are never read. None: causal over the whole context.
        softcap: Gemma 2's ``softcap * tanh(score / softcap)`` on the scaled scores
            before the softmax. None: off.
        key_scales, value_scales: a quantized cache's ``[num_blocks, num_kv_heads]`` fp32
            scales: K and V are dequantized and attended in fp32. None: a float cache.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``query.dtype``.
    """
    out = torch.empty_like(query)
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        start, end = cu[s], cu[s + 1]
        q_len = end - start
        if q_len == 0:
            continue
        k, v = _sequence_kv(key_cache, value_cache, block_tables[s], seq_len, key_scales,
                            value_scales)  # [L, H_kv, D]
        # NOTE: 4-D inputs take torch's CPU flash-attention kernel; 3-D ones the slow math path.
        q = query[start:end].transpose(0, 1)[None]  # [1, H, q_len, D]
        if key_scales is not None:
            q = q.float()
        k = k.transpose(0, 1).to(q.dtype)[None]  # [1, H_kv, L, D]
        v = v.transpose(0, 1).to(q.dtype)[None]
        gqa = num_heads != num_kv_heads
        if seq_len == q_len and not sliding_window and not softcap:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                               enable_gqa=gqa)  # plain causal attention
        else:
            # Query i (absolute position seq_len - q_len + i) sees keys j <= that position
            # (and j > it - sliding_window).
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
            k_pos = torch.arange(seq_len, device=query.device)[None, :]
            mask = k_pos <= q_pos  # [q_len, L]
            if sliding_window:
                mask &= k_pos > q_pos - sliding_window
            if softcap:
                o = _capped_attention(q, k, v, mask, scale, softcap)
            else:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                   enable_gqa=gqa)
        out[start:end] = o[0].transpose(0, 1).to(out.dtype)
    return out


def _capped_attention(q, k, v, mask, scale: float, softcap: float) -> torch.Tensor:
    """Attention with soft-capped scores, as transformers' eager Gemma 2 computes it:
    ``q: [1, H, q_len, D]``, ``k, v: [1, H_kv, L, D]``, ``mask: [q_len, L]`` bool ->
    ``[1, H, q_len, D]``; fp32 softmax, the probabilities in ``q``'s dtype."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [1, H, q_len, L]
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


@jit
def _prefill_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr,
    seq_lens_ptr, out_ptr,
    key_scales_ptr, value_scales_ptr,  # KV_KIND != 0: [num_blocks, num_kv_heads] fp32
    stride_ksb, stride_vsb,  # the scales' block strides
    scale,  # softmax scale (scores are kept in base 2: times log2(e) after the cap)
    window,  # WINDOW: a query sees its last `window` keys, itself included
    softcap,  # SOFTCAP: scores become softcap * tanh(score / softcap)
    num_seqs,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bts,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    KV_KIND: tl.constexpr,  # kv_quant.kv_kind: 0 a float cache, else int8 / fp8 bits
):
    """One program: ``BLOCK_Q`` query tokens of one chunk times the ``GROUP`` query heads
    of one kv head (``BLOCK_Q * GROUP_PAD`` rows), over its causal span of paged keys
    (within the sliding window, with ``WINDOW``); a quantized cache's rows dequantized
    into fp32."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    # Find the sequence that owns query tile `tile`: sequence s owns the tiles from
    # cu_seqlens_q[s] // BLOCK_Q + s on (see _num_query_tiles), so binary-search for the
    # last s whose first tile is <= tile.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    local_tile = tile - (q_start // BLOCK_Q + seq)
    if local_tile * BLOCK_Q >= q_len:  # a spare tile of this sequence
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len  # tokens cached before this chunk

    r = tl.arange(0, BLOCK_Q * GROUP_PAD)  # row r: query token r // GROUP_PAD, head r % ..
    q_idx = local_tile * BLOCK_Q + r // GROUP_PAD  # [BLOCK_M] token index in the chunk
    g = r % GROUP_PAD
    head = kv_head * GROUP + g
    d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = (d < HEAD_DIM)[None, :]
    row_mask = ((q_idx < q_len) & (g < GROUP))[:, None] & d_mask  # [BLOCK_M, HEAD_DIM_PAD]
    token = (q_start + q_idx).to(tl.int64)
    q = tl.load(query_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    if KV_KIND != 0:
        q = q.to(tl.float32)
    q_pos = prefix_len + q_idx  # [BLOCK_M] absolute positions; key j is seen iff j <= q_pos
    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bts
    # Keys past the tile's last query are never seen, nor (WINDOW) keys before its first
    # query's window.
    kv_end = tl.minimum(seq_len, prefix_len + (local_tile + 1) * BLOCK_Q)
    kv_begin = 0
    if WINDOW:
        kv_begin = tl.maximum(0, prefix_len + local_tile * BLOCK_Q - window + 1)
    for kv_start in range(kv_begin, kv_end, BLOCK_N):
        pos = kv_start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        valid = pos < kv_end
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
        k_off = block * stride_kb + slot * stride_ks + kv_head * stride_kh
        v_off = block * stride_vb + slot * stride_vs + kv_head * stride_vh
        kv_mask = valid[:, None] & d_mask
        k = tl.load(key_cache_ptr + k_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(value_cache_ptr + v_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if KV_KIND != 0:  # dequantize: scale of (block, kv head) times the stored value
            k_scale = tl.load(key_scales_ptr + block * stride_ksb + kv_head, mask=valid,
                              other=0.0)
            v_scale = tl.load(value_scales_ptr + block * stride_vsb + kv_head, mask=valid,
                              other=0.0)
            k = kv_decode(k, KV_KIND) * k_scale[:, None]
            v = kv_decode(v, KV_KIND) * v_scale[:, None]
        else:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if SOFTCAP:
            scores = soft_cap(scores, softcap)
        scores = scores * LOG2E_CONST
        seen = valid[None, :] & (pos[None, :] <= q_pos[:, None])  # [BLOCK_M, BLOCK_N]
        if WINDOW:
            seen = seen & (pos[None, :] > q_pos[:, None] - window)
        scores = tl.where(seen, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # NOTE: a row that has seen no key yet (a window starting past this tile) keeps
        # m = -inf; subtracting 0 then gives exp2(-inf) = 0, not NaN
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask)


def _num_query_tiles(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Query tiles to launch without reading ``cu_seqlens_q`` on the host (no device sync).

    Sequence ``s`` owns tiles ``cu[s] // block_q + s`` up to (not including)
    ``cu[s + 1] // block_q + s + 1``: ``cu[s+1] // block_q - cu[s] // block_q + 1`` tiles,
    never fewer than ``ceil(q_len / block_q)``. Worked example, block_q = 4, chunks of 6
    and 3 tokens (cu = [0, 6, 9]): sequence 0 owns tiles 0, 1 (first is 0 // 4 + 0);
    sequence 1 owns tiles 2, 3 (first is 6 // 4 + 1), of which tile 3 exits at once.
    In all ``num_tokens // block_q + num_seqs`` tiles (9 // 4 + 2 = 4).
    """
    return num_tokens // block_q + num_seqs


def _check_prefill_args(query, key_cache, value_cache, block_tables, cu_seqlens_q,
                        seq_lens, key_scales=None, value_scales=None) -> None:
    require_triton("paged_prefill_attention_triton")
    check_tensor("query", query, 3, FLOAT_DTYPES)
    device = query.device
    check_tensor("key_cache", key_cache, 4, FLOAT_DTYPES + QUANTIZED_DTYPES, device)
    check_kv_scales(key_cache, key_scales, value_scales)
    check_tensor("value_cache", value_cache, 4, (key_cache.dtype,), device)
    check_shape("value_cache", value_cache, key_cache.shape)
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_dim:
        raise ValueError(f"key_cache: head_dim {key_cache.shape[3]} != query's {head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"key_cache: {num_kv_heads} kv heads do not divide {num_heads} heads")
    check_tensor("seq_lens", seq_lens, 1, INDEX_DTYPES, device)
    num_seqs = seq_lens.shape[0]
    check_tensor("block_tables", block_tables, 2, INDEX_DTYPES, device)
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables: {block_tables.shape[0]} rows for {num_seqs} seqs")
    check_tensor("cu_seqlens_q", cu_seqlens_q, 1, INDEX_DTYPES, device)
    check_shape("cu_seqlens_q", cu_seqlens_q, (num_seqs + 1,))
    for name, tensor in (("query", query), ("key_cache", key_cache),
                         ("value_cache", value_cache), ("block_tables", block_tables)):
        check_inner_contiguous(name, tensor, 1)
    check_contiguous("cu_seqlens_q", cu_seqlens_q)
    check_contiguous("seq_lens", seq_lens)


def _run_prefill(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                 block_m: int = 64, block_n: int | None = None,
                 sliding_window: int | None = None, softcap: float | None = None,
                 key_scales: torch.Tensor | None = None,
                 value_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the prefill kernel with ``block_m`` (query token, head) rows per program."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_seqs == 0 or num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    head_dim_pad = max(16, next_power_of_2(head_dim))
    block_q = max(1, block_m // group_pad)
    block_n = block_n or (64 if head_dim_pad <= 128 else 32)
    grid = (_num_query_tiles(num_tokens, num_seqs, block_q), num_kv_heads)
    k_arg, v_arg, ks_arg, vs_arg, stride_ksb, stride_vsb, kind = triton_kv_args(
        key_cache, value_cache, key_scales, value_scales)
    _prefill_kernel[grid](
        query, k_arg, v_arg, block_tables, cu_seqlens_q, seq_lens, out,
        ks_arg, vs_arg, stride_ksb, stride_vsb,
        scale, sliding_window or 0, softcap or 0.0, num_seqs,
        query.stride(0), query.stride(1),
        *key_cache.stride()[:3], *value_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_N=block_n,
        WINDOW=bool(sliding_window), SOFTCAP=bool(softcap), KV_KIND=kind,
        **dot_options(query.dtype if key_scales is None else torch.float32),
    )
    return out


def paged_prefill_attention_triton(
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
    """``paged_prefill_attention_ref`` in Triton; same contract.

    Algorithm: FlashAttention-2's forward pass (query tiles, online softmax in fp32,
    base-2 exponentials) with keys read through the block table as in vLLM's prefix-prefill
    and unified-attention kernels; a tile's rows are (query token, query head) pairs of
    one kv head's group, so each K/V tile serves the whole group. Query tiles are found
    by a binary search over ``cu_seqlens_q`` in the kernel, so launching needs no device
    sync. Head dims up to 256 (others padded by masking), any block size. With a sliding
    window a tile's key loop starts at its first query's window, and rows whose window
    starts in a later key tile stay empty until it; soft-capping as in decode, and a
    quantized cache dequantized as in decode.

    Raises:
        ValueError: naming the argument whose shape, dtype, device or strides are wrong
            (each tensor's last dim must be contiguous).
        RuntimeError: triton is not installed.
    """
    _check_prefill_args(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                        key_scales, value_scales)
    return _run_prefill(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                        scale, sliding_window=sliding_window, softcap=softcap,
                        key_scales=key_scales, value_scales=value_scales)


def paged_prefill_attention(
    query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale,
    sliding_window=None, softcap=None, key_scales=None, value_scales=None,
):
    """Dispatching entry point; see ``paged_prefill_attention_ref`` for the contract.

    CUDA tensors go to ``paged_prefill_attention_triton``; a bf16 CPU query with head dim
    64, 128 or 256 over a bf16 or quantized cache to ``paged_prefill_attention_cpu``
    where it runs; the rest to the reference.
    """
    args = (query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale,
            sliding_window, softcap, key_scales, value_scales)
    if use_triton(query):
        return paged_prefill_attention_triton(*args)
    if (query.device.type == "cpu" and query.dtype == torch.bfloat16
            and key_cache.dtype in (torch.bfloat16, *QUANTIZED_DTYPES)
            and query.shape[-1] in (64, 128, 256) and cpu_ext.has_prefill_attention()):
        return paged_prefill_attention_cpu(*args)
    return paged_prefill_attention_ref(*args)
