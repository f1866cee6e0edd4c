"""Paged decode attention: one query token per sequence against its paged KV.

``paged_decode_attention`` dispatches CUDA tensors to the Triton kernel and CPU tensors to
``paged_decode_attention_ref``; both share one signature.
"""

from __future__ import annotations

import torch


def _gather_context(
    cache: torch.Tensor, block_tables: torch.Tensor, max_len: int
) -> torch.Tensor:
    """Gather each sequence's first ``max_len`` slots: ``[num_seqs, max_len, H_kv, D]``."""
    block_size = cache.shape[1]
    num_blocks_needed = (max_len + block_size - 1) // block_size
    tables = block_tables[:, :num_blocks_needed].long()  # [S, nb]
    ctx = cache[tables]  # [S, nb, block_size, H_kv, D]
    return ctx.flatten(1, 2)[:, :max_len]


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
    num_kv_heads = key_cache.shape[2]
    max_len = int(seq_lens.max())
    k = _gather_context(key_cache, block_tables, max_len)  # [S, L, H_kv, D]
    v = _gather_context(value_cache, block_tables, max_len)
    group = num_heads // num_kv_heads
    q = query.view(num_seqs, num_kv_heads, group, head_dim).float()  # [S, H_kv, G, D]
    scores = torch.einsum("skgd,slkd->skgl", q, k.float()) * scale  # [S, H_kv, G, L]
    positions = torch.arange(max_len, device=query.device)
    pad = positions[None, :] >= seq_lens[:, None].to(positions.device)  # [S, L]
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("skgl,slkd->skgd", probs, v.float())  # [S, H_kv, G, D]
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale):
    """Dispatching entry point; see ``paged_decode_attention_ref`` for the contract."""
    return paged_decode_attention_ref(query, key_cache, value_cache, block_tables, seq_lens, scale)
