"""Quantized KV caches (int8, fp8 e4m3 / e5m2; ``kernels/kv_quant.py``): the store and the
attention kernels.

The specs are plain loops: the store rule applied block by block and head by head, and
attention as "dequantize the cache, then attend per token" in float64. The references
equal the loops (the store to the byte, attention within fp32 rounding); the Triton
kernels (interpreter or GPU) and the C++ kernels equal the references. Caches here are
also laid out as the worker keeps them: values and scales inside each block's bytes.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_kernels import assert_close, make_paged_kv, randn
from test_window_softcap import decode_loop, free_before_window, prefill_loop
from triton_interpreter import device_params

from pdserve.kernels import cpu_ext, kv_store
from pdserve.kernels import paged_decode_attention as decode
from pdserve.kernels import paged_prefill_attention as prefill
from pdserve.kernels.kv_quant import QMAX, dequantize_ref, quantize_ref

DEVICES = device_params()
QUANT_DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
CPU_KERNELS = pytest.mark.skipif(
    os.environ.get("PDSERVE_REQUIRE_CPU_KERNELS") != "1" and not cpu_ext.load(),
    reason="the C++ CPU kernels did not build here (no g++/ninja?)")
CASES = [(None, None), (5, None), (33, None), (None, 5.0), (7, 2.0)]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.float32 else t


def assert_same_bytes(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.equal(as_bytes(actual.cpu()), as_bytes(expected.cpu()))


def in_block_storage(key_cache, value_cache, key_scales, value_scales, pad: int = 24):
    """The caches and scales copied into storage laid out as the worker's (each block:
    its K and V values, then its fp32 scales, then ``pad`` bytes): strided views."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    values = block_size * num_kv_heads * head_dim
    block_bytes = 2 * values + 2 * num_kv_heads * 4 + pad
    storage = torch.full((num_blocks, block_bytes), 0x5A, dtype=torch.uint8,
                         device=key_cache.device)
    caches = storage[:, :2 * values].view(key_cache.dtype).view(
        num_blocks, 2, block_size, num_kv_heads, head_dim)
    scales = storage[:, 2 * values:2 * values + 8 * num_kv_heads].view(torch.float32).view(
        num_blocks, 2, num_kv_heads)
    for i, (cache, scale) in enumerate(((key_cache, key_scales), (value_cache, value_scales))):
        caches[:, i].view(torch.uint8).copy_(cache.view(torch.uint8))
        scales[:, i].copy_(scale)
    return caches[:, 0], caches[:, 1], scales[:, 0], scales[:, 1]


def quantize_blocks(x: torch.Tensor, dtype: torch.dtype):
    """A float cache as a whole-block store would write it: (values, scales)."""
    scales = x.abs().amax(dim=(1, 3)) / QMAX[dtype]  # [num_blocks, num_kv_heads]
    return quantize_ref(x, scales[:, None, :, None], dtype), scales


def quant_kv(lens, block_size, num_kv_heads, head_dim, dtype, device):
    """Quantized K/V caches with per-(block, head) magnitudes that differ, and tables."""
    key_cache, value_cache, tables = make_paged_kv(lens, block_size, num_kv_heads, head_dim,
                                                   torch.float32, "cpu")
    magnitude = torch.rand(key_cache.shape[0], 1, num_kv_heads, 1,
                           generator=torch.Generator().manual_seed(5)) * 4 + 0.05
    kq, ks = quantize_blocks(key_cache * magnitude, dtype)
    vq, vs = quantize_blocks(value_cache * magnitude.flip(0), dtype)
    return [t.to(device) for t in (kq, vq, ks, vs)], tables.to(device)


# ---- the store -------------------------------------------------------------------------

# Steps into blocks of 8 slots: block 1 is written across three steps (its scale grows in
# the second, not in the third), then recycled (a write from slot 0 under a stale, larger
# scale); block 2 shares steps with it; tokens out of slot order and -1 padding.
STEPS = [([11, 8, 9, -1, 10, 12, 16, 17], 0.5),
         ([13, 14, 18], 4.0),
         ([15], 0.1),
         ([8, 9, 10, 11], 0.2),
         ([2, 0, 1], 1.0)]


def step_rows(i: int, num_tokens: int, magnitude: float, dtype=torch.float32):
    return (randn(num_tokens, 2, 8, seed=10 + i) * magnitude).to(dtype), \
        (randn(num_tokens, 2, 8, seed=20 + i) * magnitude).to(dtype)


