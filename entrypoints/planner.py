"""The SLO planner of ``pdserve serve --autoscale``: sizes the prefill and decode pools
from the cluster's own metrics, as Dynamo's SLA planner does, through ``PoolScaler``.

Every ``interval_s`` it reads, over the interval just ended:

- from the router's histograms (``vllm:time_to_first_token_seconds``,
  ``vllm:request_time_per_output_token_seconds`` and ``vllm:inter_token_latency_seconds``):
  the p90 TTFT, p90 TPOT and p90 ITL of the requests (tokens, for ITL) observed in the
  interval (estimated from the bucket deltas, as Prometheus's ``histogram_quantile``),
  and how many requests there were;
- from the workers' last Health: prefills waiting per prefill worker, running sequences
  and KV cache usage of the decode workers.

Policy, per pool, within ``[min, max]``:

- **Up by one** when the pool breaks its target for ``up_after`` intervals in a row:
  prefill when p90 TTFT > ``ttft_target_s`` or more than ``max_waiting_per_prefill``
  prefills wait per prefill worker (with a prefill pool of 0, when TTFT breaks); decode
  when p90 TPOT > ``tpot_target_s``, p90 ITL > ``itl_target_s`` (when set) or mean KV
  usage > ``max_kv_usage``.
- **Down by one** when the pool is idle for ``down_after`` intervals in a row: prefill
  when no prefill waits and p90 TTFT (if any request came) is under ``down_ratio`` x its
  target; decode when p90 TPOT (and p90 ITL, when its target is set) is under
  ``down_ratio`` x its target and mean KV usage is under ``max_kv_usage / 2`` (or no
  request came at all).
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
  - ``no_free_cores``: on one CPU node, where the pools re-split (``PoolScaler.plan``:
    each computing worker, decode and with ``--disaggregation always`` prefill, gets
    CPUs of its own), when no core of the node is free: every one already runs a
    computing worker's threads (``PoolScaler.why_no_free_core``), so the new worker
    could only get cores by taking them from the running ones, a re-split that adds no
    compute (two one-core workers make what one two-core worker made). Where cores are
    free (workers started with fewer threads than the node has cores, ``--num-threads``),
    the pool grows onto them and the running workers keep their threads. Where the pools
    do not re-split (workers placed by another launcher, as ``taskset`` would), when the
    new worker's OpenMP team and those of the computing workers whose CPUs it would share
    (decode workers, and the prefill workers the router sends prompts to) would have
    more threads than those CPUs are: two teams on one core. An operator's explicit
    resize (``pdserve scale``) still re-splits, and a scale-down widens the workers left.

What it says (logger ``pdserve.entrypoints.planner``, each line naming the model):

- at start-up, one INFO line: the targets, each pool's bounds, the interval and cooldown;
- each resize, one INFO line: the pool, its sizes, the condition that fired (``ttft_p90``,
  ``prefill_queue``, ``tpot_p90``, ``itl_p90``, ``kv_usage``; ``idle`` for a scale-down),
  its measured value and its target;
- each refused scale-up, one INFO line: the pool, the reason, the condition that asked
  for it with its measured value and target, and why;
- while a target stays broken with its pool at ``max``, or its scale-up refused for
  ``no_free_cores`` (after that refusal's line), one WARNING line, at most once per
  ``AT_BOUND_REPEAT_S`` seconds (the condition, value, target and bound).

Each record also carries these fields as ``record.planner`` (a dict), for structured
logging. Each resize is counted in
``pdserve:planner_decisions_total{model_name,pool,direction,reason}`` (``direction``: up
or down, ``reason`` the condition; or ``none`` with a refusal's reason, once per refusal
line); ``pdserve:planner_desired_workers{model_name,pool}``
is the size the planner wants.
"""

from __future__ import annotations

