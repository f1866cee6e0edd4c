"""The C++ packed linear (``kernels/csrc/cpu_gemm.cpp``: fp32 in 16-feature panels on AVX2
CPUs; ``cpu_gemm_avx512.cpp``: fp32 and bf16 in 32-feature panels on AVX-512 CPUs)
against ``F.linear``, and ``PackedLinear``'s choice of kernel."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.models.layers import PackedLinear
from pdserve.kernels import cpu_ext

OWN_KERNEL = pytest.mark.skipif(not cpu_ext.has_linear_packed(),
                                reason="linear_packed needs AVX2 + FMA or AVX-512")
PANEL = int(torch.ops.pdserve_cpu.linear_panel_width()) if cpu_ext.has_linear_packed() else 0
# NOTE: the AVX2 path takes fp32 only; the AVX-512 one fp32 and bf16
DTYPES = [torch.float32] + ([torch.bfloat16] if PANEL == 32 else [])


def packed(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.pdserve_cpu.pack_linear_weight(weight)


def assert_is_f_linear(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias):
    """fp32: F.linear to summation order. bf16: F.linear summed in fp32 and rounded once
    to bf16 (as oneDNN's bf16 linear), so at most one bf16 step (2^-8 relative) apart."""
    if x.dtype == torch.float32:
        torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
        return
    assert got.dtype == torch.bfloat16
    want = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    torch.testing.assert_close(got.float(), want.bfloat16().float(), rtol=2 ** -7, atol=1e-3)


@OWN_KERNEL
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 6, 7, 11, 12, 13, 32, 95, 96, 97, 191, 192, 193,
                                  400])
@pytest.mark.parametrize("in_features,out_features", [(64, 48), (300, 37), (513, 16), (17, 1),
                                                      (1024, 33)])
