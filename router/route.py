"""The routing decision at scale: ``Router.route(token_ids) -> RouteDecision`` over the
workers' loads kept in arrays (docs/architecture.md, A request's path, step 1).

The rules are ``router/routing_policy.py``'s (the spec, as pure functions over
``WorkerLoad``s); here they run in O(candidates) numpy passes with no per-decision
objects: ``RoleArrays`` holds one role's workers ordered by id (so ties taking turns by
``rotation`` fall as in the spec), their last Health (running, waiting, KV usage), the
requests routed since (counted as waiting, as ``WorkerHandle.current_load`` does), and
their placements parsed once into a shares-compute matrix. The overlaps come from the
in-memory prefix index (``LocalPrefixIndex.lookup_prompt``), one int32 per worker slot.
The request path's step (``route_decode``, ``route_prefill``) is one native call per
choice (``block_index.role_view``: the live and admission masks and the scoring in one
pass, no numpy temporaries); the numpy and Python paths stay where the extension is
not built, and as the reference ``tests/test_route_native.py`` holds it to.

Usable without gRPC or workers: build a ``Router`` from a config, an index and the
workers' ids and placements, feed it loads, ask ``route``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.cluster import block_index
from pdserve.router.routing_policy import (
    LoadWeights,
    NoWorkersError,
    WorkerLoad,
    choose_decode_worker,
    choose_prefill_worker,
    shares_compute,
)


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
    """One role's workers, ordered by id, with their loads in ``table``, float64
    [4, n]: rows KV usage, running, waiting (the last Health), and routed since then;
    and what admission reads: ``healthy`` (bool [n]), ``inflight`` (this router's calls
    on each now) and ``inflight_at_health`` (the most of it while its last Health ran),
    float64 [n]. ``router/workers.py``'s handles write through to these.

    Args:
        workers: worker id -> its ``compute`` placement ("" when unknown).
    """

    KV, RUNNING, WAITING, ROUTED = range(4)

    def __init__(self, workers: Mapping[str, str]) -> None:
        self.ids = sorted(workers)
        self.position = {worker_id: i for i, worker_id in enumerate(self.ids)}
        self.computes = [workers[i] for i in self.ids]
        n = len(self.ids)
        self.table = np.zeros((4, n))
        self.slots = np.full(n, -1, dtype=np.int64)  # prefix index slots, -1: none
        self.everyone = np.ones(n, dtype=np.uint8)
        self.healthy = np.zeros(n, dtype=bool)
        self._all = np.ones(n, dtype=bool)
        self.inflight = np.zeros(n)
        self.inflight_at_health = np.zeros(n)
        self.others = np.zeros(n)  # running + waiting - inflight_at_health, at least 0
        self._view = None  # the native scoring of these arrays, made on first use

    def native(self):
        """The native scoring over these arrays (``block_index.role_view``: the live and
        admission masks and a choice in one call), None where the extension is not
        built."""
        if _scoring() is None:
            return None
        if self._view is None:
            self._view = block_index.role_view(self.table, self.healthy, self.inflight,
                                               self.others, self.slots)
        return self._view

    def exclude_mask(self, exclude) -> np.ndarray:
        """uint8 [n]: 1 for the workers of ``exclude`` (ids); an empty array when none
        (what ``native().decode`` and ``prefill`` take)."""
        if not exclude:
            return _NO_MASK
        mask = np.zeros(len(self.ids), dtype=np.uint8)
        for worker_id in exclude:
            i = self.position.get(worker_id)
            if i is not None:
                mask[i] = 1
        return mask

    def live(self, exclude=()) -> np.ndarray:
        """``WorkerPool.live`` as a bool mask [n]: the workers not in ``exclude`` (ids),
        the healthy ones among them when any are."""
        if not exclude:  # NOTE: no copy: callers combine masks into new ones
            return self.healthy if np.count_nonzero(self.healthy) else self._all
        base = np.ones(len(self.ids), dtype=bool)
        for worker_id in exclude:
            i = self.position.get(worker_id)
            if i is not None:
                base[i] = False
        healthy = base & self.healthy
        return healthy if np.count_nonzero(healthy) else base

    def below_caps(self, max_inflight: int, max_kv_usage: float | None = None) -> np.ndarray:
        """Bool mask [n] of the workers whose admission count
        (``WorkerHandle.admission_count``, sequences) is under ``max_inflight`` and, when
        given, whose KV usage is under ``max_kv_usage``."""
        mask = self.inflight + self.others < max_inflight
        if max_kv_usage is not None:
            mask &= self.table[self.KV] < max_kv_usage
        return mask

    def update_others(self, i: int) -> None:
        """Re-derive worker ``i``'s sequences of other routers (``others``) after its load
        or ``inflight_at_health`` changed."""
        t = self.table
        self.others[i] = max(0.0, t[self.RUNNING, i] + t[self.WAITING, i]
                             - self.inflight_at_health[i])

    @property
    def routed(self) -> np.ndarray:
        """Requests routed to each worker since its last Health, [n] (a view)."""
        return self.table[self.ROUTED]

    @property
    def waiting(self) -> np.ndarray:
        """Waiting sequences of each worker's last Health, [n] (a view)."""
        return self.table[self.WAITING]

    def set_load(self, worker_id: str, num_running: int, num_waiting: int,
                 kv_cache_usage: float) -> None:
        """A Health answer: the load, and the routed count back to 0."""
        i = self.position[worker_id]
        self.table[:, i] = (kv_cache_usage, num_running, num_waiting, 0)
        self.update_others(i)

    def overlap(self, i: int, counts) -> int:
        """Worker ``i``'s leading blocks in an index lookup per slot (or a mapping worker
        id -> blocks; None: 0)."""
        if isinstance(counts, Mapping):
            return int(counts.get(self.ids[i], 0))
        slot = self.slots[i]
        return 0 if counts is None or slot < 0 or slot >= len(counts) else int(counts[slot])


