"""The serving benchmark's pure metric functions (benchmarks/serving.py); no server needed."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "serving.py"
_spec = importlib.util.spec_from_file_location("pdserve_serving_benchmark", _PATH)
serving = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = serving  # dataclasses look their module up by name
_spec.loader.exec_module(serving)


def _out(ttft: float, latency: float, tokens: int, itl=(), success: bool = True):
    return serving.RequestOutput(success=success, prompt_tokens=10, output_tokens=tokens,
                                 ttft=ttft, latency=latency, itl=list(itl))


def test_percentiles_interpolate_linearly_in_ms():
    stats = serving.summarize_ms([0.001 * v for v in range(1, 101)], [50, 99])
    assert stats["mean"] == pytest.approx(50.5)
    assert stats["median"] == pytest.approx(50.5)
    assert stats["p50"] == pytest.approx(50.5)
    assert stats["p99"] == pytest.approx(99.01)
    assert serving.summarize_ms([], [99]) == {"mean": 0.0, "median": 0.0, "std": 0.0,
                                              "p99": 0.0}


def test_tpot_leaves_out_the_first_token():
    # 1 s to the first token, then 9 more tokens over 0.9 s: 0.1 s each.
    assert serving.tpot_s(1.9, 1.0, 10) == pytest.approx(0.1)
    assert serving.tpot_s(1.0, 1.0, 1) is None
    metrics = serving.calculate_metrics([_out(1.0, 1.9, 10), _out(0.5, 0.5, 1)], 2.0)
    assert metrics["mean_tpot_ms"] == pytest.approx(100.0)  # the 1-token request has none


def test_goodput_counts_requests_meeting_both_slos():
    outputs = [
        _out(0.1, 0.1 + 9 * 0.01, 10),   # TTFT 100 ms, TPOT 10 ms: good
        _out(0.3, 0.3 + 9 * 0.01, 10),   # TTFT over the SLO
        _out(0.1, 0.1 + 9 * 0.05, 10),   # TPOT over the SLO
        _out(0.1, 0.1, 1),               # no TPOT: meets the TPOT SLO
        _out(0.1, 0.1 + 9 * 0.01, 10, success=False),
    ]
    m = serving.calculate_metrics(outputs, 2.0, slo_ttft_ms=200, slo_tpot_ms=20)
    assert (m["completed"], m["failed"], m["good_requests"]) == (4, 1, 2)
    assert m["request_goodput"] == pytest.approx(1.0)
    assert m["request_throughput"] == pytest.approx(2.0)
    assert m["output_throughput"] == pytest.approx(31 / 2.0)
    only_ttft = serving.calculate_metrics(outputs, 2.0, slo_ttft_ms=200)
    assert only_ttft["good_requests"] == 3
    assert serving.calculate_metrics(outputs, 2.0)["request_goodput"] is None


def test_itl_pools_the_gaps_of_all_requests():
    m = serving.calculate_metrics([_out(0.1, 0.4, 4, itl=[0.1, 0.1, 0.1]),
                                   _out(0.1, 0.5, 3, itl=[0.2, 0.2])], 1.0, percentiles=[50])
    assert m["mean_itl_ms"] == pytest.approx(140.0)
    assert m["p50_itl_ms"] == pytest.approx(100.0)


def test_arrivals_are_seeded_poisson_or_all_at_once():
    assert serving.arrival_intervals(3, math.inf, 0) == [0.0, 0.0, 0.0]
    gaps = serving.arrival_intervals(2000, 4.0, 0)
    assert gaps == serving.arrival_intervals(2000, 4.0, 0)
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.1)


def test_prompts_are_seeded_and_payload_streams_with_usage():
    prompts = serving.make_prompts(2, 8, 5, seed=1)
    assert prompts == serving.make_prompts(2, 8, 5, seed=1)
    assert len(prompts[0].prompt.split()) == 8 and prompts[0].output_len == 5
    body = serving.build_payload("chat", "m", prompts[0])
    assert body["messages"][0]["content"] == prompts[0].prompt
    assert body["ignore_eos"] and body["max_tokens"] == 5
    assert body["stream_options"] == {"include_usage": True}
    assert serving.build_payload("completions", "m", prompts[0])["prompt"] == prompts[0].prompt
