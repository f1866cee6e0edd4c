"""``benchmarks/cpu_decode_attention.py`` at a tiny size: it runs the C++ kernel, and its
figures are consistent with each other."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.kernels import cpu_ext

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_decode_attention.py"


@pytest.mark.skipif(not cpu_ext.load(), reason="C++ CPU kernels unavailable")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_benchmark_reports_bandwidth_against_the_copy(tmp_path, dtype):
    out = tmp_path / "figures.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--num-seqs", "3", "--context-len", "37",
                           "--cache-mib", "4", "--copy-mib", "4", "--calls", "2", "--dtype", dtype,
                           "--json", str(out)], capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert figures["attention_ms"] > 0 and figures["copy_gbs"] > 0
    assert figures["fraction_of_copy"] == pytest.approx(
        figures["attention_gbs"] / figures["copy_gbs"])
    assert f"ratio {figures['fraction_of_copy']:.2f}" in done.stdout


def test_a_cache_too_small_for_one_step_is_refused():
    done = subprocess.run([sys.executable, str(SCRIPT), "--num-seqs", "64", "--context-len",
                           "4096", "--cache-mib", "1"], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode != 0 and "--cache-mib 1" in done.stderr
