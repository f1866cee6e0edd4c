"""Router metrics: vLLM's names and labels in the exposition, per-request timings."""

from __future__ import annotations

import pytest

from pdserve.router.metrics import RouterMetrics


class Clock:
    """A clock the test sets by hand (seconds)."""

    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_exposition_has_vllm_and_pdserve_names():
    metrics = RouterMetrics("demo")
    metrics.record_routing("prefill", "p0")
    metrics.record_index_lookup("unavailable")
    metrics.request_retries.inc()
    metrics.num_requests_running.set(3)
    text = metrics.exposition().decode()
    for name in ["vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds",
                 "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "pdserve:prefix_index_available", "pdserve:request_retries_total"]:
        assert name in text, name
    assert 'vllm:num_requests_running{model_name="demo"} 3.0' in text
    assert ('pdserve:routing_decisions_total{model_name="demo",role="prefill",worker="p0"} 1.0'
            in text)
    assert 'pdserve:prefix_index_lookups_total{model_name="demo",result="unavailable"} 1.0' in text
    assert 'pdserve:prefix_index_available{model_name="demo"} 0.0' in text


def test_each_router_has_its_own_registry():
    a, b = RouterMetrics("m"), RouterMetrics("m")  # no "Duplicated timeseries" error
    a.generation_tokens.inc(5)
    assert a.registry.get_sample_value("vllm:generation_tokens_total", {"model_name": "m"}) == 5
    assert b.registry.get_sample_value("vllm:generation_tokens_total", {"model_name": "m"}) == 0


def test_request_timings():
    clock, metrics = Clock(), RouterMetrics("demo")
    request = metrics.request(clock=clock)
    clock.now_s += 0.25
    request.on_tokens(1)  # first token: TTFT 0.25
    for gap_s in (0.02, 0.04, 0.06):
        clock.now_s += gap_s
        request.on_tokens(1)
    clock.now_s += 0.01
    request.on_finish("stop", num_prompt_tokens=7)
    assert request.ttft_s == pytest.approx(0.25)
    assert request.tpot_s == pytest.approx(0.12 / 3)
    assert request.e2e_s == pytest.approx(0.38)

    def value(name: str, **labels) -> float:
        return metrics.registry.get_sample_value(name, {"model_name": "demo", **labels})

    assert value("vllm:time_to_first_token_seconds_sum") == pytest.approx(0.25)
    assert value("vllm:inter_token_latency_seconds_count") == 3
    assert value("vllm:inter_token_latency_seconds_sum") == pytest.approx(0.12)
    assert value("vllm:inter_token_latency_seconds_bucket", le="0.025") == 1
    assert value("vllm:request_time_per_output_token_seconds_sum") == pytest.approx(0.04)
    assert value("vllm:e2e_request_latency_seconds_sum") == pytest.approx(0.38)
    assert value("vllm:generation_tokens_total") == 4
    assert value("vllm:prompt_tokens_total") == 7
    assert value("vllm:request_success_total", finished_reason="stop") == 1


def test_single_token_request_has_no_tpot_and_prefix_cache_counts_tokens():
    clock, metrics = Clock(), RouterMetrics("demo")
    request = metrics.request(clock=clock)
    clock.now_s += 0.1
    request.on_tokens(1)
    request.on_finish("length", num_prompt_tokens=3)
    assert request.tpot_s is None
    assert metrics.registry.get_sample_value(
        "vllm:request_time_per_output_token_seconds_count", {"model_name": "demo"}) == 0
    metrics.record_prefix_cache(64, 48)
    assert metrics.registry.get_sample_value(
        "vllm:prefix_cache_hits_total", {"model_name": "demo"}) == 48
