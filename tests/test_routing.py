"""Routing policy: exact choices for prefix overlap against load, ties, decode by load."""

from __future__ import annotations

import pytest

from pdserve.router.routing_policy import (
    LoadWeights,
    NoWorkersError,
    PrefillChoice,
    PrefillPath,
    WorkerLoad,
    choose_decode_worker,
    choose_prefill_path,
    choose_prefill_worker,
    shares_compute,
    should_prefill_locally,
)


def idle(*worker_ids: str) -> list[WorkerLoad]:
    return [WorkerLoad(w) for w in worker_ids]


def test_load_in_blocks_equivalent():
    load = WorkerLoad("A", num_running=4, num_waiting=2, kv_cache_usage=0.5)
    assert LoadWeights().load_blocks(load) == 4 + 2 + 8 * 0.5
    assert LoadWeights(waiting_blocks=3, running_blocks=0, kv_usage_blocks=0).load_blocks(load) == 6


def test_idle_workers_prefer_the_longest_cached_prefix():
    choice = choose_prefill_worker(10, {"A": 3, "B": 7, "C": 0}, idle("A", "B", "C"))
    assert choice == PrefillChoice("B", overlap_blocks=7, uncached_blocks=3, cost=3.0)


def test_load_outweighs_overlap_as_in_the_module_example():
    loads = [WorkerLoad("A", num_running=4, num_waiting=2, kv_cache_usage=0.5), WorkerLoad("B")]
    assert choose_prefill_worker(10, {"A": 8}, loads).worker_id == "B"  # 12 vs 10
    # A longer shared prefix tips it back: A costs 10 + 0, B costs 20.
    assert choose_prefill_worker(20, {"A": 20}, loads).worker_id == "A"
    # overlap_weight=0 is routing by load alone.
    assert choose_prefill_worker(20, {"A": 20}, loads, overlap_weight=0).worker_id == "B"


def test_overlaps_of_unknown_workers_are_ignored_and_clamped():
    choice = choose_prefill_worker(4, {"gone": 4, "A": 9}, idle("A", "B"))
    assert (choice.worker_id, choice.overlap_blocks, choice.uncached_blocks) == ("A", 4, 0)


def test_prefill_ties_take_turns_in_worker_id_order():
    loads = idle("w2", "w0", "w1")
    picks = [choose_prefill_worker(5, {}, loads, rotation=r).worker_id for r in range(4)]
    assert picks == ["w0", "w1", "w2", "w0"]
    # Only the tied workers take turns: w1 holds a block, so it always wins.
    picks = [choose_prefill_worker(5, {"w1": 1}, loads, rotation=r).worker_id for r in range(3)]
    assert picks == ["w1", "w1", "w1"]


def test_decode_worker_by_kv_usage_then_running_then_waiting():
    loads = [WorkerLoad("A", num_running=1, kv_cache_usage=0.6),
             WorkerLoad("B", num_running=9, kv_cache_usage=0.2),
             WorkerLoad("C", num_running=3, kv_cache_usage=0.2)]
    assert choose_decode_worker(loads) == "C"
    loads.append(WorkerLoad("D", num_running=3, num_waiting=1, kv_cache_usage=0.2))
    assert choose_decode_worker(loads) == "C"
    loads.append(WorkerLoad("E", num_running=3, kv_cache_usage=0.2))
    assert [choose_decode_worker(loads, rotation=r) for r in range(3)] == ["C", "E", "C"]


