"""The SLO planner of ``pdserve serve --autoscale``: sizes the prefill and decode pools
from the cluster's own metrics, as Dynamo's SLA planner does, through ``PoolScaler``.

Every ``interval_s`` it reads, over the interval just ended:

- from the router's histograms (``vllm:time_to_first_token_seconds`` and
  ``vllm:request_time_per_output_token_seconds``): the p90 TTFT and p90 TPOT of the
  requests observed in the interval (estimated from the bucket deltas, as Prometheus's
  ``histogram_quantile``), and how many there were;
- from the workers' last Health: prefills waiting per prefill worker, running sequences
  and KV cache usage of the decode workers.

Policy, per pool, within ``[min, max]``:

- **Up by one** when the pool breaks its target for ``up_after`` intervals in a row:
  prefill when p90 TTFT > ``ttft_target_s`` or more than ``max_waiting_per_prefill``
  prefills wait per prefill worker (with a prefill pool of 0, when TTFT breaks); decode
  when p90 TPOT > ``tpot_target_s`` or mean KV usage > ``max_kv_usage``.
- **Down by one** when the pool is idle for ``down_after`` intervals in a row: prefill
  when no prefill waits and p90 TTFT (if any request came) is under ``down_ratio`` x its
  target; decode when p90 TPOT is under ``down_ratio`` x its target and mean KV usage is
  under ``max_kv_usage / 2`` (or no request came at all).
- After any change, ``cooldown_s`` seconds without another, and the streaks restart:
  that and the gap between the up and down thresholds are the hysteresis.
- **Only what helps** (``admit_scale_up``): a scale-up is refused, with one INFO line
  naming the model, the pool and the reason (``REFUSAL_REASONS``, kept in
  ``last_refusals`` for the decisions metric), when
  - ``no_prefill_would_help``: the router's own prefill-path rule
    (``routing_policy.choose_prefill_path``, ``shares_compute``) would send the new
    prefill worker no prompt, given where the launcher would place it
    (``PoolScaler.placement``): it would share every decode worker's CPUs (or GPU), so
    each prompt is prefilled on its decode worker (``shared_compute``), or every prompt
    is short enough to stay there. The decode pool still grows if it breaks its own
    target, else nothing does;
  - ``no_free_cores``: on CPU, the new worker's OpenMP team and those of the computing
    workers whose CPUs it would share (decode workers, and the prefill workers the router
    sends prompts to) would have more threads than those CPUs are: two teams on one core.
    Running workers keep their thread count (no re-split), so a pool grows only onto
    cores that no computing worker uses.

Each decision is logged and counted in ``pdserve:planner_decisions_total{role,action}``;
``pdserve:planner_desired_workers{role}`` is the size the planner wants.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from prometheus_client import Counter, Gauge

from pdserve.router.routing_policy import (
    PrefillChoice,
    WorkerLoad,
    choose_prefill_path,
    shares_compute,
)

logger = logging.getLogger(__name__)
REFUSAL_REASONS = ("no_prefill_would_help", "no_free_cores")
"""Why the planner refuses a scale-up its signals ask for (``SLOPlanner.last_refusals``)."""


@dataclass(slots=True)
class PlannerConfig:
    """Targets in seconds; sizes in workers; ``interval_s`` seconds between decisions."""

    ttft_target_s: float = 2.0
    tpot_target_s: float = 0.2
    min_workers: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 1})
    max_workers: dict[str, int] = field(default_factory=lambda: {"prefill": 4, "decode": 4})
    interval_s: float = 10.0
    up_after: int = 2
    down_after: int = 6
    down_ratio: float = 0.5
    cooldown_s: float = 30.0
    max_waiting_per_prefill: float = 4.0
    max_kv_usage: float = 0.9

    def __post_init__(self) -> None:
        for role in ("prefill", "decode"):
            low, high = self.min_workers[role], self.max_workers[role]
            floor = 1 if role == "decode" else 0
            if not floor <= low <= high:
                raise ValueError(f"--min-{role}-workers={low} and --max-{role}-workers={high} "
                                 f"must satisfy {floor} <= min <= max")
        if self.ttft_target_s <= 0 or self.tpot_target_s <= 0:
            raise ValueError("--ttft-target-s and --tpot-target-s must be > 0")
        if self.interval_s <= 0:
            raise ValueError(f"--planner-interval-s={self.interval_s} must be > 0")


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The ``q`` quantile of a histogram given as cumulative ``(upper bound, count)``
    pairs ending at +Inf, interpolated linearly inside its bucket (Prometheus's
    ``histogram_quantile``); None when it holds no observation."""
    total = buckets[-1][1] if buckets else 0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower  # NOTE: beyond the last finite bound, as Prometheus answers
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower


@dataclass(slots=True)
class Signals:
    """One interval's view: p90s in seconds (None: no request finished one), queue and
    KV figures from the workers' last Health."""

    ttft_p90_s: float | None
    tpot_p90_s: float | None
    num_requests: int
    prefill_waiting_per_worker: float
    decode_kv_usage: float
    decode_running: int


