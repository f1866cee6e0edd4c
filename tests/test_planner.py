"""The SLO planner (``pdserve serve --autoscale``) on a real local Ray: a load step that
breaks the TTFT target grows the prefill pool, and the pool shrinks back once idle; every
request of the step succeeds. Also the quantile estimate it reads the router's
histograms with; in process, on a real router (its metrics and pool) and a scaler that
resizes at once: what it logs and counts (the start-up line, each decision's condition,
value and target, the rate-limited line at a pool's maximum, each naming its model), the
ITL target; and ``pdserve serve``'s refusal of a repeated ``--model``, and ``model: demo``
in ``--models-config``."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import re
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_scaling import Load, cli, health, start_serve

from pdserve.entrypoints.planner import (
    AT_BOUND_REPEAT_S,
    PlannerConfig,
    SLOPlanner,
    histogram_quantile,
)


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
    {"ttft_target_s": 0.0}, {"interval_s": -1.0}, {"itl_target_s": 0.0}])
def test_planner_config_refuses_bounds_that_cannot_work(kwargs):
    with pytest.raises(ValueError, match="must"):
        PlannerConfig(**kwargs)


@pytest.fixture(scope="module")
def autoscaled(tmp_path_factory):
    # A TTFT target no request meets: any traffic breaks it. TPOT's is never broken. With
    # --disaggregation auto (over start_serve's always) every prompt is prefilled on the
    # decode worker, whose cores every worker here shares (prefill_path shared_compute).
    yield from start_serve(tmp_path_factory, [
        "--disaggregation", "auto", "--autoscale", "--ttft-target-s", "0.001", "--tpot-target-s", "100",
        "--min-prefill-workers", "1", "--max-prefill-workers", "2",
        "--min-decode-workers", "1", "--max-decode-workers", "1",
        "--planner-interval-s", "1", "--planner-cooldown-s", "2"])


def decisions(url: str) -> dict[tuple[str, str], float]:
    """``pdserve:planner_decisions_total`` by (pool, scale_up/scale_down/scale_none),
    summed over the reasons."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    pattern = (r'pdserve:planner_decisions_total\{(?=[^}]*pool="(?P<pool>\w+)")'
               r'(?=[^}]*direction="(?P<direction>\w+)")[^}]*\} (?P<n>[0-9.e+]+)')
    totals: dict[tuple[str, str], float] = {}
    for m in re.finditer(pattern, text):
        key = (m["pool"], f"scale_{m['direction']}")
        totals[key] = totals.get(key, 0.0) + float(m["n"])
    return totals


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")


def test_a_ttft_breach_on_one_cpu_node_adds_no_prefill_worker_and_says_why(autoscaled):
    """Issue 32: on this one 2-core node every worker shares the decode worker's cores, so
    the router prefills every prompt on the decode worker (``shared_compute``): a new
    prefill worker would prefill nothing, and the planner refuses it, saying why."""
    url, log = autoscaled
    assert decisions(url)[("prefill", "scale_up")] == 0
    load = Load(url, concurrency=3)
    try:
        wait_for(lambda: "not scaling up the prefill pool (no_prefill_would_help)"
                 in log.read_text(), 120, "the planner to refuse a prefill worker under load")
    finally:
        outcomes = load.stop()
    assert outcomes and all(o[0] == 200 for o in outcomes), outcomes[:3]
    assert health(url)["num_prefill_workers"] == 1
    assert decisions(url)[("prefill", "scale_up")] == 0
    assert decisions(url)[("prefill", "scale_none")] >= 1
    assert decisions(url)[("decode", "scale_up")] == 0  # bounded at 1, and TPOT is met
    text = log.read_text()
    assert "SLO planner: model demo: not scaling up the prefill pool (no_prefill_would_help)" \
        in text
    assert "SLO planner: scale_up prefill" not in text
    assert re.search(r'pdserve:prefill_path_total\{[^}]*reason="shared_compute"[^}]*\} [1-9]',
                     httpx.get(f"{url}/metrics", timeout=10).text)
    assert "SLO planner on for model demo: p90 targets TTFT 0.001 s, TPOT 100 s" in text
    assert 'pdserve:planner_desired_workers{model_name="demo",pool="prefill"} 1.0' in \
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


# In process: a real router, its metrics fed by hand, and a scaler that resizes at once.

