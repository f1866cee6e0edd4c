"""The spec the kernel tests hold kernels to: tiny random paged K/V caches and the plain
per-token attention loops (float64) that the references and kernels must equal.

Shared by ``test_kernels.py`` (the Triton kernels and references) and ``test_cpu_kernels.py``
(the C++ CPU kernels). Imports nothing from pdserve, so it may be imported before
``triton_interpreter``.
"""

from __future__ import annotations

import torch

# (num_heads, num_kv_heads): query heads per kv head 1, 2 and 4.
GQA = [(2, 2), (4, 2), (8, 2)]
# Context lengths: a single token, ends mid-block, exactly one block, several blocks.
DECODE_LENS = [1, 17, 32, 70]
# (q_len, seq_len) per sequence: no prefix, prefix ending mid-block, one token after a
# prefix, an empty chunk, a chunk crossing blocks.
PREFILL_CHUNKS = [(5, 5), (7, 40), (1, 19), (0, 16), (20, 20)]


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Attention outputs: fp32 to ~1e-5; bf16/fp16 to their rounding (2e-2)."""
    tol = 2e-5 if expected.dtype == torch.float32 else 2e-2
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual.cpu().float(), expected.cpu().float(), atol=tol, rtol=tol)


def make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, device, seed=0):
    """Random K/V caches and block tables holding each sequence in shuffled blocks.

    Every slot holds random values (so a kernel reading past a sequence shows), and table
    entries past a sequence's last block point at some other valid block.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)
    width = max(blocks_per_seq, default=0) + 1
    block_tables = order[-1].repeat(len(seq_lens), width).int()
    first = 0
    for row, n in enumerate(blocks_per_seq):
        block_tables[row, :n] = order[first:first + n]
        first += n
    return key_cache.to(device), value_cache.to(device), block_tables.to(device)


def randn(*shape, dtype=torch.float32, device="cpu", seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


# ---- the spec: plain per-token loops -------------------------------------------------


def context_loop(cache, block_table, seq_len):
    """One sequence's cached rows, token by token: ``[seq_len, num_kv_heads, head_dim]``."""
    block_size = cache.shape[1]
    rows = [cache[int(block_table[p // block_size]), p % block_size] for p in range(seq_len)]
    return torch.stack(rows) if rows else cache.new_empty((0, *cache.shape[2:]))


def attention_loop(q, keys, values, num_visible, scale):
    """One query head: softmax(q . k_j * scale) over keys j < num_visible, in float64."""
    scores = (keys[:num_visible].double() @ q.double()) * scale
    return torch.softmax(scores, dim=0) @ values[:num_visible].double()


def decode_loop(query, key_cache, value_cache, block_tables, seq_lens, scale):
    num_seqs, num_heads, _ = query.shape
    group = num_heads // key_cache.shape[2]
    out = torch.empty(query.shape, dtype=torch.float64)
    for s in range(num_seqs):
        keys = context_loop(key_cache, block_tables[s], int(seq_lens[s]))
        values = context_loop(value_cache, block_tables[s], int(seq_lens[s]))
        for h in range(num_heads):
            out[s, h] = attention_loop(query[s, h], keys[:, h // group], values[:, h // group],
                                       len(keys), scale)
    return out.to(query.dtype)


def prefill_loop(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale):
    num_heads = query.shape[1]
    group = num_heads // key_cache.shape[2]
    out = torch.empty(query.shape, dtype=torch.float64)
    for s, seq_len in enumerate(seq_lens.tolist()):
        start, end = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
        keys = context_loop(key_cache, block_tables[s], seq_len)
        values = context_loop(value_cache, block_tables[s], seq_len)
        for i, token in enumerate(range(start, end)):
            position = seq_len - (end - start) + i
            for h in range(num_heads):
                out[token, h] = attention_loop(query[token, h], keys[:, h // group],
                                               values[:, h // group], position + 1, scale)
    return out.to(query.dtype)


def prefill_inputs(chunks, block_size, num_heads, num_kv_heads, head_dim, dtype, device):
    seq_lens = [seq_len for _, seq_len in chunks]
    key_cache, value_cache, block_tables = make_paged_kv(
        seq_lens, block_size, num_kv_heads, head_dim, dtype, device)
    cu_seqlens_q = torch.tensor([0] + [q for q, _ in chunks]).cumsum(0).int().to(device)
    query = randn(int(cu_seqlens_q[-1]), num_heads, head_dim, dtype=dtype, device=device)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens


def decode_inputs(lens, block_size, num_heads, num_kv_heads, head_dim, dtype, device):
    key_cache, value_cache, block_tables = make_paged_kv(
        lens, block_size, num_kv_heads, head_dim, dtype, device)
    query = randn(len(lens), num_heads, head_dim, dtype=dtype, device=device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return query, key_cache, value_cache, block_tables, seq_lens