class SLOPlanner:
    """Runs the policy above on ``router`` (its metrics and worker pool) and ``scaler``.

    ``run()`` loops until cancelled; ``step(now)`` takes one decision (for tests and the
    loop).
    """

    def __init__(self, config: PlannerConfig, router, scaler) -> None:
        self.config = config
        self.router = router
        self.scaler = scaler
        self._last: dict[str, list[tuple[float, float]]] = {}
        self._streak = {(role, way): 0 for role in ("prefill", "decode")
                        for way in ("up", "down")}
        self._last_change = -math.inf
        registry, model = router.metrics.registry, router.metrics.model_name
        self._decisions = Counter(
            "pdserve:planner_decisions", "The SLO planner's resizes, by pool and way.",
            labelnames=["model_name", "role", "action"], registry=registry)
        self._desired = Gauge(
            "pdserve:planner_desired_workers", "The pool sizes the SLO planner wants.",
            labelnames=["model_name", "role"], registry=registry)
        for role in ("prefill", "decode"):
            for action in ("scale_up", "scale_down"):
                self._decisions.labels(model, role, action)
            self._desired.labels(model, role).set(scaler.sizes()[role])
        self._model = model
        self.last_refusals: dict[str, str] = {}
        """Pool -> the ``REFUSAL_REASONS`` entry of the scale-up the last step refused."""
        self._said: dict[str, str] = {}  # pool -> the last refusal line's why

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                await self.step(time.monotonic())
            except Exception:
                logger.exception("the SLO planner's step failed")

    def signals(self) -> Signals:
        """Read this interval's figures (and remember the histograms for the next)."""
        ttft, n = self._window("vllm:time_to_first_token_seconds")
        tpot, _ = self._window("vllm:request_time_per_output_token_seconds")
        pool = self.router.pool
        prefill = [w.current_load() for w in pool.live("prefill")]
        decode = [w.current_load() for w in pool.live("decode")]
        return Signals(
            ttft_p90_s=histogram_quantile(0.9, ttft), tpot_p90_s=histogram_quantile(0.9, tpot),
            num_requests=n,
            prefill_waiting_per_worker=(sum(w.num_waiting for w in prefill) / len(prefill)
                                        if prefill else 0.0),
            decode_kv_usage=(sum(w.kv_cache_usage for w in decode) / len(decode)
                             if decode else 0.0),
            decode_running=sum(w.num_running for w in decode))

    def _window(self, name: str) -> tuple[list[tuple[float, float]], int]:
        """The cumulative buckets of histogram ``name`` observed since the last call, and
        their count."""
        now = []
        for family in self.router.metrics.registry.collect():
            if family.name != name:
                continue
            for sample in family.samples:
                if sample.name == f"{name}_bucket" and \
                        sample.labels.get("model_name") == self._model:
                    now.append((float(sample.labels["le"]), sample.value))
        now.sort()
        before = dict(self._last.get(name, []))
        self._last[name] = now
        delta = [(bound, count - before.get(bound, 0.0)) for bound, count in now]
        return delta, int(delta[-1][1]) if delta else 0

    async def step(self, now: float) -> dict[str, int]:
        """Read the signals, update the streaks, resize at most one way per pool; returns
        the sizes after."""
        c = self.config
        s = self.signals()
        sizes = self.scaler.sizes()
        breaks = {
            "prefill": (s.ttft_p90_s is not None and s.ttft_p90_s > c.ttft_target_s)
            or s.prefill_waiting_per_worker > c.max_waiting_per_prefill,
            "decode": (s.tpot_p90_s is not None and s.tpot_p90_s > c.tpot_target_s)
            or s.decode_kv_usage > c.max_kv_usage}
        idle = {
            "prefill": s.prefill_waiting_per_worker == 0
            and (s.ttft_p90_s is None or s.ttft_p90_s < c.down_ratio * c.ttft_target_s),
            "decode": (s.tpot_p90_s is None or s.tpot_p90_s < c.down_ratio * c.tpot_target_s)
            and s.decode_kv_usage < c.max_kv_usage / 2}
        for role in ("prefill", "decode"):
            self._streak[role, "up"] = self._streak[role, "up"] + 1 if breaks[role] else 0
            self._streak[role, "down"] = self._streak[role, "down"] + 1 \
                if idle[role] and not breaks[role] else 0
        if now - self._last_change < c.cooldown_s:
            return sizes
        wanted = {}
        for role in ("prefill", "decode"):
            if self._streak[role, "up"] >= c.up_after and sizes[role] < c.max_workers[role]:
                wanted[role] = sizes[role] + 1
            elif self._streak[role, "down"] >= c.down_after and \
                    sizes[role] > c.min_workers[role]:
                wanted[role] = sizes[role] - 1
        wanted = self.admit_scale_up(wanted, sizes)
        if not wanted:
            return sizes
        for role, size in wanted.items():
            action = "scale_up" if size > sizes[role] else "scale_down"
            logger.info("SLO planner: %s %s pool %d -> %d (p90 TTFT %s s, p90 TPOT %s s, "
                        "%d requests, %.1f prefills waiting per worker, decode KV usage "
                        "%.2f)", action, role, sizes[role], size, _fmt(s.ttft_p90_s),
                        _fmt(s.tpot_p90_s), s.num_requests, s.prefill_waiting_per_worker,
                        s.decode_kv_usage)
            self._decisions.labels(self._model, role, action).inc()
            self._desired.labels(self._model, role).set(size)
            self._streak[role, "up"] = self._streak[role, "down"] = 0
        self._last_change = now
        try:
            return await self.scaler.scale(wanted)
        finally:
            self._last_change = max(now, time.monotonic())  # NOTE: cool down from the end

    def admit_scale_up(self, wanted: dict[str, int], sizes: dict[str, int]) -> dict[str, int]:
        """``wanted`` (pool -> new size) less the scale-ups that would not help (module
        docstring, Only what helps); each refusal's reason goes to ``last_refusals`` and,
        when it is new for that pool, to one INFO line."""
        refusals: dict[str, str] = {}
        decode_computes = [w.record.compute for w in self.router.pool.live("decode")]
        admitted: list = []  # the placements of the new workers admitted so far
        for role in [r for r in ("decode", "prefill") if wanted.get(r, 0) > sizes[r]]:
            new = self.scaler.placement(role)
            if role == "prefill":
                path = new_prefill_path(self.router.config, decode_computes,
                                        "" if new is None else new.compute)
                if path != "remote":
                    refusals[role] = "no_prefill_would_help"
                    self._say_refused(role, "no_prefill_would_help",
                                      f"the router would send it no prompt ({path}: every "
                                      "prompt would be prefilled on its decode worker)")
                    continue
            busy = computing_placements(self.scaler.placements(), self.router.config,
                                        decode_computes) + admitted
            if new is not None and oversubscribed(new, busy):
                refusals[role] = "no_free_cores"
                self._say_refused(role, "no_free_cores",
                                  f"its {new.num_threads} thread(s) would share cores "
                                  f"{_cpus(new)} with other workers' threads")
                continue
            if new is not None:
                admitted.append(new)
        for role in refusals:
            wanted.pop(role)
        self.last_refusals = refusals
        return wanted

    def _say_refused(self, role: str, reason: str, why: str) -> None:
        """One INFO line for a refused scale-up, unless the last step refused it the same
        way (a refusal repeats every interval while the target stays broken)."""
        if role in self.last_refusals and self._said.get(role) == why:
            return
        self._said[role] = why
        logger.info("SLO planner: model %s: not scaling up the %s pool (%s): %s",
                    self._model, role, reason, why)