class InstantScaler:
    """``PoolScaler``'s calls the planner makes; a resize takes effect at once, and where
    a worker runs is unknown (as with workers on other nodes), so no scale-up is refused
    for its placement (those rules: tests/test_planner_placement.py)."""

    def __init__(self, prefill: int, decode: int) -> None:
        self._sizes = {"prefill": prefill, "decode": decode}

    def sizes(self) -> dict[str, int]:
        return dict(self._sizes)

    def placement(self, role: str) -> None:
        return None

    def placements(self) -> dict[str, list]:
        return {role: [None] * size for role, size in self._sizes.items()}

    async def scale(self, wanted: dict[str, int]) -> dict[str, int]:
        self._sizes.update(wanted)
        return self.sizes()


@pytest.fixture(scope="module")
def demo_path() -> str:
    from pdserve.engine.demo_model import ensure_demo_model

    return str(ensure_demo_model())


def make_planner(demo_path: str, name: str, sizes=(1, 1), **config) -> SLOPlanner:
    """An SLO planner of a real router serving the demo model as ``name``."""
    from pdserve.router.config import RouterConfig
    from pdserve.router.model_service import ModelService

    router = ModelService(RouterConfig(model=demo_path, redis_url="redis://127.0.0.1:1",
                                       served_model_name=name))
    config = {"interval_s": 1.0, "cooldown_s": 0.0, "up_after": 2, **config}
    return SLOPlanner(PlannerConfig(**config), router, InstantScaler(*sizes))


def planner_records(caplog, event: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if getattr(r, "planner", {}).get("event") == event]


def decided(planner: SLOPlanner, pool: str, direction: str, reason: str) -> float | None:
    return planner.router.metrics.registry.get_sample_value(
        "pdserve:planner_decisions_total", {"model_name": planner.router.metrics.model_name,
                                            "pool": pool, "direction": direction,
                                            "reason": reason})


def test_start_up_line_names_the_model_targets_bounds_and_interval(demo_path, caplog):
    caplog.set_level(logging.INFO, logger="pdserve.entrypoints.planner")
    make_planner(demo_path, "sea", ttft_target_s=0.5, tpot_target_s=0.1, itl_target_s=0.05,
                 min_workers={"prefill": 0, "decode": 1},
                 max_workers={"prefill": 2, "decode": 3}, interval_s=5.0, cooldown_s=20.0)
    [record] = planner_records(caplog, "start")
    assert record.levelno == logging.INFO
    assert record.getMessage() == (
        "SLO planner on for model sea: p90 targets TTFT 0.5 s, TPOT 0.1 s, ITL 0.05 s; "
        "prefill pool 0-2, decode pool 1-3 workers; a decision every 5 s, none for 20 s after "
        "a resize")
    assert record.planner == {
        "event": "start", "model_name": "sea", "ttft_target_s": 0.5, "tpot_target_s": 0.1,
        "itl_target_s": 0.05, "bounds": {"prefill": (0, 2), "decode": (1, 3)},
        "interval_s": 5.0, "cooldown_s": 20.0}


def test_each_models_decision_names_its_model_condition_value_and_target(demo_path, caplog):
    """Two models' planners: only "sky" breaks its TTFT target; its line and its count say
    so, and "sea" stays as it was."""
    caplog.set_level(logging.INFO, logger="pdserve.entrypoints.planner")
    sea = make_planner(demo_path, "sea", sizes=(0, 1), ttft_target_s=0.5)
    sky = make_planner(demo_path, "sky", sizes=(0, 1), ttft_target_s=0.5)
    assert [r.planner["model_name"] for r in planner_records(caplog, "start")] == \
        ["sea", "sky"]
    for now in (0.0, 1.0):
        for _ in range(10):
            sky.router.metrics.time_to_first_token.observe(1.2)
            sea.router.metrics.time_to_first_token.observe(0.01)
        assert asyncio.run(sea.step(now)) == {"prefill": 0, "decode": 1}
        sizes = asyncio.run(sky.step(now))
    assert sizes == {"prefill": 1, "decode": 1}
    [record] = planner_records(caplog, "resize")
    assert record.planner["model_name"] == "sky"
    assert (record.planner["pool"], record.planner["direction"], record.planner["from"],
            record.planner["to"], record.planner["condition"], record.planner["target"]) == \
        ("prefill", "up", 0, 1, "ttft_p90", 0.5)
    value = record.planner["value"]
    assert 1.0 < value <= 2.5  # p90 inside the bucket holding 1.2 s
    assert record.getMessage().startswith(
        f"SLO planner: scale_up prefill pool 0 -> 1 of model sky: ttft_p90 {value:.3f} s "
        "(target 0.5 s); p90 TTFT ")
    assert decided(sky, "prefill", "up", "ttft_p90") == 1
    for planner in (sea, sky):  # every known reason is there from the start
        assert decided(planner, "prefill", "up", "prefill_queue") == 0
        assert decided(planner, "decode", "up", "itl_p90") == 0
        assert decided(planner, "decode", "down", "idle") == 0
    assert decided(sea, "prefill", "up", "ttft_p90") == 0
    desired = sky.router.metrics.registry.get_sample_value
    assert desired("pdserve:planner_desired_workers",
                   {"model_name": "sky", "pool": "prefill"}) == 1