def test_decode_worker_holding_most_of_the_prompt_wins_past_the_minimum():
    loads = [WorkerLoad("A", num_running=6, kv_cache_usage=0.1),
             WorkerLoad("B", num_running=8, kv_cache_usage=0.7),
             WorkerLoad("C", num_running=8, kv_cache_usage=0.6)]
    # B and C hold the chat's history (C more lightly loaded), A holds nothing.
    assert choose_decode_worker(loads, cached_tokens={"B": 96, "C": 96},
                                min_cached_tokens=64) == "C"
    assert choose_decode_worker(loads, cached_tokens={"B": 112, "C": 96},
                                min_cached_tokens=64) == "B"
    # Under the minimum (less than half of the prompt): by load alone.
    assert choose_decode_worker(loads, cached_tokens={"B": 48}, min_cached_tokens=64) == "A"
    assert choose_decode_worker(loads, cached_tokens={"B": 96}, min_cached_tokens=0) == "A"
    # A holder much busier than the least busy does not get it: a shared prefix must not
    # pin every request to one worker.
    loads[0] = WorkerLoad("A", num_running=1, kv_cache_usage=0.1)
    assert choose_decode_worker(loads, cached_tokens={"B": 96, "C": 96},
                                min_cached_tokens=64) == "A"


def test_no_workers():
    with pytest.raises(NoWorkersError):
        choose_prefill_worker(3, {}, [])
    with pytest.raises(NoWorkersError):
        choose_decode_worker([])


def test_short_prompts_prefill_locally():
    assert should_prefill_locally(31, 32)
    assert not should_prefill_locally(32, 32)
    assert not should_prefill_locally(1, 0)


def test_shares_compute_by_host_cpus_and_gpu():
    assert shares_compute("cpu@n1:0,1", "cpu@n1:1,2")
    assert not shares_compute("cpu@n1:0,1", "cpu@n1:2,3")  # pinned apart on one host
    assert shares_compute("cpu@n1:0-3", "cpu@n1:3,8")
    assert not shares_compute("cpu@n1:0,1", "cpu@n2:0,1")
    assert not shares_compute("cpu@n1:0,1", "cuda@n1:0")
    assert shares_compute("cuda@n1:GPU-aa", "cuda@n2:GPU-aa")  # a UUID is one GPU anywhere
    assert not shares_compute("cuda@n1:GPU-aa", "cuda@n1:GPU-bb")
    assert shares_compute("cuda@n1:0", "cuda@n1:0") and not shares_compute("cuda@n1:0",
                                                                            "cuda@n1:1")
    assert not shares_compute("", "cpu@n1:0") and not shares_compute("", "")


def test_prefill_path_rules_in_order():
    """No pool, short, cached on the decode worker, shared hardware, a busy pool, and the
    pool: each rule with the smallest change of input that flips it."""
    apart = {"P": "cpu@n2:0-7"}
    choice = PrefillChoice("P", 0, 16, 16.0)

    def path(tokens=256, cached=0, threshold=16, decode="cpu@n1:0-7", prefill=apart,
             waiting=0):
        return choose_prefill_path(tokens, cached, threshold, decode, prefill, choice,
                                   WorkerLoad("P", num_waiting=waiting), 4)

    assert path() == PrefillPath("P", "remote")
    assert path(prefill={}) == PrefillPath(None, "no_prefill_worker")
    assert path(tokens=15) == PrefillPath(None, "short_prompt")
    assert path(tokens=16) == PrefillPath("P", "remote")
    assert path(cached=241) == PrefillPath(None, "cached_on_decode")  # 15 left
    assert path(cached=240) == PrefillPath("P", "remote")
    assert path(threshold=0, tokens=1) == PrefillPath("P", "remote")
    assert path(prefill={"P": "cpu@n1:4"}) == PrefillPath(None, "shared_compute")
    assert path(prefill={"P": "cpu@n1:8"}) == PrefillPath("P", "remote")
    assert path(waiting=4) == PrefillPath(None, "prefill_busy")
    assert path(waiting=3) == PrefillPath("P", "remote")


def test_router_config_refuses_unknown_policies_by_name():
    from pdserve.router.config import RouterConfig

    with pytest.raises(ValueError, match="prefill_routing='random'"):
        RouterConfig("m", "redis://x", prefill_routing="random")
    with pytest.raises(ValueError, match="disaggregation='sometimes'"):
        RouterConfig("m", "redis://x", disaggregation="sometimes")
    assert RouterConfig("m", "redis://x", prefill_routing="round-robin").prefill_routing == \
        "round-robin"
