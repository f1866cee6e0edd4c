"""Paged decode attention: one query token per sequence against its paged KV.

``paged_decode_attention`` dispatches CUDA tensors to the Triton kernel and CPU tensors to
``paged_decode_attention_ref``; both share one signature.
"""

from __future__ import annotations

import torch


def paged_decode_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
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
    block_ids = block_tables[:, :blocks_per_seq].reshape(-1).long()
    # Gather whole blocks (one contiguous row each): [S, L, H_kv, D].
    k = key_cache.reshape(num_blocks, -1).index_select(0, block_ids)
    v = value_cache.reshape(num_blocks, -1).index_select(0, block_ids)
    k = k.view(num_seqs, ctx_len * num_kv_heads, head_dim).to(query.dtype)
    v = v.view(num_seqs, ctx_len, num_kv_heads * head_dim).to(query.dtype)
    # NOTE: one batched matmul scores every (slot, kv head) against every query head, and
    # the pairs where query head h belongs to kv head h // group are kept (a diagonal).
    # The extra products are cheap next to the strided copies a per-group layout needs.
    every = torch.matmul(k, query.transpose(1, 2)).float()  # [S, L*H_kv, H]
    every = every.view(num_seqs, ctx_len, num_kv_heads, num_kv_heads, group)
    scores = torch.diagonal(every, dim1=2, dim2=3)  # [S, L, G, H_kv]
    scores = scores.permute(0, 3, 2, 1).reshape(num_seqs, num_heads, ctx_len) * scale
    positions = torch.arange(ctx_len, device=query.device)
    pad = positions[None, :] >= seq_lens[:, None].to(positions.device)  # [S, L]
    scores.masked_fill_(pad[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)  # [S, H, L]
    every_out = torch.matmul(probs, v)  # [S, H, H_kv*D]
    every_out = every_out.view(num_seqs, num_kv_heads, group, num_kv_heads, head_dim)
    out = torch.diagonal(every_out, dim1=1, dim2=3)  # [S, G, D, H_kv]
    return out.permute(0, 3, 1, 2).reshape(num_seqs, num_heads, head_dim)


def paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale):
    """Dispatching entry point; see ``paged_decode_attention_ref`` for the contract."""
    return paged_decode_attention_ref(query, key_cache, value_cache, block_tables, seq_lens, scale)