import argparse
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
AT_BOUND_REPEAT_S = 60.0  # seconds between two "target broken at the pool's max" lines
# the conditions a resize names, per pool and direction; the reason label is open: these
# are pre-initialised at 0 so that a dashboard sees them before they first fire
REFUSAL_REASONS = ("no_prefill_would_help", "no_free_cores")
"""Why the planner refuses a scale-up its signals ask for (``SLOPlanner.last_refusals``);
counted with direction ``none``."""
REASONS = {("prefill", "up"): ("ttft_p90", "prefill_queue"),
           ("decode", "up"): ("tpot_p90", "itl_p90", "kv_usage"),
           ("prefill", "down"): ("idle",), ("decode", "down"): ("idle",),
           ("prefill", "none"): REFUSAL_REASONS, ("decode", "none"): ("no_free_cores",)}


@dataclass(slots=True)
class PlannerConfig:
    """Targets in seconds (``itl_target_s`` None: no ITL target); sizes in workers;
    ``interval_s`` seconds between decisions. ``pdserve serve``'s planner flags take their
    defaults from these fields.

    Raises:
        ValueError: bounds, targets or an interval that cannot work (the message names
            the flag).
    """

    ttft_target_s: float = 2.0
    tpot_target_s: float = 0.2
    itl_target_s: float | None = None  # p90 inter-token latency, as Dynamo's planner's
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
        if self.itl_target_s is not None and self.itl_target_s <= 0:
            raise ValueError(f"--itl-target-s={self.itl_target_s} must be > 0")
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
    itl_p90_s: float | None = None


@dataclass(frozen=True, slots=True)
class Condition:
    """One planner condition as measured: ``name`` (``ttft_p90``, ``prefill_queue``,
    ``tpot_p90``, ``itl_p90``, ``kv_usage``, ``idle``), the measured ``value`` (seconds,
    prefills waiting per worker or a KV usage fraction; None when no request came) and
    the ``target`` it is compared with."""

    name: str
    value: float | None
    target: float

    def __str__(self) -> str:
        unit = " s" if self.name.endswith("_p90") or self.name == "idle" else ""
        value = "no request" if self.value is None else f"{self.value:.3f}{unit}"
        return f"{self.name} {value} (target {self.target:g}{unit})"


def breaches(s: Signals, c: PlannerConfig) -> dict[str, list[Condition]]:
    """The conditions each pool breaks in ``s`` (empty: none), in the order above."""
    def over(name: str, value: float | None, target: float | None) -> list[Condition]:
        broken = value is not None and target is not None and value > target
        return [Condition(name, value, target)] if broken else []

    return {
        "prefill": over("ttft_p90", s.ttft_p90_s, c.ttft_target_s)
        + over("prefill_queue", s.prefill_waiting_per_worker, c.max_waiting_per_prefill),
        "decode": over("tpot_p90", s.tpot_p90_s, c.tpot_target_s)
        + over("itl_p90", s.itl_p90_s, c.itl_target_s)
        + over("kv_usage", s.decode_kv_usage, c.max_kv_usage)}


