"""Sliding-window attention and logit soft-capping in the attention kernels: the
references against per-token loops (the spec: transformers' ``kv_idx > q_idx - window``
and Gemma 2's ``softcap * tanh(score / softcap)``), and the Triton (interpreter or GPU)
and C++ kernels against the references, with block table entries before the window
set to -1 (freed blocks, which no kernel may read).
"""

from __future__ import annotations

import os

import pytest
import torch
from test_kernels import (  # NOTE: imports triton_interpreter before pdserve.kernels
    DEVICES,
    assert_close,
    context_loop,
    decode_inputs,
    prefill_inputs,
)

from pdserve.kernels import cpu_ext
from pdserve.kernels import paged_decode_attention as decode
from pdserve.kernels import paged_prefill_attention as prefill

# (sliding_window, softcap): window shorter than a block, ending mid-block, exactly a
# block, longer than some contexts; soft-capping alone and with a window.
CASES = [(1, None), (5, None), (16, None), (33, None), (None, 5.0), (7, 2.0)]
DECODE_LENS = [1, 17, 32, 70]
PREFILL_CHUNKS = [(5, 5), (7, 40), (1, 19), (0, 16), (20, 20), (30, 75)]
CPU_KERNELS = pytest.mark.skipif(
    os.environ.get("PDSERVE_REQUIRE_CPU_KERNELS") != "1" and not cpu_ext.load(),
    reason="the C++ CPU kernels did not build here (no g++/ninja?)")


def attention_loop(q, keys, values, position, scale, window, softcap):
    """One query head at ``position``: softmax over keys j <= position (and j > position -
    window), of q . k_j * scale soft-capped, in float64."""
    first = 0 if window is None else max(0, position - window + 1)
    k, v = keys[first:position + 1].double(), values[first:position + 1].double()
    scores = (k @ q.double()) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    return torch.softmax(scores, dim=0) @ v


