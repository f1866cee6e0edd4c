"""The routing policy (docs/architecture.md, A request's path, step 1) as pure functions.

Prefill worker: the lowest ``cost = overlap_weight * uncached_blocks + load_blocks``, where
``uncached_blocks`` is the prompt's blocks the worker lacks (its prefix-index overlap
removed) and ``load_blocks`` its load in blocks-equivalent (``LoadWeights``). Decode
worker: the lowest KV cache usage, then the fewest running, then waiting sequences.
Ties go round-robin: the caller passes a counter as ``rotation`` and the tied workers,
sorted by id, take turns, so equal workers share the traffic and a given input always gives
the same choice.

Worked example (``overlap_weight=1``, default weights, 10-block prompt)::

    worker  overlap  running  waiting  kv usage  uncached  load             cost
    A       8        4        2        0.50      2         4+2+8*0.5 = 10   12
    B       0        0        0        0.00      10        0                10   <- chosen
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A worker's load as its last report gives it: sequences running and waiting, and
    the fraction of its KV cache blocks in use (in [0, 1])."""

    worker_id: str
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0


@dataclass(frozen=True, slots=True)
class LoadWeights:
    """How a worker's load converts into blocks-equivalent (the unit of ``cost``).

    ``load_blocks = waiting_blocks * num_waiting + running_blocks * num_running
    + kv_usage_blocks * kv_cache_usage``: every queued or running sequence delays a new
    prompt by about one block of prefill work (a prefix hit makes most prompts' remaining
    work small), and a fuller KV cache adds up to ``kv_usage_blocks`` more (a worker near
    full evicts the cached prefixes it would reuse, or preempts).
    """

    waiting_blocks: float = 1.0
    running_blocks: float = 1.0
    kv_usage_blocks: float = 8.0

    def load_blocks(self, load: WorkerLoad) -> float:
        """``load`` in blocks-equivalent."""
        return (self.waiting_blocks * load.num_waiting + self.running_blocks * load.num_running
                + self.kv_usage_blocks * load.kv_cache_usage)


@dataclass(frozen=True, slots=True)
class PrefillChoice:
    """The chosen prefill worker, the blocks it already caches, and the cost it won with."""

    worker_id: str
    overlap_blocks: int
    uncached_blocks: int
    cost: float


class NoWorkersError(RuntimeError):
    """No live worker of the needed role (the router answers 503)."""


_TIE_TOLERANCE = 1e-9


def choose_prefill_worker(num_prompt_blocks: int, overlaps: Mapping[str, int],
                          loads: Sequence[WorkerLoad], overlap_weight: float = 1.0, *,
                          weights: LoadWeights = LoadWeights(), rotation: int = 0
                          ) -> PrefillChoice:
    """The prefill worker with the lowest ``overlap_weight * uncached_blocks + load``.

    Args:
        num_prompt_blocks: the prompt's hashed (full) blocks.
        overlaps: worker id -> leading blocks it caches (``PrefixIndex.longest_prefix``);
            missing workers have 0; workers not in ``loads`` are ignored.
        loads: the live prefill workers.
        overlap_weight: blocks-equivalent of prefilling one block (0 routes by load alone).
        weights: the load model (see ``LoadWeights``).
        rotation: a counter the caller advances per request, to take turns among ties.

    Raises:
        NoWorkersError: ``loads`` is empty.
    """
    if not loads:
        raise NoWorkersError("no live prefill worker")
    choices = []
    for load in loads:
        overlap = min(max(overlaps.get(load.worker_id, 0), 0), num_prompt_blocks)
        uncached = num_prompt_blocks - overlap
        cost = overlap_weight * uncached + weights.load_blocks(load)
        choices.append(PrefillChoice(load.worker_id, overlap, uncached, cost))
    best = min(c.cost for c in choices)
    tied = sorted((c for c in choices if c.cost - best <= _TIE_TOLERANCE),
                  key=lambda c: c.worker_id)
    return tied[rotation % len(tied)]


