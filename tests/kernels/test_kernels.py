"""Kernels against their references, and the references against per-token loops (the spec).

The Triton kernels run on "cpu" under triton's interpreter (``TRITON_INTERPRET=1``, set by
``triton_interpreter.py`` when there is no GPU) and on "cuda" when a GPU is lent; shapes
are tiny because the interpreter runs each program in Python.
"""

from __future__ import annotations

import os

import pytest
import torch
from triton_interpreter import HAS_CUDA, device_params  # NOTE: before pdserve.kernels

from pdserve.kernels import block_copy, cpu_ext, kv_store, layers
from pdserve.kernels import paged_decode_attention as decode
from pdserve.kernels import paged_prefill_attention as prefill
from pdserve.kernels._triton_utils import HAS_TRITON

DEVICES = device_params()
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


@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
def test_decode_ref_is_the_per_token_loop(num_heads, num_kv_heads):
    args = decode_inputs(DECODE_LENS, 16, num_heads, num_kv_heads, 32, torch.float32, "cpu")
    expected = decode_loop(*args, scale=0.3)
    assert_close(decode.paged_decode_attention_ref(*args, scale=0.3), expected)


@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
def test_prefill_ref_is_the_per_token_loop(num_heads, num_kv_heads):
    args = prefill_inputs(PREFILL_CHUNKS, 16, num_heads, num_kv_heads, 32, torch.float32, "cpu")
    expected = prefill_loop(*args, scale=0.3)
    assert_close(prefill.paged_prefill_attention_ref(*args, scale=0.3), expected)


def test_prefill_of_one_token_chunks_is_decode():
    query, key_cache, value_cache, block_tables, seq_lens = decode_inputs(
        DECODE_LENS, 16, 4, 2, 32, torch.float32, "cpu")
    cu_seqlens_q = torch.arange(len(DECODE_LENS) + 1, dtype=torch.int32)
    expected = decode.paged_decode_attention_ref(
        query, key_cache, value_cache, block_tables, seq_lens, 0.3)
    actual = prefill.paged_prefill_attention_ref(
        query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, 0.3)
    assert_close(actual, expected)