def test_linear_packed_is_f_linear(rows, in_features, out_features, threads, dtype):
    """Every row tail (12-row tiles then 11..1 on AVX-512, 6 then 5..1 on AVX2), every panel
    tail (out_features not a multiple of the panel), K across and inside the K slices, more
    rows than one work item, a row stride that is a multiple of 1 KiB (1024 fp32 features),
    with and without bias, on one and two threads."""
    torch.manual_seed(rows * 1000 + in_features + out_features)
    x = torch.randn(rows, in_features).to(dtype)
    weight = torch.randn(out_features, in_features).to(dtype)
    bias = torch.randn(out_features).to(dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for b in (None, bias):
            got = torch.ops.pdserve_cpu.linear_packed(x, packed(weight), b, out_features)
            assert got.shape == (rows, out_features)
            assert_is_f_linear(got, x, weight, b)
    finally:
        torch.set_num_threads(previous)


@OWN_KERNEL
def test_fp32_packed_layout_is_panels_of_features_zero_padded():
    n = PANEL + 4
    weight = torch.arange(n * 3, dtype=torch.float32).view(n, 3)
    panels = packed(weight)
    assert panels.shape == (2, 3, PANEL)
    assert torch.equal(panels[0], weight[:PANEL].T)
    assert torch.equal(panels[1, :, :4], weight[PANEL:].T)
    assert not panels[1, :, 4:].any()


@OWN_KERNEL
@pytest.mark.skipif(PANEL != 32, reason="bf16 panels are the AVX-512 path's")
def test_bf16_panels_interleave_the_two_halves_of_each_panel():
    """Row k of a bf16 panel: features i and 16 + i side by side (one 32-bit word), so
    one load and two bit operations widen both halves to fp32."""
    weight = torch.arange(40 * 2, dtype=torch.float32).view(40, 2).bfloat16()
    panels = packed(weight)
    assert panels.shape == (2, 2, 32) and panels.dtype == torch.bfloat16
    assert torch.equal(panels[0, :, 0::2], weight[:16].T)
    assert torch.equal(panels[0, :, 1::2], weight[16:32].T)
    assert torch.equal(panels[1, :, 0:16:2], weight[32:40].T)
    assert not panels[1, :, 16::2].any() and not panels[1, :, 1::2].any()


@OWN_KERNEL
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_packed_reads_a_strided_input_as_its_values(dtype):
    x = torch.randn(40, 24).to(dtype)[:, 4:20]  # rows 24 apart, 16 read
    weight = torch.randn(30, 16).to(dtype)
    got = torch.ops.pdserve_cpu.linear_packed(x, packed(weight), None, 30)
    assert_is_f_linear(got, x, weight, None)


@OWN_KERNEL
@pytest.mark.parametrize("call,message", [
    (lambda w: torch.ops.pdserve_cpu.linear_packed(torch.randn(2, 8).double(), packed(w), None, 20),
     "x must be a 2-D float32"),
    (lambda w: torch.ops.pdserve_cpu.linear_packed(torch.randn(2, 9), packed(w), None, 20),
     "x has 9 in_features, the weight 8"),
    (lambda w: torch.ops.pdserve_cpu.linear_packed(torch.randn(2, 8), packed(w), None, 3 * PANEL),
     f"out_features {3 * PANEL} does not fit"),
    (lambda w: torch.ops.pdserve_cpu.linear_packed(torch.randn(2, 8), packed(w), torch.randn(7), 20),
     "bias must be float32 \\[20\\]"),
    (lambda w: torch.ops.pdserve_cpu.linear_packed(torch.randn(2, 8), w, None, 20),
     "packed must come from pack_linear_weight"),
    (lambda w: packed(w.double()), "weight must be a 2-D float32"),
])
def test_linear_packed_names_what_is_wrong(call, message):
    with pytest.raises(RuntimeError, match=message):
        call(torch.randn(20, 8))


@OWN_KERNEL
@pytest.mark.skipif(PANEL != 32, reason="bf16 panels are the AVX-512 path's")
def test_bf16_weights_take_a_bf16_input_only():
    w = torch.randn(20, 8).bfloat16()
    with pytest.raises(RuntimeError, match="x must be a 2-D bfloat16"):
        torch.ops.pdserve_cpu.linear_packed(torch.randn(2, 8), packed(w), None, 20)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_picks_its_kernel_and_keeps_leading_dims(dtype):
    """Each dtype takes linear_packed where it is the faster kernel here, oneDNN's
    elsewhere; both give F.linear's values."""
    linear = torch.nn.Linear(40, 24).to(dtype)
    try:
        layer = PackedLinear(linear)
    except RuntimeError as exc:  # NOTE: oneDNN without this dtype on this CPU
        pytest.skip(f"oneDNN's packed {dtype} linear is unavailable here: {exc}")
    assert layer.own_kernel == (dtype in cpu_ext.linear_packed_dtypes())
    x = torch.randn(3, 5, 40).to(dtype)
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {}
    with torch.no_grad():
        torch.testing.assert_close(layer(x), linear(x), **tolerance)


def test_own_kernel_dtypes_follow_the_build_and_the_cpu():
    dtypes = cpu_ext.linear_packed_dtypes()
    if not cpu_ext.has_linear_packed():
        assert not dtypes
    elif PANEL == 16:
        assert dtypes == {torch.float32}
    else:
        assert torch.float32 not in dtypes  # NOTE: oneDNN's fp32 is the faster one there
        fast_bf16 = torch.cpu._is_amx_tile_supported() or cpu_ext._cpu_vendor() == "AuthenticAMD"
        assert (torch.bfloat16 in dtypes) == (not fast_bf16)


SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_linear.py"


@OWN_KERNEL
@pytest.mark.parametrize("dtype", [str(d).removeprefix("torch.") for d in DTYPES])
def test_the_benchmark_times_both_kernels_at_each_row_count(tmp_path, dtype):
    out = tmp_path / "figures.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--rows", "1", "7", "--num-layers", "1",
                           "--hidden-size", "64", "--intermediate-size", "96", "--num-heads", "2",
                           "--num-kv-heads", "1", "--head-dim", "32", "--vocab-size", "100",
                           "--dtype", dtype, "--seconds", "0", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    figures_all = json.loads(out.read_text())
    assert figures_all["dtype"] == dtype
    rows = figures_all["rows"]
    assert set(rows) == {"1", "7"}
    for figures in rows.values():
        assert figures["steps"] >= 3 and figures["pdserve_ms"] > 0 and figures["onednn_ms"] > 0
        assert figures["ratio"] == pytest.approx(figures["onednn_ms"] / figures["pdserve_ms"])
