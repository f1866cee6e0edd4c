"""benchmarks/kv_transfer.py end to end at a small size: a real prefill-side process, the
pair channel and plain send/recv over gloo, every layout (no timing is asserted)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

_BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(autouse=True)
def _kv_path_restored(monkeypatch):
    """The benchmark swaps the KV path's digests for its untagged runs in this process;
    whatever happens, later tests get them back."""
    from pdserve.kvtransfer import receiver, sender

    for module, name in ((sender, "PayloadDigest"), (receiver, "PayloadDigest"),
                         (receiver, "BlockVerifier")):
        monkeypatch.setattr(module, name, getattr(module, name))


def test_kv_transfer_benchmark_moves_every_layout_and_reports_ratios(monkeypatch):
    # NOTE: imported by path for this test only; its spawned child finds it the same way
    monkeypatch.syspath_prepend(str(_BENCHMARKS))
    kv_transfer = importlib.import_module("kv_transfer")
    rows = kv_transfer.run("llama-125m", reps=1, threads=1, prompt_tokens=(64, 160))
    assert [(r["tokens"], r["blocks"], r["bytes"]) for r in rows] == [
        (64, 4, 4 * 192 * 1024), (160, 10, 10 * 192 * 1024)]
    for row in rows:
        assert row["plain_gbps"] > 0 and row["tag_gbps"] > 0
        for layout in kv_transfer.LAYOUTS:
            assert row[f"{layout}_gbps"] > 0
            assert row[f"{layout}_ratio"] == pytest.approx(
                row[f"{layout}_gbps"] / row["plain_gbps"])
            low, high = row[f"{layout}_ratio_range"]
            assert 0 < low <= high
            assert row[f"{layout}_tagged_ratio"] > 0  # the tags' cost, measured beside
            low, high = row[f"{layout}_tagged_ratio_range"]
            assert 0 < low <= row[f"{layout}_tagged_ratio"] <= high
            assert row[f"{layout}_tagged_ratio_of_medians"] > 0
    from pdserve.kvtransfer import auth, receiver, sender
    assert (sender.PayloadDigest, receiver.PayloadDigest, receiver.BlockVerifier) == (
        auth.PayloadDigest, auth.PayloadDigest, auth.BlockVerifier)  # restored by run()


def test_kv_transfer_benchmark_moves_int8_caches_at_half_the_bytes_a_token(monkeypatch):
    monkeypatch.syspath_prepend(str(_BENCHMARKS))
    kv_transfer = importlib.import_module("kv_transfer")
    (row,) = kv_transfer.run("llama-125m", reps=1, threads=1, prompt_tokens=(64,),
                             kv_cache_dtype="int8")
    # 12 layers x 2 x 4 kv heads x 64 one-byte values (bf16: 12 KiB), and each block of
    # 16 tokens 384 bytes of fp32 scales: 24 bytes a token
    assert row["bytes_per_token"] == 6144 + 24 == 12 * 1024 / 2 + 24
    assert row["bytes"] == 4 * (16 * 6144 + 384)
    assert all(row[f"{layout}_gbps"] > 0 for layout in kv_transfer.LAYOUTS)
