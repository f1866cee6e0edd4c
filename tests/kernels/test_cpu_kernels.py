"""The C++ CPU kernels (kernels/csrc) against their references and the per-token loops
(the spec in ``paged_kv_spec.py``): attention, the fused layers, the KV store and sampling,
and the extension's build and load.
"""

from __future__ import annotations

import os

import pytest
import torch
import triton_interpreter  # noqa: F401  NOTE: before pdserve.kernels, see its docstring
from paged_kv_spec import (
    GQA,
    PREFILL_CHUNKS,
    assert_close,
    decode_inputs,
    decode_loop,
    prefill_inputs,
    prefill_loop,
    randn,
)

from pdserve.kernels import cpu_ext, kv_store, layers
from pdserve.kernels import paged_decode_attention as decode
from pdserve.kernels import paged_prefill_attention as prefill

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
