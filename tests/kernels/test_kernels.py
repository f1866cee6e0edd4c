"""Kernels against their references, and the references against per-token loops (the spec).

The Triton kernels run on "cpu" under triton's interpreter (``TRITON_INTERPRET=1``, set by
``triton_interpreter.py`` when there is no GPU) and on "cuda" when a GPU is lent; shapes
are tiny because the interpreter runs each program in Python.
"""

from __future__ import annotations

import pytest
import torch
from paged_kv_spec import (
    DECODE_LENS,
    GQA,
    PREFILL_CHUNKS,
    assert_close,
    context_loop,  # noqa: F401  NOTE: test_window_softcap imports it from here
    decode_inputs,
    decode_loop,
    make_paged_kv,  # noqa: F401  NOTE: test_kv_quant imports it from here
    prefill_inputs,
    prefill_loop,
    randn,
)
from triton_interpreter import HAS_CUDA, device_params  # NOTE: before pdserve.kernels

from pdserve.kernels import block_copy, cpu_ext, kv_store
from pdserve.kernels import paged_decode_attention as decode
from pdserve.kernels import paged_prefill_attention as prefill
from pdserve.kernels._triton_utils import HAS_TRITON

DEVICES = device_params()


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