def idle_condition(s: Signals, c: PlannerConfig, pool: str) -> Condition:
    """What a scale-down of ``pool`` names: its latency signal against ``down_ratio`` x
    its target."""
    if pool == "prefill":
        return Condition("idle", s.ttft_p90_s, c.down_ratio * c.ttft_target_s)
    return Condition("idle", s.tpot_p90_s, c.down_ratio * c.tpot_target_s)


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
        self._model = router.metrics.model_name
        self._at_bound_said: dict[str, float] = {}  # pool -> when its at-bound line was said
        self.last_refusals: dict[str, str] = {}
        """Pool -> the ``REFUSAL_REASONS`` entry of the scale-up the last step refused."""
        self._said: dict[str, str] = {}  # pool -> the last refusal line's why
        self._add_metrics(router.metrics.registry, scaler.sizes())
        self._announce()

    def _add_metrics(self, registry, sizes: dict[str, int]) -> None:
        """``pdserve:planner_decisions_total`` (every known reason at 0) and
        ``pdserve:planner_desired_workers`` (the current ``sizes``) of this model."""
        self._decisions = Counter(
            "pdserve:planner_decisions", "The SLO planner's resizes, by pool, direction and "
            "the condition that fired.", labelnames=["model_name", "pool", "direction", "reason"],
            registry=registry)
        self._desired = Gauge(
            "pdserve:planner_desired_workers", "The pool sizes the SLO planner wants.",
            labelnames=["model_name", "pool"], registry=registry)
        for (pool, direction), reasons in REASONS.items():
            for reason in reasons:
                self._decisions.labels(self._model, pool, direction, reason)
        for pool in ("prefill", "decode"):
            self._desired.labels(self._model, pool).set(sizes[pool])

    def _announce(self) -> None:
        """The start-up line: the model, the targets, each pool's bounds, the interval."""
        c = self.config
        itl = "off" if c.itl_target_s is None else f"{c.itl_target_s:g} s"
        bounds = {pool: (c.min_workers[pool], c.max_workers[pool])
                  for pool in ("prefill", "decode")}
        logger.info(
            "SLO planner on for model %s: p90 targets TTFT %g s, TPOT %g s, ITL %s; prefill "
            "pool %d-%d, decode pool %d-%d workers; a decision every %g s, none for %g s "
            "after a resize", self._model, c.ttft_target_s, c.tpot_target_s, itl,
            *bounds["prefill"], *bounds["decode"], c.interval_s, c.cooldown_s,
            extra={"planner": {"event": "start", "model_name": self._model,
                               "ttft_target_s": c.ttft_target_s,
                               "tpot_target_s": c.tpot_target_s,
                               "itl_target_s": c.itl_target_s, "bounds": bounds,
                               "interval_s": c.interval_s, "cooldown_s": c.cooldown_s}})

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
        itl, _ = self._window("vllm:inter_token_latency_seconds")
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
            decode_running=sum(w.num_running for w in decode),
            itl_p90_s=histogram_quantile(0.9, itl))

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
        broken = breaches(s, c)
        breaks = {role: bool(broken[role]) for role in ("prefill", "decode")}
        idle = {
            "prefill": s.prefill_waiting_per_worker == 0
            and (s.ttft_p90_s is None or s.ttft_p90_s < c.down_ratio * c.ttft_target_s),
            "decode": (s.tpot_p90_s is None or s.tpot_p90_s < c.down_ratio * c.tpot_target_s)
            and (c.itl_target_s is None or s.itl_p90_s is None
                 or s.itl_p90_s < c.down_ratio * c.itl_target_s)
            and s.decode_kv_usage < c.max_kv_usage / 2}
        for role in ("prefill", "decode"):
            self._streak[role, "up"] = self._streak[role, "up"] + 1 if breaks[role] else 0
            self._streak[role, "down"] = self._streak[role, "down"] + 1 \
                if idle[role] and not breaks[role] else 0
        self._say_at_bound(now, broken, sizes)
        if now - self._last_change < c.cooldown_s:
            return sizes
        wanted = {}
        for role in ("prefill", "decode"):
            if self._streak[role, "up"] >= c.up_after and sizes[role] < c.max_workers[role]:
                wanted[role] = sizes[role] + 1
            elif self._streak[role, "down"] >= c.down_after and \
                    sizes[role] > c.min_workers[role]:
                wanted[role] = sizes[role] - 1
        wanted = self.admit_scale_up(wanted, sizes,
                                     {role: conds[0] for role, conds in broken.items() if conds})
        for role, reason in self.last_refusals.items():
            if reason == "no_free_cores":  # NOTE: its refusal line said it; the at-bound
                self._at_bound_said.setdefault(role, now)  # line repeats it from now on
        if not wanted:
            return sizes
        for role, size in wanted.items():
            self._record(role, sizes[role], size,
                         broken[role][0] if size > sizes[role] else idle_condition(s, c, role),
                         s)
            self._streak[role, "up"] = self._streak[role, "down"] = 0
        self._last_change = now
        try:
            return await self.scaler.scale(wanted)
        finally:
            self._last_change = max(now, time.monotonic())  # NOTE: cool down from the end

    def admit_scale_up(self, wanted: dict[str, int], sizes: dict[str, int],
                       conditions: dict[str, Condition] | None = None) -> dict[str, int]:
        """``wanted`` (pool -> new size) less the scale-ups that would not help (module
        docstring, Only what helps); each refusal's reason goes to ``last_refusals`` and,
        when it is new for that pool, to one INFO line naming the pool's condition in
        ``conditions`` (pool -> the one that fired), if given."""
        refusals: dict[str, str] = {}
        decode_computes = [w.record.compute for w in self.router.pool.live("decode")]
        admitted: list = []  # the placements of the new workers admitted so far
        resplits = getattr(self.scaler, "resplits", lambda: False)()
        added = 0  # the new workers of re-split pools admitted so far

        def refuse(role: str, reason: str, why: str) -> None:
            refusals[role] = reason
            self._say_refused(role, reason, why, (conditions or {}).get(role))

        for role in [r for r in ("decode", "prefill") if wanted.get(r, 0) > sizes[r]]:
            new = self.scaler.placement(role)
            if role == "prefill":
                path = new_prefill_path(self.router.config, decode_computes,
                                        "" if new is None else new.compute)
                if path != "remote":
                    refuse(role, "no_prefill_would_help",
                           f"the router would send it no prompt ({path}: every prompt would "
                           "be prefilled on its decode worker)")
                    continue
            if resplits and role in self.scaler.split:
                # NOTE: only onto a core no computing worker's threads hold: a re-split
                # would take cores from the running ones and add no compute
                why = self.scaler.why_no_free_core(added + 1)
                if why is not None:
                    refuse(role, "no_free_cores", why)
                    continue
                added += 1
                continue
            busy = computing_placements(self.scaler.placements(), self.router.config,
                                        decode_computes) + admitted
            if new is not None and oversubscribed(new, busy):
                refuse(role, "no_free_cores", f"its {new.num_threads} thread(s) would share "
                       f"cores {_cpus(new)} with other workers' threads")
                continue
            if new is not None:
                admitted.append(new)
        for role in refusals:
            wanted.pop(role)
        self.last_refusals = refusals
        return wanted

    def _say_refused(self, role: str, reason: str, why: str,
                     condition: Condition | None = None) -> None:
        """One INFO line for a refused scale-up (``condition``: the one that asked for it),
        unless the last step refused it the same way (a refusal repeats every interval
        while the target stays broken); counted in ``planner_decisions_total``."""
        if role in self.last_refusals and self._said.get(role) == why:
            return
        self._said[role] = why
        fired = {} if condition is None else {"condition": condition.name,
                                              "value": condition.value,
                                              "target": condition.target}
        logger.info("SLO planner: model %s: not scaling up the %s pool (%s): %s%s",
                    self._model, role, reason,
                    "" if condition is None else f"{condition} is broken, but ", why,
                    extra={"planner": {"event": "refused", "model_name": self._model,
                                       "pool": role, "reason": reason, **fired}})
        self._decisions.labels(self._model, role, "none", reason).inc()

    def _record(self, pool: str, before: int, after: int, why: Condition,
                s: Signals) -> None:
        """One resize of ``pool`` from ``before`` to ``after`` workers because of ``why``:
        its line, its count and the desired size."""
        direction = "up" if after > before else "down"
        logger.info(
            "SLO planner: scale_%s %s pool %d -> %d of model %s: %s; p90 TTFT %s s, p90 "
            "TPOT %s s, p90 ITL %s s, %d requests, %.1f prefills waiting per worker, decode "
            "KV usage %.2f", direction, pool, before, after, self._model, why,
            _fmt(s.ttft_p90_s), _fmt(s.tpot_p90_s), _fmt(s.itl_p90_s), s.num_requests,
            s.prefill_waiting_per_worker, s.decode_kv_usage,
            extra={"planner": {"event": "resize", "model_name": self._model, "pool": pool,
                               "direction": direction, "from": before, "to": after,
                               "condition": why.name, "value": why.value,
                               "target": why.target}})
        self._decisions.labels(self._model, pool, direction, why.name).inc()
        self._desired.labels(self._model, pool).set(after)

    def _say_at_bound(self, now: float, broken: dict[str, list[Condition]],
                      sizes: dict[str, int]) -> None:
        """A WARNING, at most once per ``AT_BOUND_REPEAT_S`` seconds per pool, while a pool
        breaks a target for ``up_after`` intervals with ``max`` workers already, or with
        its last scale-up refused for ``no_free_cores`` (the node's cores bound it: that
        refusal's line was the first); a pool that meets its targets again is said again
        at its next such breach."""
        for pool in ("prefill", "decode"):
            at_max = sizes[pool] >= self.config.max_workers[pool]
            no_cores = self.last_refusals.get(pool) == "no_free_cores"
            if not broken[pool] or not (at_max or no_cores) or \
                    self._streak[pool, "up"] < self.config.up_after:
                if not broken[pool]:
                    self._at_bound_said.pop(pool, None)
                continue
            if now - self._at_bound_said.get(pool, -math.inf) < AT_BOUND_REPEAT_S:
                continue
            self._at_bound_said[pool] = now
            why = broken[pool][0]
            if at_max:
                bound = self.config.max_workers[pool]
                held = (f"at its maximum of {bound} workers",
                        f"--max-{pool}-workers bounds it", "max_workers")
            else:
                bound = sizes[pool]
                held = (f"at {bound} workers",
                        f"no_free_cores: {self._said.get(pool, '')}", "no_free_cores")
            logger.warning(
                "SLO planner: model %s: %s pool stays %s while %s is broken: %s (%s)",
                self._model, pool, held[0], why.name, why, held[1],
                extra={"planner": {"event": "at_bound", "model_name": self._model,
                                   "pool": pool, "bound": bound, "reason": held[2],
                                   "condition": why.name, "value": why.value,
                                   "target": why.target}})


