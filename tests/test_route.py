"""``Router.route``'s array scoring against the routing policy's pure functions (the spec):
on random loads, overlaps, placements and caps, both pick the same workers and reason,
round-robin ties included."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from pdserve.router.route import Router, RouteSettings
from pdserve.router.routing_policy import (
    WorkerLoad,
    choose_decode_worker,
    choose_prefill_path,
    choose_prefill_worker,
    shares_compute,
)

COMPUTES = ["", "cpu@h1:0-1", "cpu@h1:2-3", "cpu@h1:1-2", "cpu@h2:0-3", "cuda@h1:0"]


class FakeIndex:
    def __init__(self, slots: dict[str, int]) -> None:
        self.slots = slots

    def slot_of(self, worker_id: str) -> int | None:
        return self.slots.get(worker_id)


def spec(settings, loads_d, loads_p, computes, overlaps, num_tokens, num_blocks, rotation):
    """What ModelService's rules give, with the pure functions."""
    block = settings.block_size
    cached = {w.worker_id: min(overlaps.get(w.worker_id, 0) * block, num_tokens)
              for w in loads_d}
    decode = choose_decode_worker(
        loads_d, rotation=next(rotation["decode"]), cached_tokens=cached,
        min_cached_tokens=max(settings.local_prefill_threshold, num_tokens // 2, 1))
    if not loads_p:
        return decode, None, "no_prefill_worker"
    if num_tokens < settings.local_prefill_threshold:
        return decode, None, "short_prompt"
    apart = [w for w in loads_p if not shares_compute(computes[decode], computes[w.worker_id])]
    choice = None
    if apart and settings.prefill_routing == "round-robin":
        turn = sorted(apart, key=lambda w: w.worker_id)[next(rotation["prefill"]) % len(apart)]
        choice = choose_prefill_worker(num_blocks, overlaps, [turn], 0.0)
    elif apart:
        choice = choose_prefill_worker(num_blocks, overlaps, apart, settings.overlap_weight,
                                       rotation=next(rotation["prefill"]))
    load = None if choice is None else next(w for w in loads_p
                                            if w.worker_id == choice.worker_id)
    path = choose_prefill_path(
        num_tokens, cached[decode], settings.local_prefill_threshold, computes[decode],
        {w.worker_id: computes[w.worker_id] for w in loads_p}, choice, load,
        settings.max_prefill_queue_size)
    return decode, path.prefill_worker_id, path.reason


@pytest.mark.parametrize("seed", range(40))
def test_route_agrees_with_the_policy_functions(seed):
    rng = random.Random(seed)
    settings = RouteSettings(block_size=4, local_prefill_threshold=rng.choice([0, 8, 40]),
                             prefill_routing=rng.choice(["prefix-aware", "round-robin"]),
                             overlap_weight=rng.choice([0.0, 0.5, 1.0]),
                             max_prefill_queue_size=rng.choice([2, 100]))
    decode_ids = [f"d{i}" for i in range(rng.randrange(1, 6))]
    prefill_ids = [f"p{i}" for i in range(rng.randrange(0, 6))]
    computes = {w: rng.choice(COMPUTES) for w in decode_ids + prefill_ids}
    ids = decode_ids + prefill_ids
    index = FakeIndex({w: slot for slot, w in enumerate(ids) if rng.random() < 0.8})
    router = Router(settings, index, bytes(16), {w: computes[w] for w in prefill_ids},
                    {w: computes[w] for w in decode_ids})
    rotation = {"prefill": itertools.count(), "decode": itertools.count()}
    routed = dict.fromkeys(ids, 0)
    health = {}
    for w in ids:  # few distinct values, so ties are common
        health[w] = (rng.randrange(3), rng.randrange(3), rng.choice([0.0, 0.25, 0.5]))
        (router.decode if w in decode_ids else router.prefill).set_load(w, *health[w])
    reasons = set()
    for _ in range(30):
        num_tokens = rng.randrange(1, 64)
        num_blocks = num_tokens // 4
        counts = np.zeros(len(ids), dtype=np.int32)
        for w, slot in index.slots.items():
            counts[slot] = rng.choice([0, 0, num_blocks, rng.randrange(num_blocks + 1)])
        overlaps = {w: int(counts[s]) for w, s in index.slots.items() if counts[s]}
        loads = {w: WorkerLoad(w, health[w][0], health[w][1] + routed[w], health[w][2])
                 for w in ids}
        expected = spec(settings, [loads[w] for w in decode_ids],
                        [loads[w] for w in prefill_ids], computes, overlaps, num_tokens,
                        num_blocks, rotation)
        got = router.decide(num_tokens, num_blocks, counts)
        assert (got.decode_worker_id, got.prefill_worker_id, got.reason) == expected
        reasons.add(got.reason)
        routed[got.decode_worker_id] += 1
        if got.prefill_worker_id is not None:
            routed[got.prefill_worker_id] += 1
            assert got.overlap_blocks == overlaps.get(got.prefill_worker_id, 0)
    assert reasons


def test_the_worked_example_of_the_policy():
    """routing_policy's docstring example: B (idle, nothing cached) beats A (8 of 10)."""
    router = Router(RouteSettings(block_size=16), FakeIndex({"A": 0, "B": 1}), bytes(16),
                    {"A": "", "B": ""}, {"D": ""})
    router.prefill.set_load("A", 4, 2, 0.5)
    counts = np.array([8, 0], dtype=np.int32)
    decision = router.decide(160, 10, counts)
    assert (decision.prefill_worker_id, decision.reason, decision.overlap_blocks) == \
        ("B", "remote", 0)