def choose_decode_worker(loads: Sequence[WorkerLoad], *, rotation: int = 0,
                         cached_tokens: Mapping[str, int] | None = None,
                         min_cached_tokens: int = 0) -> str:
    """The decode worker for a request: among those whose prefix cache holds at least
    ``min_cached_tokens`` (> 0) leading tokens of its prompt (``cached_tokens``, worker id
    -> tokens) and that are not much busier than the least busy (at most
    ``max(2, least // 4)`` more running and waiting sequences), the one holding the most,
    as KV-aware routing does (llm-d, Dynamo): a chat's next turn goes where its history's
    KV is, to be prefilled there from the cache or to pull only the blocks it lacks, while
    a prefix many requests share (a system prompt) does not pin them all to one worker.
    Otherwise (or among equals) the one with the lowest KV cache usage, then the fewest
    running, then waiting sequences; ties take turns by ``rotation`` over the tied ids in
    sorted order.

    Raises:
        NoWorkersError: ``loads`` is empty.
    """
    if not loads:
        raise NoWorkersError("no live decode worker")
    if cached_tokens and min_cached_tokens > 0:
        least = min(load.num_running + load.num_waiting for load in loads)
        holders = [load for load in loads
                   if cached_tokens.get(load.worker_id, 0) >= min_cached_tokens
                   and load.num_running + load.num_waiting <= least + max(2, least // 4)]
        if holders:
            most = max(cached_tokens.get(load.worker_id, 0) for load in holders)
            loads = [load for load in holders if cached_tokens.get(load.worker_id, 0) == most]

    def key(load: WorkerLoad) -> tuple[float, int, int]:
        return (load.kv_cache_usage, load.num_running, load.num_waiting)

    best = min(key(load) for load in loads)
    tied = sorted(load.worker_id for load in loads if key(load) == best)
    return tied[rotation % len(tied)]


def should_prefill_locally(prompt_len: int, local_prefill_threshold: int) -> bool:
    """True when a prompt of ``prompt_len`` tokens is shorter than
    ``--local-prefill-threshold`` and so skips the prefill pool (prefilled on the decode
    worker). A threshold of 0 never prefills locally."""
    return prompt_len < local_prefill_threshold


# Conditional disaggregation: where a request's prompt is prefilled.

PREFILL_PATH_REASONS = ("remote", "short_prompt", "cached_on_decode", "shared_compute",
                        "prefill_busy", "no_prefill_worker")


@dataclass(frozen=True, slots=True)
class PrefillPath:
    """Where one request's prompt is prefilled: on ``prefill_worker_id`` (the prefill
    pool), or on its decode worker when that is None. ``reason`` is one of
    ``PREFILL_PATH_REASONS`` (the label of ``pdserve:prefill_path``)."""

    prefill_worker_id: str | None
    reason: str


@functools.lru_cache(maxsize=1 << 16)
def shares_compute(a: str, b: str) -> bool:
    """True when two workers' ``compute`` placements (``compute_placement``) name the
    same hardware: the same GPU, or CPU sets that overlap on one host. Unknown ("")
    placements share nothing. Cached: a router asks it of the same pairs per request."""
    if not a or not b:
        return False
    kind_a, _, rest_a = a.partition("@")
    kind_b, _, rest_b = b.partition("@")
    host_a, _, units_a = rest_a.rpartition(":")
    host_b, _, units_b = rest_b.rpartition(":")
    if kind_a != kind_b:
        return False
    if kind_a == "cuda" and units_a.startswith("GPU-"):  # a UUID names one GPU anywhere
        return units_a == units_b
    if host_a != host_b:
        return False
    if kind_a == "cpu":
        return bool(_cpu_set(units_a) & _cpu_set(units_b))
    return units_a == units_b


def _cpu_set(text: str) -> set[int]:
    """``"0-3,8"`` -> {0, 1, 2, 3, 8}."""
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def choose_prefill_path(num_prompt_tokens: int, decode_cached_tokens: int,
                        local_prefill_threshold: int, decode_compute: str,
                        prefill_computes: Mapping[str, str], choice: PrefillChoice | None,
                        prefill_load: WorkerLoad | None, max_prefill_queue_size: int
                        ) -> PrefillPath:
    """Conditional disaggregation: prefill in the pool only where it pays (the rule of
    Dynamo's conditional disaggregation and llm-d's split/local choice), else on the
    decode worker, which then needs no KV transfer.

    In order: no live prefill worker -> local (``no_prefill_worker``); fewer than
    ``local_prefill_threshold`` tokens left to compute on the decode worker, after what
    it caches (``decode_cached_tokens``) -> local (``short_prompt``, or
    ``cached_on_decode`` when its cache made it short); every prefill worker computes on
    the decode worker's own hardware (``shares_compute``: a remote prefill would take the
    same cores or GPU from its decodes and add a transfer) -> local (``shared_compute``);
    the chosen prefill worker has ``max_prefill_queue_size`` or more prefills waiting
    (``prefill_load``) -> local (``prefill_busy``); else the pool (``remote``).

    Args:
        num_prompt_tokens: the prompt's length, tokens.
        decode_cached_tokens: leading prompt tokens the decode worker caches.
        local_prefill_threshold: tokens; 0 never prefills locally for shortness.
        decode_compute: the decode worker's placement.
        prefill_computes: live prefill worker id -> its placement.
        choice: the best prefill worker among those not sharing compute (None if none).
        prefill_load: that worker's load.
        max_prefill_queue_size: waiting prefills that make the pool "busy".
    """
    if not prefill_computes:
        return PrefillPath(None, "no_prefill_worker")
    uncached = num_prompt_tokens - decode_cached_tokens
    if uncached < local_prefill_threshold:
        short = num_prompt_tokens < local_prefill_threshold
        return PrefillPath(None, "short_prompt" if short else "cached_on_decode")
    if choice is None or all(shares_compute(decode_compute, c)
                             for c in prefill_computes.values()):
        return PrefillPath(None, "shared_compute")
    if prefill_load is not None and prefill_load.num_waiting >= max_prefill_queue_size:
        return PrefillPath(None, "prefill_busy")
    return PrefillPath(choice.worker_id, "remote")