def new_prefill_path(config, decode_computes: Sequence[str], compute: str) -> str:
    """Where the router (``config``: its ``RouterConfig``) would prefill a long prompt if
    a prefill worker computing on ``compute`` (a ``compute_placement`` string; "" when
    unknown) joined: ``"remote"`` when, for some live decode worker
    (``decode_computes``), its rule (``choose_prefill_path``) sends it to that worker;
    else the rule's reason (``shared_compute``, ``short_prompt``). The prompt is the
    longest the router takes (``max_model_len``), with nothing cached and the new worker
    idle, so any other prompt goes remote no more often. With no live decode worker,
    ``"remote"`` (nothing to compare with)."""
    longest = config.max_model_len or (1 << 30) - 1
    threshold = config.local_prefill_threshold
    if config.disaggregation == "always" or not decode_computes:
        return "short_prompt" if longest < threshold else "remote"
    reasons = []
    for decode in decode_computes:
        choice = None if shares_compute(decode, compute) else \
            PrefillChoice("new", 0, longest // max(config.block_size, 1), 0.0)
        path = choose_prefill_path(longest, 0, threshold, decode, {"new": compute}, choice,
                                   WorkerLoad("new"), config.max_prefill_queue_size)
        if path.reason == "remote":
            return "remote"
        reasons.append(path.reason)
    return reasons[0]


def computing_placements(placements: dict[str, list], config,
                         decode_computes: Sequence[str]) -> list:
    """The ``Placement`` of every worker whose threads compute (``placements``: the
    scaler's, by pool): every decode worker, and each prefill worker the router sends
    prompts to (``new_prefill_path``); unknown ones (None) left out."""
    busy = [p for p in placements.get("decode", []) if p is not None]
    busy += [p for p in placements.get("prefill", []) if p is not None and
             new_prefill_path(config, decode_computes, p.compute) == "remote"]
    return busy


def oversubscribed(new, others: Sequence) -> bool:
    """True when a worker placed at ``new`` (a ``Placement``) and the workers at
    ``others`` whose CPUs it shares (same host, overlapping CPU sets) would run more
    OpenMP threads than those CPUs number: two teams on one core. False when ``new``'s
    CPUs are unknown."""
    if not new.host or not new.cpus:
        return False
    sharing = [p for p in others if p.host == new.host and p.cpus & new.cpus]
    cpus = set(new.cpus).union(*(p.cpus for p in sharing))
    return new.num_threads + sum(p.num_threads for p in sharing) > len(cpus)


def _cpus(placement) -> str:
    return ",".join(str(c) for c in sorted(placement.cpus))


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
