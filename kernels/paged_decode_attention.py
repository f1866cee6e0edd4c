"""Paged decode attention: one query token per sequence against its paged KV.

``paged_decode_attention`` dispatches CUDA tensors to the Triton kernel and CPU tensors to
the C++ kernel or ``paged_decode_attention_ref``; all share one signature.

A quantized cache (int8 / fp8, ``kernels/kv_quant.py``) comes with its scales
(``key_scales``, ``value_scales``): every kernel then dequantizes K and V rows on the fly
(``scale * q``) and attends in fp32 (query widened, probabilities unrounded), the output
in the query's dtype.
"""

from __future__ import annotations

import torch

from pdserve.kernels import cpu_ext
from pdserve.kernels._triton_utils import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    LOG2E_CONST,
    cdiv,
    check_contiguous,
    check_inner_contiguous,
    check_shape,
    check_tensor,
    dot_options,
    jit,
    multiprocessor_count,
    next_power_of_2,
    require_triton,
    soft_cap,
    tl,
    use_triton,
)
from pdserve.kernels.attention_cpu import paged_decode_attention_cpu
from pdserve.kernels.kv_quant import (
    QUANTIZED_DTYPES,
    check_kv_scales,
    dequantize_ref,
    kv_decode,
    triton_kv_args,
)