def store_loop(cache, scales, rows, slots) -> None:
    """The spec, one block and head at a time."""
    block_size, qmax = cache.shape[1], QMAX[cache.dtype]
    by_block: dict[int, list[tuple[int, int]]] = {}
    for token, slot in enumerate(slots):
        if slot >= 0:
            by_block.setdefault(slot // block_size, []).append((slot % block_size, token))
    for block, writes in by_block.items():
        start = min(offset for offset, _ in writes)
        for head in range(cache.shape[2]):
            old = float(scales[block, head]) if start > 0 else 0.0
            new_rows = torch.stack([rows[t, head].float() for _, t in writes])
            new = max(torch.tensor(old), new_rows.abs().max() / qmax)
            if start > 0 and new > old:
                for r in range(start):
                    cache[block, r, head] = quantize_ref(
                        cache[block, r, head].float() * old, new, cache.dtype)
            for offset, t in writes:
                cache[block, offset, head] = quantize_ref(rows[t, head].float(), new, cache.dtype)
            scales[block, head] = new


def new_cache(dtype, block_size=8, device="cpu"):
    stale = torch.full((4, 2), 7.0)  # every block starts with a stale scale
    cache = quantize_ref(randn(4, block_size, 2, 8, seed=3) * 50, stale[:, None, :, None], dtype)
    return [cache.to(device), cache.clone().to(device), stale.to(device), stale.clone().to(device)]


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_store_ref_is_the_block_by_block_loop(dtype):
    ref, loop = new_cache(dtype), new_cache(dtype)
    history = []
    for i, (slots, magnitude) in enumerate(STEPS):
        key, value = step_rows(i, len(slots), magnitude)
        kv_store.store_kv_ref(key, value, ref[0], ref[1], torch.tensor(slots), ref[2], ref[3])
        store_loop(loop[0], loop[2], key, slots)
        store_loop(loop[1], loop[3], value, slots)
        for actual, expected in zip(ref, loop):
            assert_same_bytes(actual, expected)
        history.append((key, ref[2].clone()))
    qmax = QMAX[dtype]
    # block 1 grew in step 1 (4x larger rows), kept its scale in step 2
    grown = history[1][0][:2].abs().amax(dim=(0, 2)) / qmax
    assert torch.equal(history[1][1][1], torch.maximum(history[0][1][1], grown))
    assert torch.equal(history[2][1][1], history[1][1][1])
    # the recycled block's scale is its new rows' alone, below the stale one
    assert torch.equal(history[3][1][1], history[3][0].abs().amax(dim=(0, 2)) / qmax)
    assert (history[3][1][1] < history[2][1][1]).all()
    # what it holds reads back within half a step (int8) or fp8's relative precision
    key = history[3][0]
    stored = dequantize_ref(ref[0], ref[2])[1, :4]
    step = ref[2][1][None, :, None]
    tolerance = step / 2 if dtype == torch.int8 else key.abs() * 2.0 ** -3 + step
    assert ((stored - key).abs() <= tolerance * 1.0001).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("block_size", [8, 5])
def test_store_triton_writes_the_references_bytes(block_size, dtype, device):
    ref, triton = new_cache(dtype, block_size), new_cache(dtype, block_size, device)
    triton = list(in_block_storage(*triton))
    for i, (slots, magnitude) in enumerate(STEPS):
        slots = [s if s < 0 else (s // 8) * block_size + s % 8 % block_size for s in slots]
        slots = list(dict.fromkeys(slots))  # distinct after folding into smaller blocks
        key, value = step_rows(i, len(slots), magnitude, torch.bfloat16)
        kv_store.store_kv_ref(key, value, *ref[:2], torch.tensor(slots), *ref[2:])
        kv_store.store_kv_triton(key.to(device), value.to(device), *triton[:2],
                                 torch.tensor(slots, device=device), *triton[2:])
        for actual, expected in zip(triton, ref):
            assert_same_bytes(actual, expected)


@CPU_KERNELS
@pytest.mark.parametrize("key_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_store_cpu_kernel_writes_the_references_bytes(dtype, key_dtype):
    ref, cpu = new_cache(dtype), list(in_block_storage(*new_cache(dtype)))
    for i, (slots, magnitude) in enumerate(STEPS):
        key, value = step_rows(i, len(slots), magnitude, key_dtype)
        kv_store.store_kv_ref(key, value, *ref[:2], torch.tensor(slots), *ref[2:])
        kv_store.store_kv(key, value, *cpu[:2], torch.tensor(slots, dtype=torch.int32), *cpu[2:])
        for actual, expected in zip(cpu, ref):
            assert_same_bytes(actual, expected)
    with pytest.raises(RuntimeError, match=r"slot_mapping\[0\] = 32"):
        kv_store.store_kv(key[:1], value[:1], *cpu[:2], torch.tensor([32]), *cpu[2:])


def wide_rows(num_tokens: int, seed: int) -> torch.Tensor:
    """Rows whose magnitudes span ~14 orders within one block: quantized, they hit fp8's
    subnormals, its normal range, rounding ties and carries into the next exponent."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, 2, 8, generator=gen) * torch.exp(
        torch.randn(num_tokens, 2, 8, generator=gen) * 5)


def store_wide_rows(store, dtype, device) -> None:
    """Three steps of 32 wide-range tokens over blocks 0-3 (each rewritten from slot 0),
    by ``store`` and by the reference, whose casts are torch's: the same bytes."""
    ref, kernel = new_cache(dtype), new_cache(dtype, device=device)
    for step in range(3):
        key, value = wide_rows(32, 40 + step), wide_rows(32, 50 + step)
        slots = torch.arange(32)
        kv_store.store_kv_ref(key, value, *ref[:2], slots, *ref[2:])
        store(key.to(device), value.to(device), *kernel[:2], slots.to(device), *kernel[2:])
        for actual, expected in zip(kernel, ref):
            assert_same_bytes(actual, expected)


@CPU_KERNELS
@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_cpu_store_encodes_every_magnitude_as_torch(dtype):
    store_wide_rows(kv_store.store_kv, dtype, "cpu")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_triton_store_encodes_every_magnitude_as_torch(dtype, device):
    store_wide_rows(kv_store.store_kv_triton, dtype, device)


def test_store_refuses_missing_or_unneeded_scales():
    cache, _, scales, _ = new_cache(torch.int8)
    key = randn(1, 2, 8)
    with pytest.raises(ValueError, match="key_scales"):
        kv_store.store_kv(key, key, cache, cache.clone(), torch.tensor([0]))
    with pytest.raises(ValueError, match="key_scales"):
        kv_store.store_kv(key, key, key.new_zeros(4, 8, 2, 8), key.new_zeros(4, 8, 2, 8),
                          torch.tensor([0]), scales, scales)


# ---- attention ---------------------------------------------------------------------------

DECODE_LENS = [1, 17, 32, 70]
CHUNKS = [(5, 5), (7, 40), (1, 19), (0, 16), (30, 75)]


def decode_case(lens, num_heads, head_dim, query_dtype, dtype, device, block_size=16):
    (kq, vq, ks, vs), tables = quant_kv(lens, block_size, 2, head_dim, dtype, device)
    query = randn(len(lens), num_heads, head_dim, dtype=query_dtype, device=device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return query, kq, vq, ks, vs, tables, seq_lens


def prefill_case(chunks, num_heads, head_dim, query_dtype, dtype, device, block_size=16):
    lens = [n for _, n in chunks]
    (kq, vq, ks, vs), tables = quant_kv(lens, block_size, 2, head_dim, dtype, device)
    cu = torch.tensor([0] + [q for q, _ in chunks]).cumsum(0).int().to(device)
    query = randn(int(cu[-1]), num_heads, head_dim, dtype=query_dtype, device=device)
    return query, kq, vq, ks, vs, tables, cu, torch.tensor(lens, dtype=torch.int32,
                                                           device=device)


@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("window,softcap", CASES)
def test_references_are_dequantize_then_attend_loops(window, softcap, dtype, query_dtype):
    q, kq, vq, ks, vs, tables, lens = decode_case(DECODE_LENS, 4, 32, query_dtype, dtype, "cpu")
    keys, values = dequantize_ref(kq, ks), dequantize_ref(vq, vs)
    expected = decode_loop(q.float(), keys, values, tables, lens, 0.3, window, softcap)
    actual = decode.paged_decode_attention_ref(q, kq, vq, tables, lens, 0.3, window, softcap,
                                               ks, vs)
    assert_close(actual, expected.to(query_dtype))
    q, kq, vq, ks, vs, tables, cu, lens = prefill_case(CHUNKS, 4, 32, query_dtype, dtype, "cpu")
    keys, values = dequantize_ref(kq, ks), dequantize_ref(vq, vs)
    expected = prefill_loop(q.float(), keys, values, tables, cu, lens, 0.3, window, softcap)
    actual = prefill.paged_prefill_attention_ref(q, kq, vq, tables, cu, lens, 0.3, window,
                                                 softcap, ks, vs)
    assert_close(actual, expected.to(query_dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("window,softcap", [(None, None), (7, 2.0)])
def test_triton_kernels_on_quantized_caches(window, softcap, dtype, query_dtype, device):
    q, kq, vq, ks, vs, tables, lens = decode_case(DECODE_LENS, 4, 64, query_dtype, dtype, device)
    expected = decode.paged_decode_attention_ref(q, kq, vq, tables, lens, 0.125, window,
                                                 softcap, ks, vs)
    kq, vq, ks, vs = in_block_storage(kq, vq, ks, vs)
    freed = free_before_window(tables, lens, [1] * len(DECODE_LENS), 16, window)
    args = (q, kq, vq, freed, lens, 0.125)
    assert_close(decode.paged_decode_attention_triton(*args, window, softcap, ks, vs), expected)
    assert_close(decode._run_decode(*args, num_splits=3, block_n=16, sliding_window=window,
                                    softcap=softcap, key_scales=ks, value_scales=vs), expected)
    q, kq, vq, ks, vs, tables, cu, lens = prefill_case(CHUNKS, 4, 64, query_dtype, dtype, device)
    expected = prefill.paged_prefill_attention_ref(q, kq, vq, tables, cu, lens, 0.125, window,
                                                   softcap, ks, vs)
    freed = free_before_window(tables, lens, [c for c, _ in CHUNKS], 16, window)
    assert_close(prefill.paged_prefill_attention_triton(q, kq, vq, freed, cu, lens, 0.125,
                                                        window, softcap, ks, vs), expected)


@CPU_KERNELS
@pytest.mark.parametrize("query_dtype,head_dim", [
    (torch.float32, 64),    # the AVX2 fp32 path
    (torch.float32, 20),    # generic (head_dim not a multiple of 8)
    (torch.bfloat16, 64),   # AVX512-BF16 where the CPU has it
    (torch.bfloat16, 128),
    (torch.bfloat16, 80),   # generic
    (torch.float16, 64)])   # generic
@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("window,softcap", CASES)
def test_cpu_decode_on_quantized_caches(window, softcap, dtype, query_dtype, head_dim):
    lens = DECODE_LENS * 3  # 12 sequences: tasks per sequence, and per kv head for 2
    for batch in (lens, lens[:2]):
        q, kq, vq, ks, vs, tables, seq_lens = decode_case(batch, 4, head_dim, query_dtype, dtype,
                                                          "cpu")
        expected = decode.paged_decode_attention_ref(q, kq, vq, tables, seq_lens, 0.125, window,
                                                     softcap, ks, vs)
        freed = free_before_window(tables, seq_lens, [1] * len(batch), 16, window)
        actual = decode.paged_decode_attention_cpu(q, *in_block_storage(kq, vq, ks, vs)[:2],
                                                   freed, seq_lens, 0.125, window, softcap,
                                                   *in_block_storage(kq, vq, ks, vs)[2:])
        assert_close(actual, expected)


@CPU_KERNELS
@pytest.mark.skipif(not cpu_ext.has_prefill_attention(), reason="needs AVX512-BF16")
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 5)])
@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("window,softcap", CASES)
def test_cpu_prefill_on_quantized_caches(window, softcap, dtype, head_dim, block_size):
    q, kq, vq, ks, vs, tables, cu, lens = prefill_case(CHUNKS, 6, head_dim, torch.bfloat16,
                                                       dtype, "cpu", block_size)
    expected = prefill.paged_prefill_attention_ref(q, kq, vq, tables, cu, lens, 0.125, window,
                                                   softcap, ks, vs)
    freed = free_before_window(tables, lens, [c for c, _ in CHUNKS], block_size, window)
    kq, vq, ks, vs = in_block_storage(kq, vq, ks, vs)
    actual = prefill.paged_prefill_attention(q, kq, vq, freed, cu, lens, 0.125, window,
                                             softcap, ks, vs)
    assert_close(actual, expected)
