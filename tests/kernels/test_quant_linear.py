"""Weight-only quantized linears (W8A16, W4A16): round-to-nearest quantization, GGUF's
blocks repacked without loss, and the C++ and Triton kernels against the
dequantize-then-matmul reference, on odd shapes and across group, tile and row-block
boundaries."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf_files import random_blocks
from triton_interpreter import device_params  # NOTE: before pdserve.kernels

from pdserve.engine.gguf_quant import KEPT_TYPES, quant_weight
from pdserve.kernels import cpu_ext
from pdserve.kernels import quant_linear as ql
from pdserve.kernels._triton_utils import HAS_TRITON

DEVICES = device_params()
CPU_KERNELS = pytest.mark.skipif(
    os.environ.get("PDSERVE_REQUIRE_CPU_KERNELS") != "1" and not cpu_ext.load(),
    reason="the C++ CPU kernels did not build here (no g++/ninja?)")


def randn(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group", [16, 32, 96])
def test_rtn_rounds_each_weight_to_its_nearest_level(bits, group):
    w = randn(7, 96) * 3
    qw = ql.quantize_rtn(w, bits, group)
    err = (ql.dequantize(qw) - w).abs().view(7, -1, group)
    step = qw.scale.float()[:, :, None]
    assert torch.all(err <= step / 2 + 1e-6)
    values = qw.q.float() if bits == 8 else ql.unpack_int4(qw.q).float()
    assert values.min() >= (-128 if bits == 8 else 0) and values.max() <= (127 if bits == 8 else 15)
    assert torch.equal(ql.unpack_int4(ql.pack_int4(torch.arange(16).repeat(3, 2))),
                       torch.arange(16, dtype=torch.uint8).repeat(3, 2))


def test_rtn_per_channel_and_zero_rows():
    w = randn(4, 64)
    w[2] = 0
    qw = ql.quantize_rtn(w, 8)
    assert qw.group_size == 64 and qw.scale.shape == (4, 1) and qw.min is None
    assert not ql.dequantize(qw)[2].any()


def test_a_bad_format_is_refused_naming_it():
    with pytest.raises(ValueError, match="group_size"):
        ql.quantize_rtn(randn(4, 64), 8, 48)
    with pytest.raises(ValueError, match="min"):
        ql.QuantWeight(torch.zeros(2, 8, dtype=torch.uint8), torch.ones(2, 1), None, 4, 16, 16)


@pytest.mark.parametrize("kind", KEPT_TYPES)
def test_gguf_blocks_are_repacked_without_loss(kind):
    """Each kept type's ``quant_weight`` dequantizes to gguf's own values, bit for bit."""
    import gguf

    rng = np.random.default_rng(3)
    rows, cols = 6, 512
    data = random_blocks(kind, rows, cols, rng)
    weight = quant_weight(data, kind, rows, cols)
    expected = gguf.dequantize(data, gguf.GGMLQuantizationType[kind]).reshape(rows, cols)
    assert np.array_equal(ql.dequantize(weight).numpy(), expected)


# (bits, out_features, in_features, group (None: per channel), rows of x, min for int8)
CASES = [(8, 33, 96, None, 1, False), (8, 70, 128, 32, 13, False), (8, 40, 64, 16, 9, True),
         (4, 33, 64, 32, 1, False), (4, 100, 256, 128, 20, False), (4, 65, 512, 32, 70, False),
         (8, 64, 2048, None, 3, False), (4, 64, 2048, 32, 8, False),
         # 33 panels: threads take runs of consecutive panels, the last run a short one
         (8, 1051, 256, 32, 1, False), (4, 1051, 256, 32, 2, False)]


def make_weight(bits, n, k, group, with_min, scale_dtype):
    w = ql.quantize_rtn(randn(n, k, seed=1), bits, group, scale_dtype)
    if with_min:  # an int8 weight with mins (GGUF Q5_K's form)
        w = ql.QuantWeight(w.q, w.scale, (randn(n, k // w.group_size, seed=2) / 10).to(
            scale_dtype), 8, w.group_size, k)
    return w


@CPU_KERNELS
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_cpu_kernel_equals_the_reference(case, dtype, scale_dtype):
    bits, n, k, group, m, with_min = case
    w = make_weight(bits, n, k, group, with_min, scale_dtype)
    x, bias = randn(m, k, seed=3).to(dtype), randn(n, seed=4).to(dtype)
    packed = ql.pack_for_cpu(w)
    for b in (bias, None):
        actual = ql.linear_quant_cpu(x, packed, w.bits, w.group_size, n, b)
        expected = ql.linear_quant_ref(x, w, b)
        tol = 1e-4 * k ** 0.5 if dtype == torch.float32 else 2e-2 * expected.abs().amax().item()
        torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=1e-2)


# rows of x >= 5 (the bf16 path's), K past one 256-wide slice, groups split by a slice;
# int4 at 1-4 rows too (its streaming tile), groups of an odd number of pairs among them
BF16_CASES = [case for case in CASES if case[4] >= 5 or case[0] == 4] + [
    (8, 48, 64, 32, 5, False), (8, 33, 600, None, 8, False), (8, 64, 2048, None, 11, False),
    (4, 40, 96, 32, 64, False), (8, 96, 320, 32, 65, True), (4, 100, 256, 128, 1, False),
    (4, 47, 96, 6, 3, False), (4, 64, 2048, 32, 4, False)]


@CPU_KERNELS
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", BF16_CASES)
def test_bf16_path_equals_the_reference_and_the_fma_tiles(case, scale_dtype):
    """bf16 x of 5 rows or more, or int4 at any: vdpbf16ps on the raw integers (exact
    products, fp32 sums) against the fp32 reference, within the output's own bf16
    rounding, and against the FMA tiles; forced on and off, so it runs on any CPU (where
    the build has no AVX512-BF16, both calls take the FMA tiles)."""
    bits, n, k, group, m, with_min = case
    w = make_weight(bits, n, k, group, with_min, scale_dtype)
    x, bias = randn(m, k, seed=3).bfloat16(), randn(n, seed=4).bfloat16()
    packed = ql.pack_for_cpu(w)
    try:
        for b in (bias, None):
            ql.set_cpu_bf16_path(1)
            fast = ql.linear_quant_cpu(x, packed, w.bits, w.group_size, n, b)
            ql.set_cpu_bf16_path(0)
            tiles = ql.linear_quant_cpu(x, packed, w.bits, w.group_size, n, b)
            expected = ql.linear_quant_ref(x.float(), w, None if b is None else b.float())
            assert fast.dtype == torch.bfloat16
            bf16_step = 2.0 ** -7 * expected.abs() + 1e-6 * k ** 0.5  # one bf16 step each
            assert ((fast.float() - expected).abs() <= bf16_step).all()
            assert ((fast.float() - tiles.float()).abs() <= bf16_step).all()
    finally:
        ql.set_cpu_bf16_path(-1)


# rows of x >= 9 (where calls dequantize slices, by default): K shorter than one 128-wide
# slice, past one and not a multiple of it, groups that cross a slice's edge (96), per
# channel, mins, and row blocks of 64 with a short last one
SLICE_CASES = [(8, 70, 96, 32, 13, False), (8, 40, 384, 96, 9, True),
               (4, 65, 480, 96, 70, False), (8, 33, 600, None, 12, False),
               (4, 100, 256, 128, 20, False), (8, 64, 2048, None, 130, False)]


@CPU_KERNELS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", SLICE_CASES)
def test_dequantized_slices_equal_the_reference_and_the_tiles(case, dtype):
    """The FMA path's two forms: each slice dequantized once and run on the packed
    linear's 12-row tiles, and each k dequantized per 8-row tile, against the fp32
    reference and each other, within fp32 summation (bf16 x: within the output's bf16
    step); where the build has no AVX-512 both calls take the portable loop."""
    bits, n, k, group, m, with_min = case
    w = make_weight(bits, n, k, group, with_min, torch.float16)
    x, bias = randn(m, k, seed=3).to(dtype), randn(n, seed=4).to(dtype)
    packed = ql.pack_for_cpu(w)
    ql.set_cpu_bf16_path(0)
    try:
        assert ql.set_cpu_slice_rows(0) == 9
        slices = ql.linear_quant_cpu(x, packed, w.bits, w.group_size, n, bias)
        ql.set_cpu_slice_rows(1 << 40)
        tiles = ql.linear_quant_cpu(x, packed, w.bits, w.group_size, n, bias)
    finally:
        ql.set_cpu_slice_rows(0)
        ql.set_cpu_bf16_path(-1)
    expected = ql.linear_quant_ref(x.float(), w, bias.float())
    if dtype == torch.float32:
        tol = 1e-4 * k ** 0.5
        torch.testing.assert_close(slices, expected, atol=tol, rtol=1e-5)
        torch.testing.assert_close(slices, tiles, atol=tol, rtol=1e-5)
    else:
        step = 2.0 ** -7 * expected.abs() + 1e-5 * k ** 0.5  # one bf16 step
        assert ((slices.float() - expected).abs() <= step).all()
        assert ((slices.float() - tiles.float()).abs() <= step).all()


@CPU_KERNELS
def test_bf16_path_mode_is_checked():
    with pytest.raises(RuntimeError, match="mode must be -1, 0 or 1"):
        ql.set_cpu_bf16_path(2)


@CPU_KERNELS
def test_cpu_kernel_names_a_bad_argument():
    w = ql.quantize_rtn(randn(8, 64), 8, 32)
    packed = ql.pack_for_cpu(w)
    with pytest.raises(RuntimeError, match="in_features|tokens"):
        ql.linear_quant_cpu(randn(2, 32), packed, 8, 32, 8)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[3], (4, 20, 96, 32, 5, False)])
def test_triton_kernel_equals_the_reference(case, device):
    from pdserve.kernels.quant_linear_triton import linear_quant_triton

    bits, n, k, group, m, with_min = case
    w = make_weight(bits, n, k, group, with_min, torch.float16).to(device)
    x, bias = randn(m, k, seed=3).to(device), randn(n, seed=4).to(device)
    torch.testing.assert_close(linear_quant_triton(x, w, bias).cpu(),
                               ql.linear_quant_ref(x, w, bias).cpu(), atol=1e-4, rtol=1e-4)


def k_quant_weight(kind: str, rows: int, cols: int, seed: int = 5) -> ql.QuantWeight:
    """A ``kind`` (K-quant) weight of random blocks whose fp16 factors (d, dmin) differ
    from block to block, so that a super-block read off by one shows."""
    from gguf_files import K_BLOCKS, random_k_blocks

    rng = np.random.default_rng(seed)
    blocks = random_k_blocks(kind, rows, cols, rng).reshape(rows, cols // 256, -1)
    base = 2e-3 if kind != "Q6_K" else 5e-4
    for offset in K_BLOCKS[kind][1]:
        factors = (base * rng.uniform(0.25, 4.0, blocks.shape[:2])).astype(np.float16)
        blocks[..., offset:offset + 2] = factors[..., None].view(np.uint8)
    return quant_weight(blocks.reshape(rows, -1), kind, rows, cols)


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_scale_codes_are_the_scales_exactly(kind):
    """A K-quant's two levels (int8 codes times each super-block's fp32 factor) give its
    fp32 scales and mins bit for bit, and survive row reordering and stacking."""
    w = k_quant_weight(kind, 40, 512)
    assert w.scale_codes is not None and w.scale_codes.codes.dtype == torch.int8
    assert torch.equal(w.scale_codes.expand(w.group_size), w.scale)
    assert (w.min is None) == (w.min_codes is None)
    if w.min is not None:
        assert torch.equal(w.min_codes.expand(w.group_size), w.min)
    from pdserve.engine.gguf_quant import permute_rows

    flipped = permute_rows(w, lambda t: t.flip(0))
    stacked = ql.cat_rows([w, flipped])
    assert torch.equal(stacked.scale_codes.expand(w.group_size), stacked.scale)
    assert stacked.nbytes == 2 * w.nbytes < 2 * (w.q.nbytes + w.scale.nbytes + (
        0 if w.min is None else w.min.nbytes))
    mixed = ql.cat_rows([w, ql.QuantWeight(w.q, w.scale, w.min, w.bits, w.group_size, 512)])
    assert mixed.scale_codes is None and mixed.min_codes is None
    if w.min is not None:  # codes for the scales alone would leave the mins unread
        with pytest.raises(ValueError, match="min_codes"):
            ql.QuantWeight(w.q, w.scale, w.min, w.bits, w.group_size, 512, w.scale_codes)


@CPU_KERNELS
@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K", "Q4_0"])
@pytest.mark.parametrize("rows", [1, 3, 5, 20, 70])
def test_compact_scales_compute_what_fp32_scales_do(kind, rows):
    """The kernel on a K-quant's int8 codes and super-block factors, or on Q4_0 without
    its stored mins (-8 * scale, computed), gives the output of the same kernel on the
    fp32/fp16 scales and mins bit for bit, on every path (FMA tiles, vdpbf16ps, int4's
    streaming tile, AMX where present), and the reference's within fp32 summation."""
    n, k = 70, 768  # 3 panels, the last short; 3 super-blocks
    if kind == "Q4_0":
        import gguf

        data = gguf.quants.quantize(randn(n, k, seed=6).numpy(), gguf.GGMLQuantizationType.Q4_0)
        w = quant_weight(data, kind, n, k)
    else:
        w = k_quant_weight(kind, n, k)
    compact = ql.pack_for_cpu(w)
    if kind == "Q4_0":
        assert compact[2] is None  # its mins are -8 * scale: computed, not stored
        full = (*torch.ops.pdserve_cpu.pack_quant_weight(w.q, w.scale, w.min, 4, 32), None,
                None)
        assert full[2].numel()
        shifted = w.min.clone()
        shifted[0, 0] += 1
        assert ql.pack_for_cpu(ql.QuantWeight(w.q, w.scale, shifted, 4, 32, k))[2] is not None
    else:
        assert compact[1].dtype == torch.int8 and compact[3] is not None
        full = ql.pack_for_cpu(ql.QuantWeight(w.q, w.scale, w.min, w.bits, w.group_size, k))
        assert full[1].dtype == torch.float32 and full[3] is None
    x = (randn(rows, k, seed=7) * 2).bfloat16()
    try:
        for mode in (0, 1):
            ql.set_cpu_bf16_path(mode)
            for xs in (x, x.float()):
                got = ql.linear_quant_cpu(xs, compact, w.bits, w.group_size, n)
                want = ql.linear_quant_cpu(xs, full, w.bits, w.group_size, n)
                assert torch.equal(got, want), (mode, xs.dtype)
                ref = ql.linear_quant_ref(xs.float(), w)
                torch.testing.assert_close(got.float(), ref, atol=2e-2 * ref.abs().amax().item(),
                                           rtol=1e-2)
    finally:
        ql.set_cpu_bf16_path(-1)


@CPU_KERNELS
def test_scale_codes_without_their_factors_are_refused():
    w = k_quant_weight("Q6_K", 32, 256)
    packed, codes, _, supers, _ = ql.pack_for_cpu(w)
    with pytest.raises(RuntimeError, match="scales_super"):
        torch.ops.pdserve_cpu.linear_quant(randn(1, 256), packed, codes, None, None, None, None,
                                           8, 16, 32)
    with pytest.raises(RuntimeError, match="go with int8 scale codes only"):
        full = ql.pack_for_cpu(ql.QuantWeight(w.q, w.scale, None, 8, 16, 256))
        torch.ops.pdserve_cpu.linear_quant(randn(1, 256), full[0], full[1], None, supers, None,
                                           None, 8, 16, 32)