_NO_COUNTS = np.zeros(0, dtype=np.int32)
_NO_MASK = np.zeros(0, dtype=np.uint8)
# ``Router.route_decode`` / ``route_prefill`` results other than a position (the native
# ``RoleView``'s constants): no live worker; live ones, all at their admission caps
NO_LIVE, ALL_FULL, _SHORT, _NONE_APART = -1, -2, -3, -4
_native = None


def _scoring():
    """The native scoring module, or None where the extension cannot be built (then
    ``routing_policy``'s functions score, over the same arrays)."""
    global _native
    if _native is None:
        try:
            _native = block_index.scoring()
        except (RuntimeError, OSError, ImportError):
            _native = False
    return _native or None


def _u8(mask: np.ndarray) -> np.ndarray:
    """A bool or integer mask as uint8, without a copy for bool."""
    return mask.view(np.uint8) if mask.dtype == bool else mask.astype(np.uint8)


def _overlaps(arrays: RoleArrays, counts) -> tuple[np.ndarray, np.ndarray]:
    """(slots, counts) for the scoring functions: ``counts`` per index slot (int32
    array), None (no lookup), or a mapping worker id -> overlap blocks (the Redis
    index's answer; converted per position)."""
    if counts is None:
        return arrays.slots, _NO_COUNTS
    if isinstance(counts, np.ndarray):
        return arrays.slots, counts
    return (np.arange(len(arrays.ids), dtype=np.int64),
            np.array([counts.get(w, 0) for w in arrays.ids], dtype=np.int32))


def _loads(arrays: RoleArrays, positions) -> list[WorkerLoad]:
    """The spec's ``WorkerLoad``s of ``positions`` (routed counted as waiting)."""
    t = arrays.table
    return [WorkerLoad(arrays.ids[i], int(t[arrays.RUNNING, i]),
                       int(t[arrays.WAITING, i] + t[arrays.ROUTED, i]), float(t[arrays.KV, i]))
            for i in positions]


def choose_decode(arrays: RoleArrays, mask: np.ndarray, counts, block_size: int,
                  num_tokens: int, min_cached_tokens: int, rotation: int) -> int:
    """``routing_policy.choose_decode_worker`` over ``arrays`` restricted to ``mask``
    (uint8 [n], at least one set), with cached tokens ``min(overlap * block_size,
    num_tokens)``; ``counts`` as ``_overlaps`` takes it; returns the chosen position.
    Native (``cluster/csrc``): numpy's per-call overhead was most of a decision at 500
    workers; the spec's function where the extension is not built."""
    slots, per_slot = _overlaps(arrays, counts)
    native = _scoring()
    if native is not None:
        return native.choose_decode(arrays.table, mask, slots, per_slot, block_size,
                                    num_tokens, min_cached_tokens, rotation)
    positions = np.flatnonzero(mask)
    cached = {arrays.ids[i]: min(_overlap(slots, per_slot, i) * block_size, num_tokens)
              for i in positions}
    worker_id = choose_decode_worker(_loads(arrays, positions), rotation=rotation,
                                     cached_tokens=cached, min_cached_tokens=min_cached_tokens)
    return arrays.position[worker_id]