def paged_decode_attention_ref(
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
    """Attention of one new query token per sequence over its cached context.

    Args:
        query: ``[num_seqs, num_heads, head_dim]``.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``;
            ``num_heads`` must be a multiple of ``num_kv_heads`` (grouped-query attention).
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32; entries past a sequence's
            last block are ignored.
        seq_lens: ``[num_seqs]`` int32, context length in tokens including the query
            token, whose K/V must already be stored in the cache. Must be >= 1.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        sliding_window: tokens a query sees, itself included (Mistral's and Gemma's local
            attention, transformers' ``kv_idx > q_idx - sliding_window``): a sequence of
            ``n`` tokens attends to keys ``max(0, n - sliding_window) .. n - 1``, and
            block table entries before the window are never read. None: the whole
            context.
        softcap: Gemma 2's attention logit soft-capping, ``softcap * tanh(score /
            softcap)`` on the scaled scores before the softmax. None: off.
        key_scales, value_scales: a quantized cache's ``[num_blocks, num_kv_heads]`` fp32
            scales (``kernels/kv_quant.py``): K and V are dequantized and attended in
            fp32. None: a float cache.

    Returns:
        ``[num_seqs, num_heads, head_dim]`` in ``query.dtype`` (fp32 softmax).
    """
    num_seqs, num_heads, head_dim = query.shape
    if num_seqs == 0:
        return query.new_empty(query.shape)
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    blocks_per_seq = -(-int(seq_lens.max()) // block_size)
    ctx_len = blocks_per_seq * block_size  # L: the longest context, rounded up to blocks
    # Entries past a sequence's blocks, or before its window, may be padding (-1): read
    # block 0 there, masked below.
    block_ids = block_tables[:, :blocks_per_seq].reshape(-1).long().clamp(min=0)
    # Gather whole blocks (one contiguous row each), then put kv heads first: [S, H_kv, L, D].
    k = key_cache.reshape(num_blocks, -1).index_select(0, block_ids)
    v = value_cache.reshape(num_blocks, -1).index_select(0, block_ids)
    compute_dtype = query.dtype
    if key_scales is not None:  # dequantized to fp32: [S * blocks, block_size * H_kv * D]
        compute_dtype = torch.float32
        k = dequantize_ref(k.view(-1, block_size, num_kv_heads, head_dim),
                           key_scales.index_select(0, block_ids)).flatten(1)
        v = dequantize_ref(v.view(-1, block_size, num_kv_heads, head_dim),
                           value_scales.index_select(0, block_ids)).flatten(1)
    k = k.view(num_seqs, ctx_len, num_kv_heads, head_dim).transpose(1, 2).contiguous()
    v = v.view(num_seqs, ctx_len, num_kv_heads, head_dim).transpose(1, 2).contiguous()
    # The query heads sharing a kv head form its rows: [S, H_kv, G, D].
    q = query.view(num_seqs, num_kv_heads, group, head_dim).to(compute_dtype)
    scores = torch.matmul(q, k.to(q.dtype).transpose(-1, -2)).float() * scale  # [S, H_kv, G, L]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    positions = torch.arange(ctx_len, device=query.device)
    lens = seq_lens[:, None].to(positions.device)
    pad = positions[None, :] >= lens  # [S, L]
    if sliding_window:
        pad |= positions[None, :] < lens - sliding_window
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(compute_dtype)
    out = torch.matmul(probs, v.to(compute_dtype))  # [S, H_kv, G, D]
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


# NOTE: launch choices. A decode program streams one (sequence, kv head)'s context; with
# fewer programs than about 4 per SM the GPU idles, so the context is split (flash-decoding)
# into partitions of at least _MIN_SPLIT_TOKENS tokens, at most _MAX_SPLITS of them.
_MIN_SPLIT_TOKENS = 512
_MAX_SPLITS = 64
_PROGRAMS_PER_SM = 4


@jit
def _decode_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, lse_ptr,
    key_scales_ptr, value_scales_ptr,  # KV_KIND != 0: [num_blocks, num_kv_heads] fp32
    stride_ksb, stride_vsb,  # the scales' block strides
    scale,  # softmax scale (scores are kept in base 2: times log2(e) after the cap)
    split_len,  # context tokens per split
    window,  # tokens a query sees (WINDOW): keys [seq_len - window, seq_len)
    softcap,  # SOFTCAP: scores become softcap * tanh(score / softcap)
    stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bts,
    stride_os, stride_oh, stride_osplit,
    stride_ls, stride_lh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,  # write fp32 partials and their log-sum-exp for the reduce kernel
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    KV_KIND: tl.constexpr,  # kv_quant.kv_kind: 0 a float cache, else int8 / fp8 bits
):
    """One program: the ``GROUP`` query heads of one kv head of one sequence, over the
    context tokens ``[split * split_len, (split + 1) * split_len)`` (those in its window).
    A quantized cache's rows are dequantized (times their block's scale) into fp32."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * split_len
    end = tl.minimum(seq_len, start + split_len)
    if WINDOW:
        start = tl.maximum(start, seq_len - window)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    head = kv_head * GROUP + g  # [GROUP_PAD]
    row_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(query_ptr + seq.to(tl.int64) * stride_qs + head[:, None] * stride_qh
                + d[None, :], mask=row_mask, other=0.0)  # [GROUP_PAD, HEAD_DIM_PAD]
    if UPCAST:
        q = q.to(tl.float32)
    if KV_KIND != 0:
        q = q.to(tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max (base 2)
    l_i = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bts
    d_mask = (d < HEAD_DIM)[None, :]
    for tile in range(start, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)  # [BLOCK_N] token positions
        valid = pos < end
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
            k = k.to(q.dtype)  # [BLOCK_N, HEAD_DIM_PAD]
            v = v.to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if SOFTCAP:
            scores = soft_cap(scores, softcap)
        scores = scores * LOG2E_CONST
        scores = tl.where(valid[None, :], scores, float("-inf"))  # [GROUP_PAD, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    # NOTE: l_i is 0 only for seq_len 0 (outside the contract); that yields zeros, not NaN.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_ptrs = (out_ptr + seq.to(tl.int64) * stride_os + head[:, None] * stride_oh
                + split * stride_osplit + d[None, :])
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask)
    if SPLIT:
        # An empty partition (start >= end) stores -inf here; the reduce kernel skips it.
        lse = m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))  # [GROUP_PAD], base 2
        tl.store(lse_ptr + seq * stride_ls + head * stride_lh + split, lse, mask=g < GROUP)


@jit
def _decode_reduce_kernel(
    partial_ptr, lse_ptr, seq_lens_ptr, out_ptr,
    split_len,
    stride_ps, stride_ph, stride_psplit,
    stride_ls, stride_lh,
    stride_os, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    """One program: one (sequence, query head); combines its splits' normalised partial
    outputs weighted by ``exp2(lse_split - max lse)`` (flash-decoding's reduction)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_splits = tl.cdiv(seq_len, split_len)  # the non-empty partitions
    sp = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    used = sp < num_splits
    lse = tl.load(lse_ptr + seq * stride_ls + head * stride_lh + sp, mask=used,
                  other=float("-inf"))  # [SPLITS_PAD]
    m = tl.max(lse, 0)
    weight = tl.where(used, tl.exp2(lse - m), 0.0)
    partial = tl.load(partial_ptr + seq * stride_ps + head * stride_ph
                      + sp[:, None] * stride_psplit + d[None, :],
                      mask=used[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    total = tl.sum(weight, 0)
    out = tl.sum(weight[:, None] * partial, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + d,
             out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def _check_decode_args(query, key_cache, value_cache, block_tables, seq_lens,
                       key_scales=None, value_scales=None) -> None:
    check_tensor("query", query, 3, FLOAT_DTYPES)
    device = query.device
    check_tensor("key_cache", key_cache, 4, FLOAT_DTYPES + QUANTIZED_DTYPES, device)
    check_kv_scales(key_cache, key_scales, value_scales)
    check_tensor("value_cache", value_cache, 4, (key_cache.dtype,), device)
    check_shape("value_cache", value_cache, key_cache.shape)
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_dim:
        raise ValueError(f"key_cache: head_dim {key_cache.shape[3]} != query's {head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"key_cache: {num_kv_heads} kv heads do not divide {num_heads} heads")
    check_tensor("block_tables", block_tables, 2, INDEX_DTYPES, device)
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables: {block_tables.shape[0]} rows for {num_seqs} seqs")
    check_tensor("seq_lens", seq_lens, 1, INDEX_DTYPES, device)
    check_shape("seq_lens", seq_lens, (num_seqs,))
    check_inner_contiguous("query", query, 1)
    check_inner_contiguous("key_cache", key_cache, 1)
    check_inner_contiguous("value_cache", value_cache, 1)
    check_inner_contiguous("block_tables", block_tables, 1)
    check_contiguous("seq_lens", seq_lens)


def _choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int,
                       num_sms: int) -> int:
    """Splits per sequence so that about ``_PROGRAMS_PER_SM`` programs run per SM.

    ``max_context`` is an upper bound (the block table's width in tokens), read without
    a device sync. Worked example on 132 SMs (528 programs wanted), 8 kv heads, 8k-token
    tables: batch 64 has 512 programs, 2 splits; batch 16 has 128, 5 splits; batch 1 has
    8, 16 splits (capped at 8192 // 512); batch 128 has 1024, no split.
    """
    programs = num_seqs * num_kv_heads
    wanted = _PROGRAMS_PER_SM * num_sms
    if programs == 0 or programs >= wanted:
        return 1
    by_length = max(1, max_context // _MIN_SPLIT_TOKENS)
    return max(1, min(cdiv(wanted, programs), by_length, _MAX_SPLITS))


def _run_decode(query, key_cache, value_cache, block_tables, seq_lens, scale,
                num_splits: int, block_n: int | None = None,
                sliding_window: int | None = None, softcap: float | None = None,
                key_scales: torch.Tensor | None = None,
                value_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the decode kernel (and, for ``num_splits > 1``, the reduce kernel)."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_seqs == 0:
        return out
    head_dim_pad = max(16, next_power_of_2(head_dim))
    block_n = block_n or (64 if head_dim_pad <= 128 else 32)
    max_context = block_tables.shape[1] * block_size
    split_len = cdiv(cdiv(max(max_context, 1), num_splits), block_n) * block_n
    num_splits = cdiv(max(max_context, 1), split_len)
    constants = dict(
        GROUP=group, GROUP_PAD=max(16, next_power_of_2(group)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, SPLIT=num_splits > 1,
        WINDOW=bool(sliding_window), SOFTCAP=bool(softcap),
        **dot_options(query.dtype if key_scales is None else torch.float32),
    )
    k_arg, v_arg, ks_arg, vs_arg, stride_ksb, stride_vsb, kind = triton_kv_args(
        key_cache, value_cache, key_scales, value_scales)
    if num_splits == 1:
        partial, lse = out, out  # lse unused
        partial_strides = (out.stride(0), out.stride(1), 0)
        lse_strides = (0, 0)
    else:
        partial = query.new_empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32)
        lse = query.new_empty((num_seqs, num_heads, num_splits), dtype=torch.float32)
        partial_strides = partial.stride()[:3]
        lse_strides = lse.stride()[:2]
    grid = (num_seqs, num_kv_heads, num_splits)
    _decode_kernel[grid](
        query, k_arg, v_arg, block_tables, seq_lens, partial, lse,
        ks_arg, vs_arg, stride_ksb, stride_vsb,
        scale, split_len, sliding_window or 0, softcap or 0.0,
        query.stride(0), query.stride(1),
        *key_cache.stride()[:3], *value_cache.stride()[:3],
        block_tables.stride(0), *partial_strides, *lse_strides,
        KV_KIND=kind, **constants,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            partial, lse, seq_lens, out, split_len,
            *partial.stride()[:3], *lse.stride()[:2], out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            SPLITS_PAD=next_power_of_2(num_splits),
        )
    return out


def paged_decode_attention_triton(
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
    """``paged_decode_attention_ref`` in Triton; same contract.

    Algorithm: vLLM's paged attention with the grouped-query heads of one kv head in one
    program (each K/V tile is read once for the group), FlashAttention-2's online softmax
    (fp32 max/sum/accumulator, base-2 exponentials) and, when there are too few
    (sequence, kv head) programs to fill the GPU, flash-decoding's split-K: the context is
    partitioned, each partition writes its normalised output and log-sum-exp, and a reduce
    kernel combines them. Head dims up to 256 (any, powers of two padded by masking),
    any block size, int32/int64 tables. No device sync: the split count comes from the
    block table's width, not from ``seq_lens``. A sliding window starts each program's
    loop at its first key (partitions wholly before it stay empty); soft-capping applies
    ``softcap * tanh(score / softcap)`` to each tile's scores (tanh from ``exp``). A
    quantized cache's tiles are dequantized as they are loaded (fp8 decoded from its
    bits, ``kv_quant.kv_decode``) and the dots run on fp32 operands (``"ieee"``).

    Raises:
        ValueError: naming the argument whose shape, dtype, device or strides are wrong
            (each tensor's last dim must be contiguous).
        RuntimeError: triton is not installed.
    """
    require_triton("paged_decode_attention_triton")
    _check_decode_args(query, key_cache, value_cache, block_tables, seq_lens, key_scales,
                       value_scales)
    max_context = block_tables.shape[1] * key_cache.shape[1]
    num_splits = _choose_num_splits(query.shape[0], key_cache.shape[2], max_context,
                                    multiprocessor_count(query.device))
    return _run_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, num_splits,
                       sliding_window=sliding_window, softcap=softcap, key_scales=key_scales,
                       value_scales=value_scales)


def paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale,
                           sliding_window=None, softcap=None, key_scales=None,
                           value_scales=None):
    """Dispatching entry point; see ``paged_decode_attention_ref`` for the contract.

    CUDA tensors go to ``paged_decode_attention_triton``; CPU tensors to
    ``paged_decode_attention_cpu`` where the C++ CPU kernels are built
    (``pdserve.kernels.cpu_ext``), else to the reference.
    """
    args = (query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window,
            softcap, key_scales, value_scales)
    if use_triton(query):
        return paged_decode_attention_triton(*args)
    if query.device.type == "cpu" and cpu_ext.load():
        return paged_decode_attention_cpu(*args)
    return paged_decode_attention_ref(*args)