def test_an_itl_breach_scales_decode_up(demo_path, caplog):
    caplog.set_level(logging.INFO, logger="pdserve.entrypoints.planner")
    planner = make_planner(demo_path, "sea", sizes=(1, 1), itl_target_s=0.05,
                           tpot_target_s=10.0)
    for now in (0.0, 1.0):
        for _ in range(20):
            planner.router.metrics.inter_token_latency.observe(0.3)
            planner.router.metrics.time_per_output_token.observe(0.3)  # under its 10 s
        sizes = asyncio.run(planner.step(now))
    assert sizes == {"prefill": 1, "decode": 2}
    [record] = planner_records(caplog, "resize")
    assert (record.planner["model_name"], record.planner["pool"], record.planner["condition"],
            record.planner["target"]) == ("sea", "decode", "itl_p90", 0.05)
    assert record.planner["value"] > 0.05
    assert decided(planner, "decode", "up", "itl_p90") == 1
    assert decided(planner, "decode", "up", "tpot_p90") == 0


def test_a_target_broken_at_the_pools_maximum_is_said_once_a_minute(demo_path, caplog):
    caplog.set_level(logging.INFO, logger="pdserve.entrypoints.planner")
    planner = make_planner(demo_path, "sea", sizes=(1, 1), ttft_target_s=0.5,
                           max_workers={"prefill": 1, "decode": 4})

    def interval(now: float, ttft_s: float) -> None:
        for _ in range(10):
            planner.router.metrics.time_to_first_token.observe(ttft_s)
        assert asyncio.run(planner.step(now)) == {"prefill": 1, "decode": 1}

    for now in range(20):  # 20 intervals of 1 s, all broken
        interval(float(now), 1.2)
    [record] = planner_records(caplog, "at_bound")
    assert record.levelno == logging.WARNING
    assert (record.planner["model_name"], record.planner["pool"], record.planner["bound"],
            record.planner["condition"], record.planner["target"]) == \
        ("sea", "prefill", 1, "ttft_p90", 0.5)
    value = record.planner["value"]
    assert record.getMessage() == (
        f"SLO planner: model sea: prefill pool stays at its maximum of 1 workers while "
        f"ttft_p90 is broken: ttft_p90 {value:.3f} s (target 0.5 s) (--max-prefill-workers "
        "bounds it)")
    interval(1.0 + AT_BOUND_REPEAT_S, 1.2)  # a minute after the first line: again
    assert len(planner_records(caplog, "at_bound")) == 2
    assert not planner_records(caplog, "resize")
    assert decided(planner, "prefill", "up", "ttft_p90") == 0


def test_a_repeated_model_flag_is_refused_pointing_to_models_config(capsys):
    from pdserve.entrypoints.cli import main

    for argv in (["--model", "/m/a", "--model", "/m/b"],
                 ["--served-model-name", "a", "b", "--served-model-name", "c"]):
        with pytest.raises(SystemExit) as exit_:
            main(["serve", *argv])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"{argv[0]} is given twice" in err and "--models-config FILE" in err


def test_a_config_files_model_may_still_be_replaced_once(tmp_path):
    from pdserve.entrypoints.cli import build_parser, subcommand
    from pdserve.entrypoints.config_file import parse_with_config

    config = tmp_path / "serve.yaml"
    config.write_text("model: /m/a\nserved-model-name: [a]\n")
    parser = build_parser()
    args = parse_with_config(parser, subcommand(parser, "serve"), [
        "serve", "--config", str(config), "--model", "/m/b", "--served-model-name", "b"])
    assert (args.model, args.served_model_name) == ("/m/b", ["b"])


def test_a_models_config_may_name_the_demo_model(tmp_path, demo_path):
    from pdserve.engine.engine_config import EngineConfig
    from pdserve.entrypoints.serve_models import models_from_config

    config = tmp_path / "models.yaml"
    config.write_text("models:\n  - model: demo\n  - model: demo\n"
                      "    served_model_name: other\n    decode_workers: 2\n")
    args = argparse.Namespace(prefill_workers=1, decode_workers=1)
    first, second = models_from_config(str(config), EngineConfig("<model>"), args)
    assert (first.engine.model, first.name, first.demo) == (demo_path, "pdserve-demo", True)
    assert (second.engine.model, second.name, second.decode_workers) == \
        (demo_path, "other", 2)
