"""The C++ fp32 packed linear (``kernels/csrc/cpu_gemm.cpp``) against ``F.linear``, and
``PackedLinear``'s choice of kernel."""

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
                                reason="linear_packed needs AVX2 + FMA without AVX-512")


def packed(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.pdserve_cpu.pack_linear_weight(weight)


@OWN_KERNEL
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 6, 7, 11, 32, 191, 192, 193, 400])
@pytest.mark.parametrize("in_features,out_features", [(64, 48), (300, 37), (513, 16), (17, 1)])
def test_linear_packed_is_f_linear(rows, in_features, out_features, threads):
    """Every row tail (6-row tiles, then 5..1), every panel tail (out_features not a
    multiple of 16), K across and inside 384-wide slices, more rows than one 192-row
    work item, with and without bias, on one and two threads."""
    torch.manual_seed(rows * 1000 + in_features + out_features)
    x = torch.randn(rows, in_features)
    weight = torch.randn(out_features, in_features)
    bias = torch.randn(out_features)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for b in (None, bias):
            got = torch.ops.pdserve_cpu.linear_packed(x, packed(weight), b, out_features)
            assert got.shape == (rows, out_features)
            torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-4)
    finally:
        torch.set_num_threads(previous)


@OWN_KERNEL
def test_packed_layout_is_panels_of_sixteen_features_zero_padded():
    weight = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    panels = packed(weight)
    assert panels.shape == (2, 3, 16)
    assert torch.equal(panels[0], weight[:16].T)
    assert torch.equal(panels[1, :, :4], weight[16:].T)
    assert not panels[1, :, 4:].any()


@OWN_KERNEL
def test_linear_packed_reads_a_strided_input_as_its_values():
    x = torch.randn(40, 24)[:, 4:20]  # rows 24 floats apart, 16 read
    weight = torch.randn(30, 16)
    got = torch.ops.pdserve_cpu.linear_packed(x, packed(weight), None, 30)
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-4)


@OWN_KERNEL
@pytest.mark.parametrize("call,message", [
    (lambda w: torch.ops.pdserve_cpu.linear_packed(torch.randn(2, 8).double(), packed(w), None, 20),
     "x must be a 2-D float32"),
    (lambda w: torch.ops.pdserve_cpu.linear_packed(torch.randn(2, 9), packed(w), None, 20),
     "x has 9 in_features, the weight 8"),
    (lambda w: torch.ops.pdserve_cpu.linear_packed(torch.randn(2, 8), packed(w), None, 33),
     "out_features 33 does not fit 2 panels"),
    (lambda w: torch.ops.pdserve_cpu.linear_packed(torch.randn(2, 8), packed(w), torch.randn(7), 20),
     "bias must be float32 \\[20\\]"),
    (lambda w: torch.ops.pdserve_cpu.linear_packed(torch.randn(2, 8), w, None, 20),
     "packed must come from pack_linear_weight"),
    (lambda w: packed(w.double()), "weight must be a 2-D float32"),
])
def test_linear_packed_names_what_is_wrong(call, message):
    with pytest.raises(RuntimeError, match=message):
        call(torch.randn(20, 8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_picks_its_kernel_and_keeps_leading_dims(dtype):
    """fp32 takes linear_packed where it runs, bf16 (and fp32 elsewhere) oneDNN's."""
    linear = torch.nn.Linear(40, 24).to(dtype)
    try:
        layer = PackedLinear(linear)
    except RuntimeError as exc:  # NOTE: oneDNN without this dtype on this CPU
        pytest.skip(f"oneDNN's packed {dtype} linear is unavailable here: {exc}")
    assert layer.own_kernel == (dtype == torch.float32 and cpu_ext.has_linear_packed())
    x = torch.randn(3, 5, 40).to(dtype)
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {}
    with torch.no_grad():
        torch.testing.assert_close(layer(x), linear(x), **tolerance)


SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_linear.py"


@OWN_KERNEL
def test_the_benchmark_times_both_kernels_at_each_row_count(tmp_path):
    out = tmp_path / "figures.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--rows", "1", "7", "--num-layers", "1",
                           "--hidden-size", "64", "--intermediate-size", "96", "--num-heads", "2",
                           "--num-kv-heads", "1", "--head-dim", "32", "--vocab-size", "100",
                           "--seconds", "0", "--json", str(out)], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"1", "7"}
    for figures in rows.values():
        assert figures["steps"] >= 3 and figures["pdserve_ms"] > 0 and figures["onednn_ms"] > 0
        assert figures["ratio"] == pytest.approx(figures["onednn_ms"] / figures["pdserve_ms"])