def test_store_kv_ref_is_the_per_token_loop():
    key_cache = torch.zeros(4, 16, 2, 8)
    value_cache = torch.zeros(4, 16, 2, 8)
    key, value = randn(5, 2, 8, seed=1), randn(5, 2, 8, seed=2)
    slot_mapping = torch.tensor([35, -1, 0, 63, 17])
    kv_store.store_kv_ref(key, value, key_cache, value_cache, slot_mapping)
    expected_k, expected_v = torch.zeros(4, 16, 2, 8), torch.zeros(4, 16, 2, 8)
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            expected_k[slot // 16, slot % 16] = key[token]
            expected_v[slot // 16, slot % 16] = value[token]
    torch.testing.assert_close(key_cache, expected_k, rtol=0, atol=0)
    torch.testing.assert_close(value_cache, expected_v, rtol=0, atol=0)


def test_block_copy_refs_are_the_per_block_loop():
    kv_cache = randn(2, 2, 6, 4, 2, 8)
    block_ids = torch.tensor([4, 0, 5])
    packed = block_copy.gather_blocks_ref(kv_cache, block_ids)
    for i, block in enumerate(block_ids.tolist()):
        torch.testing.assert_close(packed[:, :, i], kv_cache[:, :, block], rtol=0, atol=0)
    target = torch.zeros_like(kv_cache)
    block_copy.scatter_blocks_ref(target, torch.tensor([1, 3, 2]), packed)
    for i, block in enumerate([1, 3, 2]):
        torch.testing.assert_close(target[:, :, block], packed[:, :, i], rtol=0, atol=0)
    assert target[:, :, [0, 4, 5]].abs().sum() == 0


# ---- Triton against the references --------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_decode_attention(block_size, num_heads, num_kv_heads, head_dim, dtype, device):
    args = decode_inputs(DECODE_LENS, block_size, num_heads, num_kv_heads, head_dim, dtype,
                         device)
    scale = head_dim**-0.5
    expected = decode.paged_decode_attention_ref(*args, scale)
    assert_close(decode.paged_decode_attention_triton(*args, scale), expected)
    # Split-K: 3 partitions of 32 or 64 tokens; some sequences leave partitions empty.
    assert_close(decode._run_decode(*args, scale, num_splits=3, block_n=16), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [16, 32, 80, 256])
def test_paged_decode_attention_other_head_dims(head_dim, device):
    args = decode_inputs([3, 40], 16, 4, 1, head_dim, torch.float32, device)
    expected = decode.paged_decode_attention_ref(*args, 0.1)
    assert_close(decode.paged_decode_attention_triton(*args, 0.1), expected)
    assert_close(decode._run_decode(*args, 0.1, num_splits=2), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_paged_decode_attention_empty_and_single_token(device):
    args = decode_inputs([1], 16, 4, 2, 64, torch.bfloat16, device)
    expected = decode.paged_decode_attention_ref(*args, 0.125)
    assert_close(decode.paged_decode_attention_triton(*args, 0.125), expected)
    # A single token attends only to itself: the output is its value row.
    value_cache, block_tables = args[2], args[3]
    own_value = value_cache[int(block_tables[0, 0]), 0].repeat_interleave(2, dim=0)
    assert_close(expected[0], own_value)
    query, key_cache, _, _, _ = args
    empty = decode.paged_decode_attention_triton(
        query[:0], key_cache, value_cache, block_tables[:0], args[4][:0], 0.125)
    assert empty.shape == (0, 4, 64)


@pytest.mark.parametrize("device", DEVICES)
def test_table_entries_past_the_context_are_never_read(device):
    """-1 padding in block tables (nano-vllm's convention) is ignored by the kernels.

    NOTE: the decode reference gathers every row's first max-length blocks, so it needs
    valid ids there; it gets the same tables with the padding replaced by block 0.
    """
    args = list(decode_inputs([3, 40], 16, 4, 2, 32, torch.float32, device))
    padded = args[3].clone()
    padded[0, 1:] = -1  # the 3-token sequence uses only its first block
    padded[1, 3:] = -1
    expected = decode.paged_decode_attention_ref(*args[:3], padded.clamp(min=0), args[4], 0.2)
    assert_close(decode.paged_decode_attention_triton(*args[:3], padded, args[4], 0.2), expected)
    assert_close(decode._run_decode(*args[:3], padded, args[4], 0.2, num_splits=2), expected)
    args = list(prefill_inputs([(3, 3), (4, 40)], 16, 4, 2, 32, torch.float32, device))
    args[3] = padded
    assert_close(prefill.paged_prefill_attention_triton(*args, 0.2),
                 prefill.paged_prefill_attention_ref(*args, 0.2))


def test_choose_num_splits_fills_the_gpu_without_tiny_partitions():
    # The docstring's worked example: 132 SMs, 8 kv heads, 8192-token tables.
    assert decode._choose_num_splits(64, 8, 8192, num_sms=132) == 2
    assert decode._choose_num_splits(16, 8, 8192, num_sms=132) == 5
    assert decode._choose_num_splits(1, 8, 8192, num_sms=132) == 16
    assert decode._choose_num_splits(128, 8, 8192, num_sms=132) == 1
    assert decode._choose_num_splits(1, 8, 300, num_sms=132) == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_prefill_attention(block_size, num_heads, num_kv_heads, head_dim, dtype, device):
    args = prefill_inputs(PREFILL_CHUNKS, block_size, num_heads, num_kv_heads, head_dim, dtype,
                          device)
    scale = head_dim**-0.5
    expected = prefill.paged_prefill_attention_ref(*args, scale)
    assert_close(prefill.paged_prefill_attention_triton(*args, scale), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [*GQA, (6, 2)])
def test_paged_prefill_attention_small_tiles(num_heads, num_kv_heads, device):
    """Several query tiles per chunk and key tiles per span: the tile search and the causal
    edge inside a tile."""
    args = prefill_inputs(PREFILL_CHUNKS, 16, num_heads, num_kv_heads, 32, torch.float32,
                          device)
    expected = prefill.paged_prefill_attention_ref(*args, 0.2)
    assert_close(prefill._run_prefill(*args, 0.2, block_m=16, block_n=16), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [16, 80, 256])
def test_paged_prefill_attention_other_head_dims(head_dim, device):
    args = prefill_inputs([(3, 3), (4, 21)], 16, 4, 2, head_dim, torch.float32, device)
    expected = prefill.paged_prefill_attention_ref(*args, 0.1)
    assert_close(prefill.paged_prefill_attention_triton(*args, 0.1), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_paged_prefill_attention_empty(device):
    query, key_cache, value_cache, block_tables, _, _ = prefill_inputs(
        [(0, 16), (0, 5)], 16, 4, 2, 64, torch.bfloat16, device)
    cu_seqlens_q = torch.zeros(3, dtype=torch.int32, device=device)
    seq_lens = torch.tensor([16, 5], dtype=torch.int32, device=device)
    out = prefill.paged_prefill_attention_triton(
        query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, 0.1)
    assert out.shape == (0, 4, 64)
    out = prefill.paged_prefill_attention_triton(
        query, key_cache, value_cache, block_tables[:0], cu_seqlens_q[:1], seq_lens[:0], 0.1)
    assert out.shape == (0, 4, 64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_store_kv(block_size, head_dim, cache_dtype, device):
    num_tokens, num_kv_heads = 6, 2
    key_cache = randn(5, block_size, num_kv_heads, head_dim, dtype=cache_dtype, device=device)
    value_cache = randn(5, block_size, num_kv_heads, head_dim, dtype=cache_dtype,
                        device=device, seed=2)
    # K and V as views into one fused projection output: token stride 3 * row.
    qkv = randn(num_tokens, 3 * num_kv_heads, head_dim, dtype=cache_dtype, device=device)
    key, value = qkv[:, num_kv_heads:2 * num_kv_heads], qkv[:, 2 * num_kv_heads:]
    last = 5 * block_size - 1
    slot_mapping = torch.tensor([block_size + 3, -1, 0, last, 2 * block_size - 1, -1],
                                device=device)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    kv_store.store_kv_ref(key, value, expected_k, expected_v, slot_mapping)
    kv_store.store_kv_triton(key, value, key_cache, value_cache, slot_mapping.int())
    torch.testing.assert_close(key_cache, expected_k, rtol=0, atol=0)
    torch.testing.assert_close(value_cache, expected_v, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_store_kv_casts_to_the_cache_dtype_and_skips_empty(device):
    key_cache = torch.zeros(2, 16, 2, 32, dtype=torch.bfloat16, device=device)
    value_cache = torch.zeros_like(key_cache)
    key, value = randn(3, 2, 32, device=device), randn(3, 2, 32, device=device, seed=3)
    slot_mapping = torch.tensor([5, -1, 20], device=device)
    kv_store.store_kv_triton(key, value, key_cache, value_cache, slot_mapping)
    expected_k, expected_v = torch.zeros_like(key_cache), torch.zeros_like(value_cache)
    kv_store.store_kv_ref(key, value, expected_k, expected_v, slot_mapping)
    # NOTE: the interpreter rounds fp32 -> bf16 toward zero, the GPU to nearest: 1 ulp.
    torch.testing.assert_close(key_cache, expected_k, rtol=1e-2, atol=0)
    torch.testing.assert_close(value_cache, expected_v, rtol=1e-2, atol=0)
    kv_store.store_kv_triton(key[:0], value[:0], key_cache, value_cache, slot_mapping[:0])
    torch.testing.assert_close(key_cache, expected_k, rtol=1e-2, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_gather_and_scatter_blocks(block_size, dtype, device):
    kv_cache = randn(2, 2, 7, block_size, 2, 64, dtype=dtype, device=device)
    block_ids = torch.tensor([5, 0, 3, 6], device=device)
    packed = block_copy.gather_blocks_triton(kv_cache, block_ids)
    torch.testing.assert_close(packed, block_copy.gather_blocks_ref(kv_cache, block_ids),
                               rtol=0, atol=0)
    assert packed.is_contiguous() and packed.shape == (2, 2, 4, block_size, 2, 64)
    src = randn(*packed.shape, dtype=dtype, device=device, seed=5)
    expected = kv_cache.clone()
    block_copy.scatter_blocks_ref(expected, block_ids.flip(0), src)
    block_copy.scatter_blocks_triton(kv_cache, block_ids.flip(0), src)
    torch.testing.assert_close(kv_cache, expected, rtol=0, atol=0)
    empty = block_copy.gather_blocks_triton(kv_cache, block_ids[:0])
    assert empty.shape == (2, 2, 0, block_size, 2, 64)
    block_copy.scatter_blocks_triton(kv_cache, block_ids[:0], empty)
    torch.testing.assert_close(kv_cache, expected, rtol=0, atol=0)


# ---- argument checks and dispatch ----------------------------------------------------


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_wrappers_name_the_bad_argument():
    query, key_cache, value_cache, block_tables, seq_lens = decode_inputs(
        [3], 16, 4, 2, 32, torch.float32, "cpu")
    with pytest.raises(ValueError, match="seq_lens"):
        decode.paged_decode_attention_triton(query, key_cache, value_cache, block_tables,
                                             seq_lens.float(), 0.1)
    with pytest.raises(ValueError, match="value_cache"):
        decode.paged_decode_attention_triton(query, key_cache, value_cache[..., :16],
                                             block_tables, seq_lens, 0.1)
    with pytest.raises(ValueError, match="key_cache: 2 kv heads"):
        decode.paged_decode_attention_triton(query[:, :3], key_cache, value_cache,
                                             block_tables, seq_lens, 0.1)
    with pytest.raises(ValueError, match="query: last 1 dims must be contiguous"):
        decode.paged_decode_attention_triton(randn(1, 4, 64)[..., ::2], key_cache, value_cache,
                                             block_tables, seq_lens, 0.1)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        prefill.paged_prefill_attention_triton(query, key_cache, value_cache, block_tables,
                                               torch.tensor([0, 1, 1]), seq_lens, 0.1)
    with pytest.raises(ValueError, match="slot_mapping"):
        kv_store.store_kv_triton(query[:, :2], query[:, :2], key_cache, value_cache,
                                 torch.tensor([0.0]))
    with pytest.raises(ValueError, match="key_cache"):
        kv_store.store_kv_triton(query[:, :2], query[:, :2], key_cache.transpose(0, 1),
                                 value_cache, torch.tensor([0]))
    with pytest.raises(ValueError, match="src"):
        block_copy.scatter_blocks_triton(randn(1, 2, 3, 4, 2, 8), torch.tensor([0]),
                                         randn(1, 2, 2, 4, 2, 8))


def test_dispatch_on_cpu_is_the_cpu_kernel_or_the_reference(monkeypatch):
    args = decode_inputs(DECODE_LENS, 16, 4, 2, 32, torch.float32, "cpu")
    expected = (decode.paged_decode_attention_cpu(*args, 0.3) if cpu_ext.load()
                else decode.paged_decode_attention_ref(*args, 0.3))
    torch.testing.assert_close(decode.paged_decode_attention(*args, 0.3), expected,
                               rtol=0, atol=0)
    monkeypatch.setattr(cpu_ext, "_loaded", False)  # as where the build failed
    torch.testing.assert_close(decode.paged_decode_attention(*args, 0.3),
                               decode.paged_decode_attention_ref(*args, 0.3), rtol=0, atol=0)
    args = prefill_inputs(PREFILL_CHUNKS, 16, 4, 2, 32, torch.float32, "cpu")
    torch.testing.assert_close(prefill.paged_prefill_attention(*args, 0.3),
                               prefill.paged_prefill_attention_ref(*args, 0.3), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("context", [600, 3000])
@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_dispatch_on_cuda_is_triton(context, batch, dtype):
    """Through the engine's entry points on a GPU, at lengths where split-K kicks in."""
    lens = [context - 7 * i for i in range(batch)]
    args = decode_inputs(lens, 16, 32, 8, 128, dtype, "cuda")
    cpu_args = [a.cpu() for a in args]
    assert_close(decode.paged_decode_attention(*args, 0.088),
                 decode.paged_decode_attention_ref(*cpu_args, 0.088))
    chunks = [(min(100, n), n) for n in lens]
    args = prefill_inputs(chunks, 16, 32, 8, 128, dtype, "cuda")
    cpu_args = [a.cpu() for a in args]
    assert_close(prefill.paged_prefill_attention(*args, 0.088),
                 prefill.paged_prefill_attention_ref(*cpu_args, 0.088))
    key, value = args[0][:, :8], args[0][:, 8:16]
    key_cache, value_cache = args[1], args[2]
    slot_mapping = torch.arange(key.shape[0], device="cuda") * 3
    expected_k, expected_v = key_cache.cpu(), value_cache.cpu()
    kv_store.store_kv_ref(key.cpu(), value.cpu(), expected_k, expected_v, slot_mapping.cpu())
    kv_store.store_kv(key, value, key_cache, value_cache, slot_mapping)
    torch.testing.assert_close(key_cache.cpu(), expected_k, rtol=0, atol=0)
    torch.testing.assert_close(value_cache.cpu(), expected_v, rtol=0, atol=0)
    kv_cache = torch.stack([key_cache, value_cache])[None]  # [1, 2, N, B, H_kv, D]
    block_ids = torch.randperm(kv_cache.shape[2], device="cuda")[:5]
    packed = block_copy.gather_blocks(kv_cache, block_ids)
    torch.testing.assert_close(packed.cpu(), kv_cache.cpu()[:, :, block_ids.cpu()],
                               rtol=0, atol=0)
    block_copy.scatter_blocks(kv_cache, block_ids.flip(0), packed)
    torch.testing.assert_close(kv_cache[:, :, block_ids.flip(0)], packed, rtol=0, atol=0)


def test_decode_reference_ignores_minus_one_padding_in_block_tables():
    from pdserve.kernels.paged_decode_attention import paged_decode_attention_ref

    gen = torch.Generator().manual_seed(0)
    key_cache, value_cache = torch.randn(2, 8, 4, 2, 16, generator=gen)
    query = torch.randn(2, 4, 16, generator=gen)
    seq_lens = torch.tensor([6, 11], dtype=torch.int32)
    padded = torch.tensor([[1, 2, -1], [3, 4, 5]], dtype=torch.int32)
    other = torch.tensor([[1, 2, 7], [3, 4, 5]], dtype=torch.int32)
    torch.testing.assert_close(
        paged_decode_attention_ref(query, key_cache, value_cache, padded, seq_lens, 0.25),
        paged_decode_attention_ref(query, key_cache, value_cache, other, seq_lens, 0.25))


# ---- the C++ CPU kernels (kernels/csrc) -----------------------------------------------

# NOTE: .ci/run sets PDSERVE_REQUIRE_CPU_KERNELS=1, so a failed build fails there rather
# than skipping; elsewhere (no compiler) these tests skip and the references serve.
CPU_KERNELS = pytest.mark.skipif(
    os.environ.get("PDSERVE_REQUIRE_CPU_KERNELS") != "1" and not cpu_ext.load(),
    reason="the C++ CPU kernels did not build here (no g++/ninja?)")


@CPU_KERNELS
def test_cpu_kernels_build():
    assert cpu_ext.load(), "kernels/csrc did not build; see the warning logged by cpu_ext"


@CPU_KERNELS
def test_a_build_killed_midway_hangs_no_later_load():
    """torch's build lock (a file it deletes when its build ends), left by a build that
    was killed, made every later load wait forever; now a fresh process removes it and
    loads. And a process that holds the build folder (building) makes another wait for
    it, then load."""
    import fcntl
    import subprocess
    import sys
    import time
    from pathlib import Path

    from torch.utils import cpp_extension

    cpu_ext.load()  # NOTE: built and loaded here first: the subprocesses only load
    folder = Path(cpp_extension._get_build_directory(cpu_ext._extension_name(), verbose=False))
    loader = [sys.executable, "-c", "from pdserve.kernels import cpu_ext; print(cpu_ext.load())"]
    (folder / "lock").touch()
    try:
        left = subprocess.run(loader, capture_output=True, text=True, timeout=120,
                              check=False)
    finally:
        lock_left = (folder / "lock").exists()
        (folder / "lock").unlink(missing_ok=True)
    assert left.stdout.strip() == "True" and not lock_left, left.stderr[-2000:]
    assert "left by a build that did not finish" in left.stderr
    with open(folder / "pdserve.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        waiting = subprocess.Popen(loader, stdout=subprocess.PIPE, text=True)
        time.sleep(3.0)
        assert waiting.poll() is None  # it waits for the folder
        fcntl.flock(held, fcntl.LOCK_UN)
    out, _ = waiting.communicate(timeout=120)
    assert out.strip() == "True"


@CPU_KERNELS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 64, 80, 128, 256])
@pytest.mark.parametrize("num_heads,num_kv_heads", [*GQA, (6, 2), (4, 4)])
@pytest.mark.parametrize("num_seqs", [2, 40])  # tasks per (seq, kv head), then per seq
def test_paged_decode_attention_cpu_is_the_per_token_loop(num_seqs, num_heads, num_kv_heads,
                                                          head_dim, dtype):
    lens = [(7 * i + 1) % 70 + 1 for i in range(num_seqs)]  # 1 .. 70 tokens
    query, key_cache, value_cache, block_tables, seq_lens = decode_inputs(
        lens, 16, num_heads, num_kv_heads, head_dim, dtype, "cpu")
    # A strided query (a view of the fused qkv projection's output, as in the model).
    wide = torch.zeros(num_seqs, num_heads, 2 * head_dim, dtype=dtype)
    wide[..., :head_dim] = query
    query = wide[..., :head_dim]
    scale = head_dim**-0.5
    actual = decode.paged_decode_attention_cpu(query, key_cache, value_cache, block_tables,
                                               seq_lens, scale)
    assert_close(actual, decode_loop(query, key_cache, value_cache, block_tables, seq_lens,
                                     scale))
    assert_close(decode.paged_decode_attention(query, key_cache, value_cache, block_tables,
                                               seq_lens, scale), actual)


@CPU_KERNELS
@pytest.mark.parametrize("block_size", [1, 5, 32])
def test_paged_decode_attention_cpu_block_sizes_padding_and_int64_tables(block_size):
    query, key_cache, value_cache, block_tables, seq_lens = decode_inputs(
        [1, 3, 40, 65], block_size, 8, 2, 64, torch.bfloat16, "cpu")
    padded = block_tables.long().clone()
    for row, n in enumerate(seq_lens.tolist()):
        padded[row, -(-n // block_size):] = -1  # never read: past the context
    expected = decode_loop(query, key_cache, value_cache, block_tables, seq_lens, 0.125)
    assert_close(decode.paged_decode_attention_cpu(query, key_cache, value_cache, padded,
                                                   seq_lens, 0.125), expected)
    # A single token attends only to itself: the output is its value row.
    own_value = value_cache[int(block_tables[0, 0]), 0].repeat_interleave(4, dim=0)
    assert_close(expected[0], own_value)
    empty = decode.paged_decode_attention_cpu(query[:0], key_cache, value_cache, padded[:0],
                                              seq_lens[:0], 0.125)
    assert empty.shape == (0, 8, 64)


@CPU_KERNELS
def test_paged_decode_attention_cpu_rejects_what_would_read_out_of_bounds():
    query, key_cache, value_cache, block_tables, seq_lens = decode_inputs(
        [3, 40], 16, 4, 2, 64, torch.float32, "cpu")
    too_long = seq_lens.clone()
    too_long[1] = block_tables.shape[1] * 16 + 1
    with pytest.raises(RuntimeError, match=r"seq_lens\[1\]"):
        decode.paged_decode_attention_cpu(query, key_cache, value_cache, block_tables,
                                          too_long, 0.1)
    bad_block = block_tables.clone()
    bad_block[1, 2] = key_cache.shape[0]
    with pytest.raises(RuntimeError, match=r"block_tables\[1, 2\]"):
        decode.paged_decode_attention_cpu(query, key_cache, value_cache, bad_block, seq_lens,
                                          0.1)
    with pytest.raises(RuntimeError, match="the caches must have the query's dtype"):
        decode.paged_decode_attention_cpu(query, key_cache, value_cache.half(), block_tables,
                                          seq_lens, 0.1)


@CPU_KERNELS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 37, 300])  # one thread, then several
def test_fused_cpu_layers_equal_their_references(num_tokens, dtype):
    """The C++ layers round where the references round: bf16/fp16 results are equal up to
    the order of fp32 sums (RMSNorm's statistic), fp32 results to ~1 ulp."""
    exact = {"rtol": 0, "atol": 0} if dtype != torch.float32 else {"rtol": 1e-6, "atol": 1e-6}
    near = {"rtol": 1e-2, "atol": 1e-2} if dtype != torch.float32 else exact
    hidden, weight = randn(num_tokens, 96, dtype=dtype), randn(96, dtype=dtype, seed=2)
    torch.testing.assert_close(layers.rms_norm(hidden, weight, 1e-6),
                               layers.rms_norm_ref(hidden, weight, 1e-6), **near)
    residual = randn(num_tokens, 96, dtype=dtype, seed=3)
    expected_sum = hidden + residual
    normed, summed = layers.fused_add_rms_norm(hidden.clone(), residual.clone(), weight, 1e-6)
    torch.testing.assert_close(summed, expected_sum, **exact)
    torch.testing.assert_close(normed, layers.rms_norm_ref(expected_sum, weight, 1e-6), **near)
    # gate values from -100 to 100: exp's clamps and the sigmoid's tails
    gate_up = randn(num_tokens, 2 * 80, dtype=dtype, seed=4) * 30
    # NOTE: far in the sigmoid's tail (|silu| < 1e-30) the vectorised exp of some CPUs
    # rounds differently from torch's; everything above that must be equal
    tails = {**exact, "atol": 1e-30}
    torch.testing.assert_close(layers.silu_and_mul(gate_up), layers.silu_and_mul_ref(gate_up),
                               **tails)
    # q and k as strided views of one fused qkv output, rotated in place
    qkv = randn(num_tokens, (4 + 2 + 2) * 32, dtype=dtype, seed=5)
    cos, sin = randn(num_tokens, 32, dtype=dtype, seed=6), randn(num_tokens, 32, dtype=dtype, seed=7)
    q, k = qkv[:, :128].view(num_tokens, 4, 32), qkv[:, 128:192].view(num_tokens, 2, 32)
    q_ref, k_ref = layers.rotary_embedding_ref(q, k, cos, sin)
    q_out, k_out = layers.rotary_embedding(q, k, cos, sin)
    assert q_out.data_ptr() == qkv.data_ptr()  # in place
    torch.testing.assert_close(q_out, q_ref, **exact)
    torch.testing.assert_close(k_out, k_ref, **exact)


@CPU_KERNELS
def test_fused_cpu_layers_reject_bad_shapes():
    x = torch.zeros(4, 10)
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.pdserve_cpu.rms_norm(torch.empty_like(x), x, torch.ones(9), 1e-6)
    with pytest.raises(RuntimeError, match="silu_and_mul"):
        torch.ops.pdserve_cpu.silu_and_mul(torch.empty(4, 4), x)
    with pytest.raises(RuntimeError, match="head_dim"):
        torch.ops.pdserve_cpu.rotary_embedding(torch.zeros(2, 1, 6), torch.zeros(2, 1, 6),
                                               torch.zeros(2, 4), torch.zeros(2, 4))


@CPU_KERNELS
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_kv_cpu_kernel_is_the_reference(slot_dtype):
    key_cache, value_cache = randn(6, 4, 2, 8, dtype=torch.bfloat16), randn(6, 4, 2, 8, seed=2)
    value_cache = value_cache.bfloat16()
    qkv = randn(5, 3 * 16, dtype=torch.bfloat16, seed=3)  # k and v as views of a fused qkv
    key, value = qkv[:, 16:32].view(5, 2, 8), qkv[:, 32:].view(5, 2, 8)
    slots = torch.tensor([3, -1, 23, 0, 9], dtype=slot_dtype)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    kv_store.store_kv_ref(key, value, expected_k, expected_v, slots)
    torch.ops.pdserve_cpu.store_kv(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)
    with pytest.raises(RuntimeError, match=r"slot_mapping\[2\] = 24"):
        kv_store.store_kv(key, value, key_cache, value_cache,
                          torch.tensor([3, -1, 24, 0, 9], dtype=slot_dtype))


PREFILL_CPU_KERNEL = pytest.mark.skipif(
    not cpu_ext.has_prefill_attention(),
    reason="the C++ prefill attention needs the CPU kernels built and AVX512-BF16")


@PREFILL_CPU_KERNEL
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("num_heads,num_kv_heads", [*GQA, (6, 2), (4, 4)])
@pytest.mark.parametrize("block_size", [5, 16])
def test_paged_prefill_attention_cpu_is_the_per_token_loop(block_size, num_heads,
                                                           num_kv_heads, head_dim):
    # chunks with and without a cached prefix, empty, one token, crossing blocks, > 64 keys
    chunks = [*PREFILL_CHUNKS, (33, 90), (70, 70)]
    args = prefill_inputs(chunks, block_size, num_heads, num_kv_heads, head_dim,
                          torch.bfloat16, "cpu")
    scale = head_dim**-0.5
    actual = prefill.paged_prefill_attention_cpu(*args, scale)
    assert_close(actual, prefill_loop(*args, scale))
    assert_close(prefill.paged_prefill_attention(*args, scale), actual)


@PREFILL_CPU_KERNEL
def test_paged_prefill_attention_cpu_padding_int64_tables_and_bad_input():
    query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens = prefill_inputs(
        [(3, 3), (4, 40)], 16, 4, 2, 64, torch.bfloat16, "cpu")
    padded = block_tables.long().clone()
    padded[0, 1:] = -1  # past each context: never read
    padded[1, 3:] = -1
    expected = prefill_loop(query, key_cache, value_cache, block_tables, cu_seqlens_q,
                            seq_lens, 0.2)
    assert_close(prefill.paged_prefill_attention_cpu(query, key_cache, value_cache, padded,
                                                     cu_seqlens_q, seq_lens, 0.2), expected)
    too_long = seq_lens.clone()
    too_long[1] = padded.shape[1] * 16 + 1
    with pytest.raises(RuntimeError, match="sequence 1"):
        prefill.paged_prefill_attention_cpu(query, key_cache, value_cache, padded,
                                            cu_seqlens_q, too_long, 0.2)
    bad_block = block_tables.clone()
    bad_block[1, 1] = key_cache.shape[0]
    with pytest.raises(RuntimeError, match=r"block_tables\[1, 1\]"):
        prefill.paged_prefill_attention_cpu(query, key_cache, value_cache, bad_block,
                                            cu_seqlens_q, seq_lens, 0.2)
    with pytest.raises(RuntimeError, match="bf16 only"):
        prefill.paged_prefill_attention_cpu(query.float(), key_cache.float(),
                                            value_cache.float(), block_tables, cu_seqlens_q,
                                            seq_lens, 0.2)


@CPU_KERNELS
def test_argmax_cpu_kernel_is_torch_argmax():
    x = randn(37, 1000)
    x[3, 500] = x[3].max() + 1  # ties: the first index wins, as torch
    x[3, 700] = x[3, 500]
    x[5, 10] = float("nan")  # a NaN counts as the largest
    x[5, 20] = float("nan")
    x[6] = float("-inf")
    assert torch.equal(layers.argmax(x), x.argmax(dim=-1))
    assert torch.equal(layers.argmax(x[:, :1]), torch.zeros(37, dtype=torch.int64))


@CPU_KERNELS
def test_sample_rows_cpu_kernel_draws_the_references_tokens():
    """The C++ draw and the reference (softmax, cumsum, searchsorted) give the same token
    for every row: temperatures from 0.05 to 3, masked (-inf) tokens first, last and
    inside, greedy rows (temperature 0, ties to the first index), rows with a NaN or
    nothing but -inf (the argmax), vocabularies that are and are not multiples of 64,
    and u at 0 and just below 1."""
    generator = torch.Generator().manual_seed(7)
    for vocab in (1, 5, 64, 1000, 32000):
        rows = 64
        logits = torch.randn(rows, vocab, generator=generator) * 3
        temperature = torch.rand(rows, generator=generator) * 2.95 + 0.05
        u = torch.rand(rows, generator=generator, dtype=torch.float64)
        u[0], u[1] = 0.0, 1.0 - 2.0 ** -53
        if vocab > 2:
            logits[2, 0] = logits[2, -1] = float("-inf")
            logits[3, 1::3] = float("-inf")
        temperature[4] = 0.0
        logits[4, -1] = logits[4, 0] = logits[4].max() + 1
        logits[5, vocab // 2] = float("nan")
        logits[6] = float("-inf")
        got = layers.sample_rows(logits, temperature, u)
        want = layers.sample_rows_ref(logits, temperature, u)
        assert torch.equal(got, want), (vocab, (got != want).nonzero().flatten().tolist())
        assert got[4] == 0 and got[5] == vocab // 2 and got[6] == 0
        if vocab > 2:
            assert got[2] not in (0, vocab - 1) and got[3] % 3 != 1


@CPU_KERNELS
def test_sample_rows_cpu_kernel_names_what_is_wrong():
    out, logits = torch.empty(2, dtype=torch.int64), torch.randn(2, 10)
    temperature, u = torch.ones(2), torch.rand(2, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="logits must be fp32"):
        torch.ops.pdserve_cpu.sample_rows(out, logits.double(), temperature, u)
    with pytest.raises(RuntimeError, match="temperature must be contiguous fp32 \\[rows\\]"):
        torch.ops.pdserve_cpu.sample_rows(out, logits, torch.ones(3), u)
    with pytest.raises(RuntimeError, match="u must be contiguous fp64 \\[rows\\]"):
        torch.ops.pdserve_cpu.sample_rows(out, logits, temperature, u.float())


def test_filter_rows_ref_keeps_ties_and_the_nucleus():
    """The reference on a known distribution: top-k keeps every logit tied with the k-th,
    top-p keeps the smallest set of best tokens whose mass reaches p (renormalized after
    top-k), min-p keeps p >= min_p * p_max."""
    probs = torch.tensor([0.4, 0.2, 0.2, 0.1, 0.06, 0.04])
    logits = probs.log().repeat(4, 1)
    kept = layers.filter_rows_ref(
        logits, min_p=torch.tensor([0.0, 0.0, 0.2, 0.0]), top_k=torch.tensor([2, 0, 0, 3]),
        top_p=torch.tensor([1.0, 0.7, 1.0, 0.8])).isfinite()
    assert kept[0].tolist() == [True, True, True, False, False, False]  # ties at the 2nd
    assert kept[1].tolist() == [True, True, True, False, False, False]  # 0.4+0.2+0.2 >= 0.7
    assert kept[2].tolist() == [True, True, True, True, False, False]  # >= 0.08
    # top-3 (0.8 of the mass), renormalized: 0.5, 0.25, 0.25; 0.8 needs all three
    assert kept[3].tolist() == [True, True, True, False, False, False]


@CPU_KERNELS
def test_filter_rows_cpu_kernel_keeps_what_the_reference_keeps():
    """Random rows (fp32 logits and bf16-rounded ones, which tie often) with every filter
    alone and together, masked tokens already in the row, rows with a NaN or nothing but
    -inf (left alone): the kernel masks exactly the reference's tokens, but where the
    nucleus's mass lies within rounding of top_p."""
    generator = torch.Generator().manual_seed(11)
    for vocab in (1, 7, 64, 1000, 32000):
        for rounded in (False, True):
            rows = 48
            logits = torch.randn(rows, vocab, generator=generator) * 2.5
            if rounded:
                logits = logits.bfloat16().float()
            if vocab > 2:
                logits[0, ::2] = float("-inf")
            logits[1, 0] = float("nan")
            logits[2] = float("-inf")
            min_p = torch.where(torch.rand(rows, generator=generator) < 0.3,
                                torch.rand(rows, generator=generator) * 0.5, 0.0)
            top_k = torch.where(torch.rand(rows, generator=generator) < 0.5,
                                torch.randint(1, vocab + 2, (rows,), generator=generator), 0)
            top_p = torch.where(torch.rand(rows, generator=generator) < 0.6,
                                torch.rand(rows, generator=generator), 1.0)
            want = layers.filter_rows_ref(logits, min_p, top_k, top_p)
            got = layers.filter_rows(logits.clone(), min_p, top_k, top_p)
            differ = (got.isfinite() != want.isfinite()).any(dim=1).nonzero().flatten()
            for r in differ.tolist():  # NOTE: only a nucleus edge within fp32 rounding
                before_top_p = layers.filter_rows_ref(logits[r:r + 1], min_p[r:r + 1],
                                                      top_k[r:r + 1], torch.ones(1))[0]
                weights = torch.exp(before_top_p - before_top_p.max())
                running = (weights.sort(descending=True).values.cumsum(0) / weights.sum())
                assert top_p[r] < 1, (vocab, rounded, r)
                assert (running - top_p[r]).abs().min() < 1e-5, (vocab, rounded, r)
            assert torch.equal(got[1:3].nan_to_num(), logits[1:3].nan_to_num())
            assert got[3:].isfinite().any(dim=1).all()  # the best token always stays