def planner_config_from_args(args: argparse.Namespace):
    """The ``PlannerConfig`` of ``--autoscale``'s flags.

    Raises:
        ValueError: bounds or targets that cannot work, or start-up sizes outside them.
    """
    config = PlannerConfig(
        ttft_target_s=args.ttft_target_s, tpot_target_s=args.tpot_target_s,
        itl_target_s=args.itl_target_s,
        min_workers={"prefill": args.min_prefill_workers, "decode": args.min_decode_workers},
        max_workers={"prefill": args.max_prefill_workers, "decode": args.max_decode_workers},
        interval_s=args.planner_interval_s, cooldown_s=args.planner_cooldown_s)
    for role in ("prefill", "decode"):
        size = getattr(args, f"{role}_workers")
        if not config.min_workers[role] <= size <= config.max_workers[role]:
            raise ValueError(f"--{role}-workers={size} must be within --min-{role}-workers "
                             f"and --max-{role}-workers with --autoscale")
    return config


def new_prefill_path(config, decode_computes: Sequence[str], compute: str) -> str:
    """Where the router (``config``: its ``RouterConfig``) would prefill a long prompt if
    a prefill worker computing on ``compute`` (a ``compute_placement`` string; "" when
    unknown) joined: ``"remote"`` when, for some live decode worker
    (``decode_computes``), its rule (``choose_prefill_path``) sends it to that worker;
    else the rule's reason (``shared_compute``, ``short_prompt``). The prompt is the
    longest the router takes (``max_model_len``), with nothing cached and the new worker
    idle, so any other prompt goes remote no more often (the longest prompt is one token
    short of ``max_model_len``). With no live decode worker,
    ``"remote"`` (nothing to compare with)."""
    longest = (config.max_model_len or 1 << 30) - 1  # NOTE: a prompt leaves room for a token
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