def decode_loop(query, key_cache, value_cache, block_tables, seq_lens, scale, window, softcap):
    group = query.shape[1] // key_cache.shape[2]
    out = torch.empty(query.shape, dtype=torch.float64)
    for s, n in enumerate(seq_lens.tolist()):
        keys = context_loop(key_cache, block_tables[s], n)
        values = context_loop(value_cache, block_tables[s], n)
        for h in range(query.shape[1]):
            out[s, h] = attention_loop(query[s, h], keys[:, h // group], values[:, h // group],
                                       n - 1, scale, window, softcap)
    return out.to(query.dtype)


def prefill_loop(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                 window, softcap):
    group = query.shape[1] // key_cache.shape[2]
    out = torch.empty(query.shape, dtype=torch.float64)
    for s, n in enumerate(seq_lens.tolist()):
        start, end = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
        keys = context_loop(key_cache, block_tables[s], n)
        values = context_loop(value_cache, block_tables[s], n)
        for i, token in enumerate(range(start, end)):
            for h in range(query.shape[1]):
                out[token, h] = attention_loop(query[token, h], keys[:, h // group],
                                               values[:, h // group], n - (end - start) + i,
                                               scale, window, softcap)
    return out.to(query.dtype)


def free_before_window(block_tables, seq_lens, q_lens, block_size, window):
    """The tables with -1 for every block before the first window of each sequence's
    queries (blocks the KV cache manager may free)."""
    tables = block_tables.clone()
    if window is None:
        return tables
    for s, (n, q_len) in enumerate(zip(seq_lens.tolist(), q_lens)):
        first_seen = max(0, n - q_len - window + 1)
        tables[s, :first_seen // block_size] = -1
    return tables


@pytest.mark.parametrize("window,softcap", CASES)
def test_references_are_the_per_token_loops(window, softcap):
    args = decode_inputs(DECODE_LENS, 16, 4, 2, 32, torch.float32, "cpu")
    expected = decode_loop(*args, 0.3, window, softcap)
    assert_close(decode.paged_decode_attention_ref(*args, 0.3, window, softcap), expected)
    args = prefill_inputs(PREFILL_CHUNKS, 16, 8, 2, 32, torch.float32, "cpu")
    expected = prefill_loop(*args, 0.3, window, softcap)
    assert_close(prefill.paged_prefill_attention_ref(*args, 0.3, window, softcap), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", CASES)
def test_triton_decode(window, softcap, dtype, device):
    query, key_cache, value_cache, tables, seq_lens = decode_inputs(
        DECODE_LENS, 16, 4, 2, 64, dtype, device)
    expected = decode.paged_decode_attention_ref(query, key_cache, value_cache, tables,
                                                 seq_lens, 0.125, window, softcap)
    freed = free_before_window(tables, seq_lens, [1] * len(DECODE_LENS), 16, window)
    args = (query, key_cache, value_cache, freed, seq_lens, 0.125)
    assert_close(decode.paged_decode_attention_triton(*args, window, softcap), expected)
    # split-K: 3 partitions, some of them wholly before the window
    assert_close(decode._run_decode(*args, num_splits=3, block_n=16, sliding_window=window,
                                    softcap=softcap), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", CASES)
def test_triton_prefill(window, softcap, dtype, device):
    query, key_cache, value_cache, tables, cu, seq_lens = prefill_inputs(
        PREFILL_CHUNKS, 16, 8, 2, 64, dtype, device)
    expected = prefill.paged_prefill_attention_ref(query, key_cache, value_cache, tables, cu,
                                                   seq_lens, 0.125, window, softcap)
    freed = free_before_window(tables, seq_lens, [q for q, _ in PREFILL_CHUNKS], 16, window)
    args = (query, key_cache, value_cache, freed, cu, seq_lens, 0.125)
    assert_close(prefill.paged_prefill_attention_triton(*args, window, softcap), expected)
    # small tiles: rows of one tile whose windows start in different key tiles
    assert_close(prefill._run_prefill(*args, block_m=16, block_n=16, sliding_window=window,
                                      softcap=softcap), expected)


@CPU_KERNELS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window,softcap", CASES)
def test_cpu_decode(window, softcap, dtype):
    query, key_cache, value_cache, tables, seq_lens = decode_inputs(
        DECODE_LENS * 3, 16, 4, 2, 64, dtype, "cpu")  # 12 sequences: per-sequence tasks too
    expected = decode.paged_decode_attention_ref(query, key_cache, value_cache, tables,
                                                 seq_lens, 0.125, window, softcap)
    freed = free_before_window(tables, seq_lens, [1] * seq_lens.shape[0], 16, window)
    actual = decode.paged_decode_attention_cpu(query, key_cache, value_cache, freed, seq_lens,
                                               0.125, window, softcap)
    assert_close(actual, expected)


@CPU_KERNELS
@pytest.mark.skipif(not cpu_ext.has_prefill_attention(), reason="needs AVX512-BF16")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window,softcap", CASES)
def test_cpu_prefill(window, softcap, head_dim):
    query, key_cache, value_cache, tables, cu, seq_lens = prefill_inputs(
        PREFILL_CHUNKS, 16, 8, 2, head_dim, torch.bfloat16, "cpu")
    expected = prefill.paged_prefill_attention_ref(query, key_cache, value_cache, tables, cu,
                                                   seq_lens, 0.125, window, softcap)
    freed = free_before_window(tables, seq_lens, [q for q, _ in PREFILL_CHUNKS], 16, window)
    actual = prefill.paged_prefill_attention_cpu(query, key_cache, value_cache, freed, cu,
                                                 seq_lens, 0.125, window, softcap)
    assert_close(actual, expected)


@CPU_KERNELS
def test_cpu_kernels_refuse_a_negative_window():
    args = decode_inputs([5], 16, 4, 2, 64, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="sliding_window"):
        decode.paged_decode_attention_cpu(*args, 0.125, -1, None)
