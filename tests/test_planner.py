"""The SLO planner (``pdserve serve --autoscale``) on a real local Ray: a load step that
breaks the TTFT target grows the prefill pool, and the pool shrinks back once idle; every
request of the step succeeds. Also the quantile estimate it reads the router's
histograms with."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_scaling import Load, cli, health, start_serve

from pdserve.entrypoints.planner import PlannerConfig, histogram_quantile


@pytest.mark.parametrize(("q", "buckets", "expected"), [
    (0.5, [(1.0, 0), (2.0, 10), (math.inf, 10)], 1.5),
    (0.9, [(0.1, 5), (0.5, 9), (1.0, 10), (math.inf, 10)], 0.5),
    (0.9, [(1.0, 0), (math.inf, 4)], 1.0),  # beyond the last bound: that bound
    (0.9, [(1.0, 0), (math.inf, 0)], None),
])
def test_histogram_quantile_interpolates_like_prometheus(q, buckets, expected):
    got = histogram_quantile(q, buckets)
    assert got == expected if expected is None else got == pytest.approx(expected)


@pytest.mark.parametrize("kwargs", [
    {"min_workers": {"prefill": 0, "decode": 0}},
    {"min_workers": {"prefill": 3, "decode": 1}, "max_workers": {"prefill": 2, "decode": 1}},
    {"ttft_target_s": 0.0}, {"interval_s": -1.0}])
def test_planner_config_refuses_bounds_that_cannot_work(kwargs):
    with pytest.raises(ValueError, match="must"):
        PlannerConfig(**kwargs)


@pytest.fixture(scope="module")
def autoscaled(tmp_path_factory):
    # A TTFT target no request meets: any traffic breaks it. TPOT's is never broken.
    yield from start_serve(tmp_path_factory, [
        "--autoscale", "--ttft-target-s", "0.001", "--tpot-target-s", "100",
        "--min-prefill-workers", "1", "--max-prefill-workers", "2",
        "--min-decode-workers", "1", "--max-decode-workers", "1",
        "--planner-interval-s", "1", "--planner-cooldown-s", "2"])


def decisions(url: str) -> dict[tuple[str, str], float]:
    """``pdserve:planner_decisions_total`` by (role, action)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    pattern = (r'pdserve:planner_decisions_total\{(?=[^}]*role="(?P<role>\w+)")'
               r'(?=[^}]*action="(?P<action>\w+)")[^}]*\} (?P<n>[0-9.e+]+)')
    return {(m["role"], m["action"]): float(m["n"]) for m in re.finditer(pattern, text)}


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")


def test_load_step_grows_the_prefill_pool_and_idle_shrinks_it(autoscaled):
    url, log = autoscaled
    assert decisions(url)[("prefill", "scale_up")] == 0
    load = Load(url, concurrency=3)
    try:
        wait_for(lambda: health(url)["num_prefill_workers"] == 2, 120,
                 "the planner to add a prefill worker under load")
    finally:
        outcomes = load.stop()
    assert outcomes and all(o[0] == 200 for o in outcomes), outcomes[:3]
    assert decisions(url)[("prefill", "scale_up")] == 1
    assert decisions(url)[("decode", "scale_up")] == 0  # bounded at 1, and TPOT is met
    wait_for(lambda: httpx.get(f"{url}/admin/pools", timeout=10).json()["prefill_workers"] == 1,
             120, "the planner to remove the idle prefill worker")
    assert decisions(url)[("prefill", "scale_down")] == 1
    text = log.read_text()
    assert "SLO planner: scale_up prefill pool 1 -> 2" in text
    assert "SLO planner: scale_down prefill pool 2 -> 1" in text
    assert 'pdserve:planner_desired_workers{model_name="demo",role="prefill"} 1.0' in \
        httpx.get(f"{url}/metrics", timeout=10).text


def test_autoscale_bounds_are_checked_before_start():
    done = cli("serve", "--autoscale", "--prefill-workers", "3", "--max-prefill-workers", "2",
               "--port", "1", timeout_s=120)
    assert done.returncode == 2
    assert "--prefill-workers=3 must be within" in done.stderr


DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "pdserve.json"


def dashboard_metrics() -> set[str]:
    """Every ``vllm:``/``pdserve:`` sample name the dashboard's queries use."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"]
              if isinstance(v.get("query"), dict)]
    return {m for e in exprs for m in re.findall(r"\b(?:vllm|pdserve):[a-z_]+", e)}


def test_every_metric_the_dashboard_queries_exists_on_a_live_cluster(autoscaled):
    """After the load step above, with the planner on: the router's samples and those of every
    worker that its service discovery lists."""
    url, _ = autoscaled
    texts = [httpx.get(f"{url}/metrics", timeout=10).text]
    for group in httpx.get(f"{url}/metrics/targets", timeout=10).json():
        texts.append(httpx.get(f"http://{group['targets'][0]}/metrics", timeout=10).text)
    exposed = {sample.name for text in texts
               for family in text_string_to_metric_families(text) for sample in family.samples}
    wanted = dashboard_metrics()
    assert len(wanted) >= 20
    assert sorted(wanted - exposed) == []
    panels = json.loads(DASHBOARD.read_text())["panels"]
    assert all(p["datasource"]["uid"] == "${datasource}" and p["targets"] for p in panels)