def _overlap(slots: np.ndarray, counts: np.ndarray, i: int) -> int:
    slot = slots[i]
    return 0 if slot < 0 or slot >= len(counts) else int(counts[slot])


def choose_prefill(arrays: RoleArrays, mask: np.ndarray, counts, num_blocks: int,
                   overlap_weight: float, weights: LoadWeights, rotation: int) -> int:
    """``routing_policy.choose_prefill_worker`` over ``arrays`` restricted to ``mask``
    (at least one set); returns the chosen position. Costs are computed in the spec's
    order of operations (and without fused multiply-adds), so equal costs are equal
    here too."""
    slots, per_slot = _overlaps(arrays, counts)
    native = _scoring()
    if native is not None:
        return native.choose_prefill(
            arrays.table, mask, slots, per_slot, num_blocks, overlap_weight,
            weights.waiting_blocks, weights.running_blocks, weights.kv_usage_blocks, rotation)
    positions = np.flatnonzero(mask)
    overlaps = {arrays.ids[i]: _overlap(slots, per_slot, i) for i in positions}
    choice = choose_prefill_worker(num_blocks, overlaps, _loads(arrays, positions),
                                   overlap_weight, weights=weights, rotation=rotation)
    return arrays.position[choice.worker_id]


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
            int32 [capacity]``, ``slot_of(worker_id)`` and, optionally,
            ``slots_version``, which changes when a slot is given or freed), or None to
            route by load.
        root_hash: the chain's ``h_{-1}`` (``engine.block_hash.root_block_hash``).
        prefill, decode: worker id -> placement, per role.
        rotation: the per-role tie counters (``{"prefill": count(), "decode": count()}``)
            to go on with, when this router replaces one (the pool's members changed).
    """

    def __init__(self, settings: RouteSettings, index, root_hash: bytes,
                 prefill: Mapping[str, str], decode: Mapping[str, str],
                 rotation: dict | None = None) -> None:
        self.settings = settings
        self.index = index
        self.root_hash = root_hash
        self.weights = LoadWeights()
        self.prefill = RoleArrays(prefill)
        self.decode = RoleArrays(decode)
        # NOTE: placements parsed once, not per decision
        shares = np.array([[shares_compute(d, p) for p in self.prefill.computes]
                           for d in self.decode.computes], dtype=bool).reshape(
                               len(self.decode.ids), len(self.prefill.ids))
        self.apart = (~shares).astype(np.uint8)  # [decode i, prefill j]: may prefill for i
        self._rotation = rotation or {"prefill": itertools.count(),
                                      "decode": itertools.count()}
        self._checked = None  # the last lookup answer whose slots were checked
        self.refresh_slots()

    def refresh_slots(self) -> None:
        """Re-read each worker's index slot (after workers published for the first time
        or were forgotten). ``decide`` calls it when a lookup names a slot unknown here."""
        # NOTE: the version before the slots: a slot given meanwhile is re-read next time
        self._slots_version = getattr(self.index, "slots_version", None)
        known = set()
        for arrays in (self.prefill, self.decode):
            for i, worker_id in enumerate(arrays.ids):
                slot = None if self.index is None else self.index.slot_of(worker_id)
                arrays.slots[i] = -1 if slot is None else slot
                if slot is not None:
                    known.add(slot)
        self._known_array = np.array(sorted(known), dtype=np.int64)

    def any_overlap(self, counts: np.ndarray) -> bool:
        """Whether an index lookup per slot gives any of these workers a block (the
        slots are re-read first when it names one unknown here)."""
        return self._check_slots(counts) > 0

    def _check_slots(self, counts: np.ndarray) -> int:
        """How many of these workers' slots ``counts`` gives blocks; re-reads the workers'
        slots first when the index gave or freed a slot since they were read (its
        ``slots_version``): a worker's first blocks, or slots given anew in another order
        (Redis restarted, the workers republished), where every slot a lookup credits is
        still one known here but may belong to another worker. An index without a version
        is re-read when another slot has blocks; slots of another model's workers then
        stay unknown and cost no re-read per lookup."""
        self._checked = counts
        version = getattr(self.index, "slots_version", None)
        if version is not None:
            if version != self._slots_version:
                self.refresh_slots()
            return self._census(counts)[0]
        known, total = self._census(counts)
        if known < total:
            self.refresh_slots()
            known, _ = self._census(counts)
        return known

    def _census(self, counts: np.ndarray) -> tuple[int, int]:
        """(slots of these workers with blocks in ``counts``, slots with blocks)."""
        native = _scoring()
        if native is not None:
            return native.overlap_census(counts, self._known_array)
        slots = self._known_array  # sorted
        if slots.size and slots[-1] >= len(counts):
            slots = slots[slots < len(counts)]
        return int(np.count_nonzero(counts[slots])), int(np.count_nonzero(counts))

    def route(self, token_ids: Sequence[int], cache_salt: str | None = None, *,
              decode_open: np.ndarray | None = None, prefill_open: np.ndarray | None = None,
              prefill_live: np.ndarray | None = None) -> RouteDecision:
        """The decode worker and the prefill path of a prompt, counted as routed.

        Args:
            token_ids: the prompt.
            cache_salt: the request's ``cache_salt``.
            decode_open, prefill_open: bool masks of the workers below their caps (all
                when None).
            prefill_live: bool mask of the live prefill workers (all when None).

        Raises:
            PrefixIndexUnavailable: from the index (the caller routes by load alone).
            ValueError: no decode worker is open.
            NoWorkersError: ``disaggregation="always"`` and no prefill worker is open.
        """
        s = self.settings
        if self.index is not None and hasattr(self.index, "lookup_prompt"):
            num_blocks, counts = self.index.lookup_prompt(token_ids, s.block_size,
                                                          self.root_hash, cache_salt)
            counts = counts if num_blocks else None
        else:
            packed = block_index.hash_chain_packed(token_ids, s.block_size, self.root_hash,
                                                   cache_salt)
            num_blocks = len(packed) // 16
            counts = self.index.lookup_slots(packed) if self.index is not None and packed \
                else None
        return self.decide(len(token_ids), num_blocks, counts, decode_open, prefill_open,
                           prefill_live=prefill_live)

    def decide(self, num_tokens: int, num_blocks: int, counts,
               decode_open: np.ndarray | None = None,
               prefill_open: np.ndarray | None = None, *,
               prefill_live: np.ndarray | None = None) -> RouteDecision:
        """``route`` after the lookup: ``counts`` is the index's answer per slot (int32
        array), a mapping worker id -> overlap blocks, or None (route by load)."""
        i = self.decide_decode(num_tokens, counts, decode_open)
        return self.decide_prefill(i, num_tokens, num_blocks, counts, prefill_open,
                                   prefill_live)

    def decide_decode(self, num_tokens: int, counts,
                      decode_open: np.ndarray | None = None) -> int:
        """The decode worker's position in ``self.decode``, counted as routed.

        Raises:
            ValueError: no decode worker is open.
        """
        s, d = self.settings, self.decode
        if isinstance(counts, np.ndarray) and counts is not self._checked:
            self._check_slots(counts)
        d_mask = d.everyone if decode_open is None else _u8(decode_open)
        if not len(d.ids) or (decode_open is not None and not np.count_nonzero(d_mask)):
            raise ValueError("no open decode worker")
        i = choose_decode(d, d_mask, counts, s.block_size, num_tokens,
                          max(s.local_prefill_threshold, num_tokens // 2, 1),
                          next(self._rotation["decode"]))
        d.routed[i] += 1
        return i

    def decide_prefill(self, i: int, num_tokens: int, num_blocks: int, counts,
                       prefill_open: np.ndarray | None = None,
                       prefill_live: np.ndarray | None = None) -> RouteDecision:
        """The prefill path of a prompt whose decode worker is at position ``i`` (the
        prefill worker counted as routed); the rules of ``routing_policy``'s
        ``choose_prefill_path`` over the live prefill workers.

        Raises:
            NoWorkersError: ``disaggregation="always"`` and no prefill worker is open.
        """
        s, d, p = self.settings, self.decode, self.prefill
        d_over = d.overlap(i, counts)
        live = p.everyone if prefill_live is None else _u8(prefill_live)
        if not len(p.ids) or not np.count_nonzero(live):
            return RouteDecision(d.ids[i], None, d_over, num_blocks, "no_prefill_worker")
        if num_tokens < s.local_prefill_threshold:
            return RouteDecision(d.ids[i], None, d_over, num_blocks, "short_prompt")
        always = s.disaggregation == "always"
        candidates = live if always else self.apart[i] & live
        any_apart = bool(np.count_nonzero(candidates))
        mask = candidates if prefill_open is None else candidates & _u8(prefill_open)
        j = None
        if any_apart and np.count_nonzero(mask):
            if s.prefill_routing == "round-robin":
                tied = np.flatnonzero(mask)
                j = int(tied[next(self._rotation["prefill"]) % len(tied)])
            else:
                j = choose_prefill(p, mask, counts, num_blocks, s.overlap_weight,
                                   self.weights, next(self._rotation["prefill"]))
        return self._prefill_path(i, num_tokens, num_blocks, counts, j, any_apart)

    def _prefill_path(self, i: int, num_tokens: int, num_blocks: int, counts, j: int | None,
                      any_apart: bool) -> RouteDecision:
        """``choose_prefill_path``'s reason once the prefill worker ``j`` (None: none open,
        or none apart from decode worker ``i`` when not ``any_apart``) is known; ``j``
        counted as routed when the prompt goes to it.

        Raises:
            NoWorkersError: ``disaggregation="always"`` and ``j`` is None.
        """
        s, d, p = self.settings, self.decode, self.prefill
        d_over = d.overlap(i, counts)
        always = s.disaggregation == "always"
        if always and j is None:
            raise NoWorkersError("every prefill worker is at capacity")
        if always:
            reason = "remote"
        elif any_apart and j is None:
            reason = "prefill_busy"
        elif num_tokens - min(d_over * s.block_size, num_tokens) < s.local_prefill_threshold:
            reason = "cached_on_decode"
        elif j is None:
            reason = "shared_compute"
        elif p.waiting[j] + p.routed[j] >= s.max_prefill_queue_size:
            reason = "prefill_busy"
        else:
            reason = "remote"
        if reason != "remote":
            return RouteDecision(d.ids[i], None, d_over, num_blocks, reason)
        p.routed[j] += 1
        return RouteDecision(d.ids[i], p.ids[j], p.overlap(j, counts), num_blocks, "remote")

    def route_decode(self, num_tokens: int, counts, exclude=(), admit: bool = False,
                     max_inflight: float = float("inf"),
                     max_kv_usage: float | None = None) -> int:
        """``decide_decode`` over the live workers not in ``exclude`` (ids; the healthy
        ones when any are: ``RoleArrays.live``), with ``admit`` only those below
        ``max_inflight`` sequences and ``max_kv_usage`` (``RoleArrays.below_caps``): the
        request path's step in one native call, no per-decision masks.

        Returns:
            The chosen position in ``self.decode`` (counted as routed), or ``NO_LIVE`` (no
            live worker) or ``ALL_FULL`` (``admit`` and every live worker at a cap).
        """
        s, d = self.settings, self.decode
        view = d.native()
        if view is None or not (counts is None or isinstance(counts, np.ndarray)):
            live = d.live(exclude)
            mask = live & d.below_caps(max_inflight, max_kv_usage) if admit else live
            if not np.count_nonzero(mask):
                return ALL_FULL if admit and np.count_nonzero(live) else NO_LIVE
            return self.decide_decode(num_tokens, counts, mask)
        if counts is None:
            counts = _NO_COUNTS
        elif counts is not self._checked:
            self._check_slots(counts)
        i = view.decode(counts, d.exclude_mask(exclude), admit, max_inflight, max_kv_usage,
                        s.block_size, num_tokens,
                        max(s.local_prefill_threshold, num_tokens // 2, 1),
                        self._rotation["decode"])
        if i >= 0:
            d.routed[i] += 1
        return i

    def route_prefill(self, i: int, num_tokens: int, num_blocks: int, counts, exclude=(),
                      admit: bool = False,
                      max_inflight: float = float("inf")) -> RouteDecision:
        """``decide_prefill`` over the live prefill workers not in ``exclude`` (as
        ``route_decode``), with ``admit`` only those below ``max_inflight``: one native
        call.

        Raises:
            NoWorkersError: ``disaggregation="always"`` and no prefill worker is open.
        """
        s, p = self.settings, self.prefill
        view = p.native()
        if view is None or not (counts is None or isinstance(counts, np.ndarray)):
            live = p.live(exclude)
            open_workers = live & p.below_caps(max_inflight) if admit else live
            return self.decide_prefill(i, num_tokens, num_blocks, counts, open_workers, live)
        always = s.disaggregation == "always"
        w = self.weights
        j = view.prefill(_NO_COUNTS if counts is None else counts, p.exclude_mask(exclude),
                         admit, max_inflight, _NO_MASK if always else self.apart[i],
                         num_tokens >= s.local_prefill_threshold,
                         s.prefill_routing == "round-robin", num_blocks, s.overlap_weight,
                         w.waiting_blocks, w.running_blocks, w.kv_usage_blocks,
                         self._rotation["prefill"])
        if j in (NO_LIVE, _SHORT):
            d = self.decode
            return RouteDecision(d.ids[i], None, d.overlap(i, counts), num_blocks,
                                 "no_prefill_worker" if j == NO_LIVE else "short_prompt")
        return self._prefill_path(i, num_tokens, num_blocks, counts, j if j >= 0 else None,
                                  j != _NONE_APART)
