"""The request path's one-call native routing (``Router.route_decode`` / ``route_prefill``
over ``block_index.role_view``, ``BlockIndex.lookup_tokens``, ``overlap_census``) against
the numpy and Python reference paths they replace: random loads, caps, exclusions and
health, with the odd cases (no worker live, all excluded, all at their caps, ties, a
prompt cached to its last block) forced in."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from pdserve.cluster import block_index
from pdserve.engine.block_hash import hash_block_chain
from pdserve.router import route
from pdserve.router.route import ALL_FULL, NO_LIVE, Router, RouteSettings
from pdserve.router.routing_policy import NoWorkersError

COMPUTES = ["", "cpu@h1:0-1", "cpu@h1:2-3", "cpu@h2:0-3"]


class FakeIndex:
    def __init__(self, slots: dict[str, int]) -> None:
        self.slots = slots

    def slot_of(self, worker_id: str) -> int | None:
        return self.slots.get(worker_id)


def make_router(rng: random.Random, settings, decode_ids, prefill_ids, computes, index):
    router = Router(settings, index, bytes(16), {w: computes[w] for w in prefill_ids},
                    {w: computes[w] for w in decode_ids})
    router._rotation = {"prefill": itertools.count(), "decode": itertools.count()}
    return router


def set_state(router: Router, state: dict) -> None:
    for arrays in (router.decode, router.prefill):
        for w in arrays.ids:
            running, waiting, kv, healthy, inflight, at_health = state[w]
            arrays.set_load(w, running, waiting, kv)
            i = arrays.position[w]
            arrays.healthy[i] = healthy
            arrays.inflight[i] = inflight
            arrays.inflight_at_health[i] = at_health
            arrays.update_others(i)


def step(router: Router, native: bool, args: tuple):
    """One decision as ``RoutingStep`` makes it; the native path or the reference."""
    saved = route._native
    if not native:
        route._native = False
    try:
        num_tokens, num_blocks, counts, exclude, admit, caps = args
        i = router.route_decode(num_tokens, counts, exclude, admit, caps[0], caps[1])
        if i < 0:
            return ("decode", i)
        try:
            decision = router.route_prefill(i, num_tokens, num_blocks, counts, exclude, admit,
                                            caps[2])
        except NoWorkersError:
            return ("no prefill", router.decode.ids[i])
        return decision
    finally:
        route._native = saved


@pytest.mark.parametrize("seed", range(60))
def test_one_call_routing_agrees_with_the_reference_paths(seed):
    rng = random.Random(seed)
    settings = RouteSettings(block_size=4, local_prefill_threshold=rng.choice([0, 8, 40]),
                             disaggregation=rng.choice(["auto", "auto", "always"]),
                             prefill_routing=rng.choice(["prefix-aware", "round-robin"]),
                             overlap_weight=rng.choice([0.0, 0.5, 1.0]),
                             max_prefill_queue_size=rng.choice([2, 100]))
    decode_ids = [f"d{i}" for i in range(rng.randrange(0, 6))]
    prefill_ids = [f"p{i}" for i in range(rng.randrange(0, 6))]
    ids = decode_ids + prefill_ids
    computes = {w: rng.choice(COMPUTES) for w in ids}
    index = FakeIndex({w: slot for slot, w in enumerate(ids) if rng.random() < 0.8})
    routers = [make_router(rng, settings, decode_ids, prefill_ids, computes, index)
               for _ in range(2)]
    state = {w: (rng.randrange(3), rng.randrange(3), rng.choice([0.0, 0.25, 0.5, 0.9]),
                 rng.random() < 0.7, rng.randrange(3), rng.randrange(2)) for w in ids}
    if rng.random() < 0.2:  # nobody healthy: every worker counts as live
        state = {w: s[:3] + (False,) + s[4:] for w, s in state.items()}
    for router in routers:
        set_state(router, state)
    outcomes = set()
    for _ in range(40):
        num_tokens = rng.randrange(1, 64)
        num_blocks = num_tokens // 4
        counts = None
        if rng.random() < 0.8:
            counts = np.zeros(len(ids) + 2, dtype=np.int32)
            for slot in index.slots.values():  # the last block cached, often
                counts[slot] = rng.choice([0, num_blocks, num_blocks, rng.randrange(num_blocks + 1)])
        exclude = set(rng.sample(ids, rng.randrange(len(ids) + 1))) if rng.random() < 0.3 \
            else set()
        if rng.random() < 0.1:
            exclude = set(ids)  # all excluded
        admit = rng.random() < 0.7
        caps = (rng.choice([1, 2, 4, 100]), rng.choice([None, 0.3, 1.0]),
                rng.choice([1, 2, 4, 100]))
        args = (num_tokens, num_blocks, counts, exclude, admit, caps)
        got = step(routers[0], True, args)
        expected = step(routers[1], False, args)
        assert got == expected
        outcomes.add(got[1] if isinstance(got, tuple) else got.reason)
        for a, b in zip((routers[0].decode, routers[0].prefill),
                        (routers[1].decode, routers[1].prefill)):
            np.testing.assert_array_equal(a.routed, b.routed)
    if decode_ids:
        assert outcomes - {NO_LIVE, ALL_FULL}


def test_the_odd_cases_of_the_decode_choice():
    router = Router(RouteSettings(block_size=4), FakeIndex({"a": 0, "b": 1, "c": 2}),
                    bytes(16), {}, {"a": "", "b": "", "c": ""})
    assert router.route_decode(8, None, {"a", "b", "c"}) == NO_LIVE  # all excluded
    router.decode.inflight[:] = 3
    assert router.route_decode(8, None, (), True, 3) == ALL_FULL
    router.decode.inflight[:] = 0
    # ties take turns, in id order, only when a choice is made (routed counts back to 0)
    turns = []
    for _ in range(3):
        turns.append(router.route_decode(8, None))
        router.decode.routed[:] = 0
    assert turns == [0, 1, 2]
    # cached to the last block: c holds the whole prompt
    assert router.route_decode(8, np.array([1, 0, 2], dtype=np.int32)) == 2
    router.decode.healthy[1] = True  # only b is healthy: the others are not live
    assert router.route_decode(8, np.array([1, 0, 2], dtype=np.int32)) == 1


def test_no_prefill_worker_and_short_prompts():
    router = Router(RouteSettings(block_size=4, local_prefill_threshold=16), None,
                    bytes(16), {"p": "cpu@h:0"}, {"d": "cpu@h:1"})
    i = router.route_decode(32, None)
    assert router.route_prefill(i, 32, 8, None, {"p"}).reason == "no_prefill_worker"
    assert router.route_prefill(i, 8, 2, None).reason == "short_prompt"
    decision = router.route_prefill(i, 32, 8, None)
    assert (decision.prefill_worker_id, decision.reason) == ("p", "remote")
    router.prefill.inflight[:] = 1
    assert router.route_prefill(i, 32, 8, None, (), True, 1).reason == "prefill_busy"


@pytest.mark.parametrize("seed", range(8))
def test_lookup_tokens_is_lookup_of_the_chain(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 16])
    capacity = rng.choice([3, 64, 130])
    index = block_index.new_block_index(capacity)
    prompts = [[rng.randrange(0, 2**31) for _ in range(block_size * rng.randrange(0, 12))]
               for _ in range(6)]
    salt = rng.choice([None, "tenant"])
    root = bytes(range(16))
    for slot in range(capacity):
        chain = hash_block_chain(rng.choice(prompts), block_size, root, salt)
        index.add(slot, block_index.packed(chain[:rng.randrange(len(chain) + 1)]))
    for prompt in prompts:
        for tokens in (prompt, prompt + [1, 2, 3][:block_size - 1],  # a partial last block
                       prompt[:block_size] + [7] * block_size, [5] * block_size, []):
            chain = block_index.hash_chain_packed(tokens, block_size, root, salt)
            expected = index.lookup(chain)
            raw = salt.encode() if salt else b""
            for given in (tokens, tuple(tokens), np.array(tokens, dtype=np.int64)):
                num_blocks, counts = index.lookup_tokens(given, block_size, root, raw)
                assert num_blocks == len(tokens) // block_size
                np.testing.assert_array_equal(counts, expected)


def test_token_ids_of_every_size_hash_as_the_python_chain():
    tokens = [0, 1, 2**30 - 1, 2**30, 2**31, 2**62, -1, -(2**40), True, 7, 2**63 - 1, 3]
    expected = hash_block_chain(tokens, 4, bytes(16))
    assert block_index.hash_chain(tokens, 4, bytes(16)) == expected


def test_overlap_census():
    native = block_index.scoring()
    counts = np.array([0, 3, 0, 1, 5], dtype=np.int32)
    assert native.overlap_census(counts, np.array([1, 2, 7], dtype=np.int64)) == (1, 3)
    assert native.overlap_census(counts[:0], np.array([0], dtype=np.int64)) == (0, 0)
