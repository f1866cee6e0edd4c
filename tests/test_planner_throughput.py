"""The SLO planner on this 2-core node acting on a broken TPOT target (issue 32): the one
decode worker's threads already run on both cores, so another decode worker could only
split them (a re-split adds no compute: measured 874 -> 784 and 432 -> 391 requests per
window when it did): the planner refuses it (``no_free_cores``), says why and counts it,
and changes nothing. A module of its own, so no other cluster runs beside it.

Why no throughput bound after the refusal: the served cluster's own throughput falls over
the first half-minute of a steady load with no planner at all (the same load, windows at
5-15 s and 25-35 s, ``--autoscale`` off: 966 -> 709 requests, 0.73; with the planner
refusing: 911 -> 757 alone, 603 -> 454 in a full run), so a before/after ratio measures
that drift, not the planner. What the planner must not do, grow or re-split, is asserted
instead; the windows are printed.
"""

from __future__ import annotations

import os
import re
import time

import httpx
import pytest
from test_planner import wait_for
from test_scaling import Load, health, start_serve

CORES = len(os.sched_getaffinity(0))  # the node's CPUs, as pdserve serve's launcher sees


@pytest.fixture(scope="module")
def crowded(tmp_path_factory):
    # Both targets broken by any traffic; a decision every 8 s, a scale-up after two broken
    # intervals in a row: 16 to 24 s after the load starts. The prefill pool is refused
    # (shared_compute); the decode pool (1-2) is refused too: its worker's threads hold
    # both cores.
    yield from start_serve(tmp_path_factory, [
        "--disaggregation", "auto", "--autoscale", "--ttft-target-s", "0.001",
        "--tpot-target-s", "0.00001", "--min-prefill-workers", "1",
        "--max-prefill-workers", "2", "--min-decode-workers", "1",
        "--max-decode-workers", "2", "--planner-interval-s", "8",
        "--planner-cooldown-s", "600"])


WINDOW_S = 10.0


def refusals(url: str, pool: str, reason: str) -> float:
    """``pdserve:planner_decisions_total{pool, direction="none", reason}`` of model demo."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("pdserve:planner_decisions_total{") and \
                all(f'{k}="{v}"' in line for k, v in (("model_name", "demo"), ("pool", pool),
                                                      ("direction", "none"),
                                                      ("reason", reason))):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no planner_decisions_total of {pool}/{reason}")


def test_on_this_node_the_planner_refuses_a_decode_worker_and_changes_nothing(crowded):
    """Issue 32, One CPU node: under load at concurrency 16, TPOT broken, the planner
    refuses a second decode worker (``no_free_cores``: all the node's cores already run
    the first one's threads), with a line naming the model, pool, condition, value and
    target and why, and the metric counts it; no worker starts and no core is re-split.
    Requests completed per window before the planner acts and after its refusal are
    printed (see the module docstring for why they are not bounded)."""
    url, log = crowded
    load = Load(url, concurrency=16)
    try:
        began = time.monotonic()
        # NOTE: the planner acts 16 to 24 s after the load starts; the window before it
        # starts once the load is steady (its first requests' prefills are behind it)
        time.sleep(5.0)
        first = len(load.outcomes)
        time.sleep(WINDOW_S)
        before = len(load.outcomes) - first
        assert time.monotonic() - began < 16.0, "the before window overlapped a decision"
        wait_for(lambda: health(url)["num_decode_workers"] != 1
                 or "not scaling up the decode pool" in log.read_text(), 60,
                 "the planner to refuse a decode worker")
        time.sleep(1.0)
        first = len(load.outcomes)
        time.sleep(WINDOW_S)
        after = len(load.outcomes) - first
    finally:
        outcomes = load.stop()
    assert outcomes and all(o[0] == 200 for o in outcomes), \
        [o for o in outcomes if o[0] != 200][:3]
    text = log.read_text()
    print(f"requests completed in {WINDOW_S:g} s: {before} before, {after} after")
    assert health(url)["num_decode_workers"] == 1
    assert "SLO planner: scale_up" not in text and "re-split onto CPUs" not in text
    assert "SLO planner: model demo: not scaling up the prefill pool (no_prefill_would_help)" \
        in text
    assert re.search(
        r"SLO planner: model demo: not scaling up the decode pool \(no_free_cores\): "
        r"tpot_p90 [0-9.]+ s \(target 1e-05 s\) is broken, but all "
        rf"{CORES} cores of this node already run a worker's threads \(1 computing "
        r"worker\(s\), [0-9]+ thread\(s\)\); another worker would only split them", text)
    assert refusals(url, "decode", "no_free_cores") == 1  # said once while it holds
