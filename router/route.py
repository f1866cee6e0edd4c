"""The routing decision at scale: ``Router.route(token_ids) -> RouteDecision`` over the
workers' loads kept in arrays (docs/architecture.md, A request's path, step 1).

The rules are ``router/routing_policy.py``'s (the spec, as pure functions over
``WorkerLoad``s); here they run in O(candidates) numpy passes with no per-decision
objects: ``RoleArrays`` holds one role's workers ordered by id (so ties taking turns by
``rotation`` fall as in the spec), their last Health (running, waiting, KV usage), the
requests routed since (counted as waiting, as ``WorkerHandle.current_load`` does), and
their placements parsed once into a shares-compute matrix. The overlaps come from the
in-memory prefix index (``LocalPrefixIndex.lookup_slots``), one int32 per worker slot.

Usable without gRPC or workers: build a ``Router`` from a config, an index and the
workers' ids and placements, feed it loads, ask ``route``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.router.routing_policy import LoadWeights, NoWorkersError, shares_compute

_TIE_TOLERANCE = 1e-9


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """Where one request goes: ``decode_worker_id``; ``prefill_worker_id``, or None to
    prefill on the decode worker; ``overlap_blocks``, the leading prompt blocks the
    prefilling worker (the prefill worker, else the decode worker) caches;
    ``num_blocks``, the prompt's full blocks; ``reason``, one of
    ``routing_policy.PREFILL_PATH_REASONS``."""

    decode_worker_id: str
    prefill_worker_id: str | None
    overlap_blocks: int
    num_blocks: int
    reason: str


class RoleArrays:
    """One role's workers, ordered by id, with their loads as float64 arrays [n].

    Args:
        workers: worker id -> its ``compute`` placement ("" when unknown).
    """

    def __init__(self, workers: Mapping[str, str]) -> None:
        self.ids = sorted(workers)
        self.position = {worker_id: i for i, worker_id in enumerate(self.ids)}
        self.computes = [workers[i] for i in self.ids]
        n = len(self.ids)
        self.running = np.zeros(n)
        self.waiting = np.zeros(n)
        self.kv_usage = np.zeros(n)
        self.routed = np.zeros(n)  # requests routed since the last Health
        self.slots = np.full(n, -1, dtype=np.int64)  # prefix index slots, -1: none

    def set_load(self, worker_id: str, num_running: int, num_waiting: int,
                 kv_cache_usage: float) -> None:
        """A Health answer: the load, and the routed count back to 0."""
        i = self.position[worker_id]
        self.running[i], self.waiting[i] = num_running, num_waiting
        self.kv_usage[i], self.routed[i] = kv_cache_usage, 0

    def overlaps(self, counts: np.ndarray | None) -> np.ndarray:
        """Leading blocks per worker [n] from an index lookup per slot (None: zeros)."""
        if counts is None or not len(self.ids):
            return np.zeros(len(self.ids), dtype=np.int64)
        return np.where(self.slots >= 0, counts[np.maximum(self.slots, 0)], 0)


def choose_decode(arrays: RoleArrays, mask: np.ndarray, cached_tokens: np.ndarray,
                  min_cached_tokens: int, rotation: int) -> int:
    """``routing_policy.choose_decode_worker`` over ``arrays`` restricted to ``mask``
    (bool [n], at least one True); returns the chosen position."""
    waiting = arrays.waiting + arrays.routed
    busy = arrays.running + waiting
    pick = mask
    if min_cached_tokens > 0 and np.any(mask & (cached_tokens > 0)):
        least = busy[mask].min()
        holders = mask & (cached_tokens >= min_cached_tokens) & \
            (busy <= least + max(2, int(least) // 4))
        if holders.any():
            pick = holders & (cached_tokens == cached_tokens[holders].max())
    for values in (arrays.kv_usage, arrays.running, waiting):
        pick = pick & (values == values[pick].min())
    tied = np.flatnonzero(pick)
    return int(tied[rotation % len(tied)])


def choose_prefill(arrays: RoleArrays, mask: np.ndarray, overlaps: np.ndarray,
                   num_blocks: int, overlap_weight: float, weights: LoadWeights,
                   rotation: int) -> int:
    """``routing_policy.choose_prefill_worker`` over ``arrays`` restricted to ``mask``
    (at least one True); returns the chosen position. Costs are computed in the spec's
    order of operations, so equal costs are equal here too."""
    overlap = np.minimum(np.maximum(overlaps, 0), num_blocks)
    load = (weights.waiting_blocks * (arrays.waiting + arrays.routed)
            + weights.running_blocks * arrays.running) + weights.kv_usage_blocks * arrays.kv_usage
    cost = overlap_weight * (num_blocks - overlap) + load
    best = cost[mask].min()
    tied = np.flatnonzero(mask & (cost - best <= _TIE_TOLERANCE))
    return int(tied[rotation % len(tied)])


@dataclass(frozen=True, slots=True)
class RouteSettings:
    """The ``RouterConfig`` fields a decision reads (same names and units)."""

    block_size: int
    local_prefill_threshold: int = 0
    disaggregation: str = "auto"
    prefill_routing: str = "prefix-aware"
    overlap_weight: float = 1.0
    max_prefill_queue_size: int = 2**31

    @classmethod
    def from_config(cls, config) -> RouteSettings:
        """The settings of a ``RouterConfig``."""
        return cls(config.block_size, config.local_prefill_threshold, config.disaggregation,
                   config.prefill_routing, config.overlap_weight,
                   config.max_prefill_queue_size)


class Router:
    """Routing decisions without RPCs: the prompt's hashes, one in-memory index lookup,
    array scoring.

    Args:
        settings: ``RouteSettings`` (``RouteSettings.from_config(router_config)``).
        index: a ``LocalPrefixIndex`` (or anything with ``lookup_slots(packed) ->
            int32 [capacity]`` and ``slot_of(worker_id)``), or None to route by load.
        root_hash: the chain's ``h_{-1}`` (``engine.block_hash.root_block_hash``).
        prefill, decode: worker id -> placement, per role.
    """

    def __init__(self, settings: RouteSettings, index, root_hash: bytes,
                 prefill: Mapping[str, str], decode: Mapping[str, str]) -> None:
        self.settings = settings
        self.index = index
        self.root_hash = root_hash
        self.weights = LoadWeights()
        self.prefill = RoleArrays(prefill)
        self.decode = RoleArrays(decode)
        # NOTE: placements parsed once: [decode i, prefill j] True when they share compute
        self.shares = np.array([[shares_compute(d, p) for p in self.prefill.computes]
                                for d in self.decode.computes], dtype=bool).reshape(
                                    len(self.decode.ids), len(self.prefill.ids))
        self._rotation = {"prefill": itertools.count(), "decode": itertools.count()}
        self.refresh_slots()

    def refresh_slots(self) -> None:
        """Re-read each worker's index slot (after workers published for the first time
        or were forgotten)."""
        for arrays in (self.prefill, self.decode):
            for i, worker_id in enumerate(arrays.ids):
                slot = None if self.index is None else self.index.slot_of(worker_id)
                arrays.slots[i] = -1 if slot is None else slot

    def route(self, token_ids: Sequence[int], cache_salt: str | None = None, *,
              decode_open: np.ndarray | None = None, prefill_open: np.ndarray | None = None
              ) -> RouteDecision:
        """The decode worker and the prefill path of a prompt, counted as routed.

        Args:
            token_ids: the prompt.
            cache_salt: the request's ``cache_salt``.
            decode_open, prefill_open: bool masks of the workers below their caps (all
                when None).

        Raises:
            PrefixIndexUnavailable: from the index (the caller routes by load alone).
            ValueError: no decode worker is open.
            NoWorkersError: ``disaggregation="always"`` and no prefill worker is open.
        """
        from pdserve.cluster.block_index import hash_chain_packed

        s = self.settings
        packed = hash_chain_packed(token_ids, s.block_size, self.root_hash, cache_salt)
        num_blocks = len(packed) // 16
        counts = self.index.lookup_slots(packed) if self.index is not None and packed \
            else None
        return self.decide(len(token_ids), num_blocks, counts, decode_open, prefill_open)

    def decide(self, num_tokens: int, num_blocks: int, counts: np.ndarray | None,
               decode_open: np.ndarray | None = None,
               prefill_open: np.ndarray | None = None) -> RouteDecision:
        """``route`` after the lookup: ``counts`` is the index's answer per slot."""
        s, d, p = self.settings, self.decode, self.prefill
        d_mask = np.ones(len(d.ids), dtype=bool) if decode_open is None else decode_open
        if not d_mask.any():
            raise ValueError("no open decode worker")
        d_over = d.overlaps(counts)
        cached = np.minimum(d_over * s.block_size, num_tokens)
        i = choose_decode(d, d_mask, cached, max(s.local_prefill_threshold, num_tokens // 2, 1),
                          next(self._rotation["decode"]))
        d.routed[i] += 1
        decision = RouteDecision(d.ids[i], None, int(d_over[i]), num_blocks, "")
        if not len(p.ids):
            return _with(decision, reason="no_prefill_worker")
        if num_tokens < s.local_prefill_threshold:
            return _with(decision, reason="short_prompt")
        always = s.disaggregation == "always"
        apart = np.ones(len(p.ids), dtype=bool) if always else ~self.shares[i]
        open_ = np.ones(len(p.ids), dtype=bool) if prefill_open is None else prefill_open
        mask = apart & open_
        p_over = p.overlaps(counts)
        j = None
        if mask.any() and s.prefill_routing == "round-robin":
            tied = np.flatnonzero(mask)
            j = int(tied[next(self._rotation["prefill"]) % len(tied)])
        elif mask.any():
            j = choose_prefill(p, mask, p_over, num_blocks, s.overlap_weight, self.weights,
                               next(self._rotation["prefill"]))
        if always and j is None:
            raise NoWorkersError("every prefill worker is at capacity")
        if always:
            reason = "remote"
        elif apart.any() and j is None:
            reason = "prefill_busy"
        elif num_tokens - int(cached[i]) < s.local_prefill_threshold:
            reason = "cached_on_decode"
        elif j is None or self.shares[i].all():
            reason = "shared_compute"
        elif p.waiting[j] + p.routed[j] >= s.max_prefill_queue_size:
            reason = "prefill_busy"
        else:
            reason = "remote"
        if reason != "remote":
            return _with(decision, reason=reason)
        p.routed[j] += 1
        return RouteDecision(d.ids[i], p.ids[j], int(p_over[j]), num_blocks, "remote")


def _with(decision: RouteDecision, **changes) -> RouteDecision:
    return RouteDecision(**{**{f: getattr(decision, f) for f in RouteDecision.__slots__},
                            **changes})
