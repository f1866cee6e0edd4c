"""benchmarks/offline_throughput.py's pdserve runner with ``--kv-cache-dtype``, on a tiny
model: it generates with the asked KV cache, and its decode-step probe counts the cache's
real bytes (an int8 block's, scales included). No timing is asserted."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from conftest import write_tiny_checkpoint

_BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_pdserve_runner_takes_the_kv_cache_dtype(monkeypatch, tmp_path, kv_cache_dtype):
    monkeypatch.syspath_prepend(str(_BENCHMARKS))
    offline = importlib.import_module("offline_throughput")
    model = write_tiny_checkpoint(tmp_path / "llama", "llama", max_position_embeddings=1024)
    prompts = [[(7 * i + j) % 300 for j in range(20)] for i in range(4)]
    run, probe = offline.pdserve_runner(model, prompts, 4, "float32", "cpu", kv_cache_dtype)
    assert run() > 0
    steps = probe()
    # tiny llama: 2 layers x 2 x 2 kv heads x 16 values a token; fp32 4 bytes a value,
    # int8 1 plus a 2112-byte block's share of scales and padding (2112 / 16 = 132)
    per_token = 2 * 2 * 2 * 16 * 4 if kv_cache_dtype == "auto" else 2112 // 16
    context = 20 + steps["decode_steps"] // 2 + 1
    assert steps["kv_bytes"] == 4 * context * per_token
