"""The SLO planner on this 2-core node, throughput before and after it grows the decode
pool (issue 32): the running worker is re-split onto fewer cores and the new one takes the
freed ones. A module of its own, so no other cluster runs beside it while it measures."""

from __future__ import annotations

import time

import pytest
from test_planner import wait_for
from test_scaling import Load, health, start_serve


@pytest.fixture(scope="module")
def resplitting(tmp_path_factory):
    # Both targets broken by any traffic; a decision at most every 18 s, then none (the
    # cooldown outlasts the test): one scale-up at most. The prefill pool is refused
    # (shared_compute); the decode pool may grow 1 -> 2, each worker on one core.
    yield from start_serve(tmp_path_factory, [
        "--disaggregation", "auto", "--autoscale", "--ttft-target-s", "0.001",
        "--tpot-target-s", "0.00001", "--min-prefill-workers", "1",
        "--max-prefill-workers", "2", "--min-decode-workers", "1",
        "--max-decode-workers", "2", "--planner-interval-s", "18",
        "--planner-cooldown-s", "600"])


# after >= before x this. Measured on this 2-core VM (requests per window, before -> after):
# 432 -> 391 (0.905, 6 s windows), 672 -> 717 (1.07), 874 -> 784 (0.897, in a full run):
# two one-core workers make about what one two-core worker made, so the margin is the
# windows' noise; it catches a scale-up that costs throughput (the issue's 381 -> 200-256)
THROUGHPUT_MARGIN = 0.85
WINDOW_S = 10.0


def test_throughput_after_a_scale_up_on_this_node_is_no_lower_or_it_refused(resplitting):
    """Issue 32: under load at concurrency 16 on this 2-core node, requests completed per
    window before the planner acts and after the worker it added serves (the running one
    re-split onto fewer cores): after >= before x ``THROUGHPUT_MARGIN``, or the planner
    refused the scale-up and said why."""
    url, log = resplitting
    load = Load(url, concurrency=16)
    try:
        began = time.monotonic()
        # NOTE: the planner acts 18 to 36 s after the load starts; the window before it
        # starts once the load is steady (its first requests' prefills are behind it)
        time.sleep(5.0)
        first = len(load.outcomes)
        time.sleep(WINDOW_S)
        before = len(load.outcomes) - first
        assert time.monotonic() - began < 18.0, "the before window overlapped a decision"
        wait_for(lambda: health(url)["num_decode_workers"] == 2
                 or "not scaling up the decode pool" in log.read_text(), 180,
                 "the planner to grow the decode pool or refuse")
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
    assert "SLO planner: model demo: not scaling up the prefill pool (no_prefill_would_help)" \
        in text
    if "SLO planner: scale_up decode pool 1 -> 2 of model demo" in text:
        assert "re-split onto CPUs" in text
        assert after >= THROUGHPUT_MARGIN * before, (before, after)
    else:
        assert "not scaling up the decode pool (no_free_cores)" in text
