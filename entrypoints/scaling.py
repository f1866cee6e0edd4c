"""Resizing the prefill and decode pools of a running ``pdserve serve`` (Ray workers).

``PoolScaler.scale`` adds workers (Ray actors started like the first ones) and tells the
router about them the moment they serve, or removes workers by draining them: a worker
to remove leaves the registry and takes no new request (the router routes elsewhere at
once), its running requests and KV leases get ``drain_grace_s`` seconds to end, and what
still runs after that migrates to another decode worker. The newest workers leave first.
One resize runs at a time; within it the pools change together (both start their new
workers at once, then both wait), each all or nothing; a resize whose caller is cancelled
stops the workers it was starting.

On one CPU node the computing workers (``split``: the decode pool, and the prefill pool
with ``--disaggregation always``) each get CPUs of their own (``plan``): new workers take
the cores no running one's threads use (``free_cpus``), the running ones keeping their
thread counts; where too few are free (an operator's resize), the node's CPUs are split
between all of them again (``split_cpus``). The running ones apply their new CPU set and
thread count between two engine steps (the launcher's ``resplit``), so no core runs two
workers' OpenMP teams. A re-split adds no compute, so the SLO planner grows a computing
pool only onto free cores (``why_no_free_core``; its ``no_free_cores``); when a pool
shrinks, the workers that stay widen onto the cores left.

It also says where each worker computes and where a new one would (``placements``,
``placement``: the launcher's ``Placement``), which the SLO planner's policy asks.

The router's ``POST /admin/scale`` calls it (``router/http.py``), and ``pdserve scale``
posts there (``entrypoints/cli.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Sequence

logger = logging.getLogger(__name__)
MAX_WORKERS_PER_POOL = 64
DRAIN_CALL_MARGIN_S = 30.0  # beyond the grace: the stop after a drain


def split_cpus(cpus: Sequence[int], count: int) -> list[frozenset[int]]:
    """``cpus`` cut into ``count`` disjoint runs of consecutive entries, the first ones one
    CPU longer where they do not divide evenly: ``split_cpus([0, 1, 2], 2)`` is
    ``[{0, 1}, {2}]``.

    Raises:
        ScaleError: ``count`` workers would get less than one CPU each (``param``
            ``no_free_cores``), or ``count`` < 0.
    """
    if count < 0 or count > len(cpus):
        raise ScaleError(f"{count} workers would get less than one core each of the "
                         f"{len(cpus)} CPUs {','.join(map(str, cpus))}", "no_free_cores")
    size, longer = divmod(len(cpus), count) if count else (0, 0)
    runs, first = [], 0
    for i in range(count):
        last = first + size + (1 if i < longer else 0)
        runs.append(frozenset(cpus[first:last]))
        first = last
    return runs


def split_roles(disaggregation: str, has_gpus: bool, models_on_node: int) -> tuple[str, ...]:
    """The roles whose workers ``pdserve serve`` re-splits a CPU node's cores between
    (``PoolScaler``'s ``split``): with ``--disaggregation auto`` only the decode workers
    compute (the router prefills on them: the prefill workers share their CPUs), with
    ``always`` both pools do. None on GPUs (a GPU each) or with several models (their
    workers share the node; each scaler knows only its own)."""
    if has_gpus or models_on_node != 1:
        return ()
    return ("prefill", "decode") if disaggregation == "always" else ("decode",)


class ScaleError(ValueError):
    """A resize that cannot be done (a size out of bounds); ``param`` names the field
    (``prefill_workers``, ``decode_workers``) where one is at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(slots=True)
class _Member:
    actor: object
    worker_id: str
    placement: object = None  # the launcher's Placement; None when it cannot say


class PoolScaler:
    """Owns the worker actors of each pool of one ``pdserve serve``.

    Args:
        launcher: the ``RayLauncher`` that started the workers.
        configs: role -> the ``WorkerConfig`` new workers of that role start with.
        workers_on_node: passed to ``launcher.start`` (how the CPU cores are split; new
            workers get the thread count the first ones got).
        drain_grace_s: seconds a removed worker's requests and leases get to end.
        on_change: awaited after each change with the ids of the workers added and of
            those being removed (the router refreshes its pool with it).
        split: the roles whose workers compute (``split_roles``): on one CPU node (the
            launcher's ``node_cpus``), each of their workers gets CPUs of its own, re-split
            whenever their number changes (``plan``); empty: no re-split, new workers get
            the thread count the first ones got.
    """

    def __init__(self, launcher, configs: dict, workers_on_node: int, drain_grace_s: float,
                 on_change: Callable[[list[str], list[str]], Awaitable[None]] | None = None,
                 split: Sequence[str] = ()) -> None:
        self.launcher = launcher
        self.configs = configs
        self.workers_on_node = workers_on_node
        self.drain_grace_s = drain_grace_s
        self.on_change = on_change
        self.split = tuple(role for role in split if role in configs)
        self.members: dict[str, list[_Member]] = {role: [] for role in configs}
        self._lock = asyncio.Lock()

    def adopt(self, role: str, actor, worker_id: str, placement=None) -> None:
        """Count an actor started before the scaler (at start-up) in ``role``'s pool;
        ``placement`` (a ``Placement``) defaults to where the launcher placed it (its
        ``placement``: at start-up, workers are not pinned, each runs its thread count on
        the node's CPUs)."""
        self.members[role].append(_Member(actor, worker_id, placement or self._started(role)))

    def sizes(self) -> dict[str, int]:
        """Workers per pool, ``{"prefill": n, "decode": m}``."""
        return {role: len(members) for role, members in self.members.items()}

    def placement(self, role: str):
        """Where a new worker of ``role`` would compute (the launcher's ``Placement``:
        host, CPUs, threads); None when the launcher cannot say. Where the pools re-split
        (``resplits``), the CPUs it would get with one more worker of ``role`` (``plan``:
        the free cores, else a re-split), or None when each would get less than one core."""
        if role in self.split and self.resplits():
            sizes = self.sizes()
            sizes[role] += 1
            try:
                return self.plan(sizes)[role][-1]
            except ScaleError:
                return None
        return self._started(role)

    def _started(self, role: str):
        """Where the launcher places a worker of ``role`` it starts without a placement
        (None when it cannot say)."""
        place = getattr(self.launcher, "placement", None)
        if place is None or role not in self.configs or self.configs[role] is None:
            return None
        return place(self.configs[role], self.workers_on_node)

    def placements(self) -> dict[str, list]:
        """Role -> the ``Placement`` of each of its workers (None where unknown)."""
        return {role: [m.placement for m in members] for role, members in self.members.items()}

    def resplits(self) -> bool:
        """Whether a resize re-splits the CPUs of the ``split`` roles' workers: some role
        computes, and the launcher says the node's CPUs (one CPU node) and can re-split a
        running worker (``resplit``)."""
        node_cpus = getattr(self.launcher, "node_cpus", None)
        return bool(self.split) and callable(getattr(self.launcher, "resplit", None)) \
            and node_cpus is not None and node_cpus() is not None

    def plan(self, sizes: dict[str, int], strict: bool = True):
        """Role -> the ``Placement`` each worker of the ``split`` roles would have with
        ``sizes`` workers per pool, in the order of ``members`` (the workers kept first,
        then the new ones). Other roles are left out.

        When the pools grow and the cores no kept worker's threads use (``free_cpus``) give
        each new worker one at least, the kept workers keep their thread counts, each on
        as many CPUs of its own (``_held``), and the new ones split the free cores
        (``split_cpus``). Otherwise (too few free, or no new worker) the node's CPUs are
        split into disjoint runs, one per worker, each run's length its thread count: the
        kept workers narrow, or widen onto the cores of those leaving. With more workers
        than CPUs and not ``strict`` (an operator's explicit resize), each gets one thread
        on one CPU, the CPUs taken in turn.

        Raises:
            ScaleError: the pools do not re-split (``resplits``), or, ``strict``, a worker
                would get less than one core (``param`` ``no_free_cores``).
        """
        if not self.resplits():
            raise ScaleError("this launcher does not re-split the pools' CPUs")
        from pdserve.entrypoints.launcher import Placement

        host, cpus = self.launcher.node_cpus()
        cpus = sorted(cpus)
        counts = [sizes.get(role, len(self.members[role])) for role in self.split]
        kept = {role: min(count, len(self.members[role]))
                for role, count in zip(self.split, counts)}
        new = sum(counts) - sum(kept.values())
        held = self._held(kept, cpus) if new > 0 else None
        if held is not None and len(held[1]) >= new:  # NOTE: onto free cores only
            fresh = iter(split_cpus(held[1], new))
            runs = [run for role, count in zip(self.split, counts)
                    for run in held[0][role] + [next(fresh) for _ in range(count - kept[role])]]
        elif strict or sum(counts) <= len(cpus):
            runs = split_cpus(cpus, sum(counts))
        else:
            runs = [frozenset({cpus[i % len(cpus)]}) for i in range(sum(counts))]
        placed, first = {}, 0
        for role, count in zip(self.split, counts):
            placed[role] = [Placement(host, run, len(run)) for run in runs[first:first + count]]
            first += count
        return placed

    def _held(self, kept: dict[str, int], cpus: list[int]
              ) -> tuple[dict[str, list[frozenset[int]]], list[int]] | None:
        """The CPUs the first ``kept[role]`` workers of each ``split`` role hold for their
        threads on the node's ``cpus`` (role -> one run per worker: as many CPUs as its
        ``num_threads``, within those it may run on where they are free), and the CPUs
        left free (sorted). A worker pinned to as many CPUs as it has threads keeps them;
        one whose placement is unknown holds every CPU. None when their threads outnumber
        the CPUs."""
        node = set(cpus)
        members = [(role, m.placement) for role in self.split
                   for m in self.members[role][:kept[role]]]
        wants = []
        for role, placement in members:
            own = sorted(node & placement.cpus) if placement is not None else []
            own = own or cpus
            need = len(cpus) if placement is None else min(max(placement.num_threads, 1),
                                                           len(own))
            wants.append((own, need))
        if sum(need for _, need in wants) > len(cpus):
            return None
        taken: set[int] = set()
        runs: list[frozenset[int] | None] = [None] * len(wants)
        for i, (own, need) in enumerate(wants):  # NOTE: the pinned ones first: they stay
            if len(own) == need and not taken & set(own):
                runs[i] = frozenset(own)
                taken |= runs[i]
        for i, (own, need) in enumerate(wants):
            if runs[i] is None:
                order = [c for c in own if c not in taken] + \
                    [c for c in cpus if c not in taken and c not in own]
                runs[i] = frozenset(order[:need])
                taken |= runs[i]
        held: dict[str, list[frozenset[int]]] = {role: [] for role in self.split}
        for (role, _), run in zip(members, runs):
            held[role].append(run)
        return held, [c for c in cpus if c not in taken]

    def free_cpus(self) -> list[int]:
        """The CPUs of this node that no running worker of the ``split`` roles holds for
        its threads (``_held``), sorted: where a new one would start without taking cores
        from them. Empty where the pools do not re-split (``resplits``)."""
        if not self.resplits():
            return []
        held = self._held({role: len(self.members[role]) for role in self.split},
                          sorted(self.launcher.node_cpus()[1]))
        return [] if held is None else held[1]

    def why_no_free_core(self, count: int = 1) -> str | None:
        """Why ``count`` more workers of the ``split`` roles would not each get a free core
        (``free_cpus``), said for an operator; None when they would, or where the pools do
        not re-split. Another worker on no free core only splits the running ones' cores:
        it adds no compute (the SLO planner's ``no_free_cores``)."""
        if not self.resplits():
            return None
        free = self.free_cpus()
        if len(free) >= count:
            return None
        cpus = self.launcher.node_cpus()[1]
        running = [m.placement for role in self.split for m in self.members[role]]
        threads = sum(len(cpus) if p is None else p.num_threads for p in running)
        teams = f"{len(running)} computing worker(s), {threads} thread(s)"
        if not free:
            return (f"all {len(cpus)} cores of this node already run a worker's threads "
                    f"({teams}); another worker would only split them")
        return (f"{len(free)} of the {len(cpus)} cores of this node are free ({teams} on "
                f"the others), not one for each of {count} new workers")

    async def scale(self, sizes: dict[str, int | None]) -> dict[str, int]:
        """Resize the pools named in ``sizes`` (None leaves one as it is); returns the new
        sizes. Adding waits until the new workers serve (model loaded); removing waits
        until the workers drained and stopped.

        The pools change at once: the new workers of both start together and are waited
        for together, so a resize of both takes about as long as the slower pool's.

        Where the pools re-split (``resplits``), every worker of the ``split`` roles gets
        its CPUs and thread count of ``plan``: when their number grows, the new ones start
        on the free cores, the running ones first pinned to those they hold (their thread
        counts kept), or, with too few free cores, narrowed first (each between two engine
        steps) so the new ones start on the CPUs freed; when it shrinks, the ones left
        widen once the others are gone. So no core runs two workers' OpenMP teams, but for
        a leaving worker's drain, or when asked for more of them than there are cores (one
        thread each, the CPUs taken in turn). The SLO planner asks only for growth onto
        free cores (``why_no_free_core``).

        Raises:
            ScaleError: a size outside ``[0, 64]`` (``[1, 64]`` for decode), or a role
                this cluster has no pool for.
            RuntimeError: a new worker did not start: none of its pool's new workers is
                kept (the other pool's change stands); raised once both pools are done.
        """
        for role, size in sizes.items():
            if role not in self.members:
                raise ScaleError(f"no {role} pool to scale (roles: {sorted(self.members)})")
            low = 1 if role == "decode" else 0
            if size is not None and not low <= size <= MAX_WORKERS_PER_POOL:
                raise ScaleError(f"{role}_workers={size} must be in [{low}, "
                                 f"{MAX_WORKERS_PER_POOL}]", f"{role}_workers")
        async with self._lock:
            target = None
            if self.resplits():
                after = {**self.sizes(), **{r: n for r, n in sizes.items() if n is not None}}
                target = self.plan(after, strict=False)
                grows = sum(map(len, target.values())) > \
                    sum(len(self.members[role]) for role in self.split)
                if grows:  # NOTE: each running worker narrows before the new ones start
                    await self._resplit(target)
            changes = []
            for role, size in sizes.items():
                current = len(self.members[role])
                if size is not None and size > current:
                    changes.append(self._add(role, size - current, target))
                elif size is not None and size < current:
                    changes.append(self._remove(role, current - size))
            errors = [r for r in await asyncio.gather(*changes, return_exceptions=True)
                      if isinstance(r, BaseException)]
            if target is not None and (errors or not grows):
                # NOTE: widen onto the cores left
                await self._resplit(self.plan(self.sizes(), strict=False))
            if errors:
                raise errors[0]
            return self.sizes()

    async def _resplit(self, target: dict[str, list]) -> None:
        """Give each running worker of the ``split`` roles its ``Placement`` in ``target``
        (``plan``; the i-th worker of a role the i-th entry) where it changes, all at
        once; each applies it between two engine steps (``launcher.resplit``). A worker
        that fails to (dead, or stuck) keeps its placement, with a warning."""
        moves = [(member, placement) for role, placements in target.items()
                 for member, placement in zip(self.members[role], placements)
                 if member.placement != placement]
        results = await asyncio.gather(
            *(asyncio.to_thread(self.launcher.resplit, member.actor, place)
              for member, place in moves), return_exceptions=True)
        for (member, placement), result in zip(moves, results):
            if isinstance(result, Exception):
                logger.warning("scaling: %s not re-split: %s", member.worker_id, result)
                continue
            member.placement = placement
            logger.info("scaling: %s re-split onto CPUs %s (%d threads)", member.worker_id,
                        placement.compute.rpartition(":")[2], placement.num_threads)

    async def _add(self, role: str, count: int, target: dict[str, list] | None = None
                   ) -> None:
        """Start ``count`` workers of ``role`` and wait until they serve; where the pools
        re-split, on their CPUs in ``target`` (the last ``count`` of ``role``'s)."""
        config = self.configs[role]
        if target is not None and role in target:
            placements = target[role][-count:]
            actors = self.launcher.start(config, count, self.workers_on_node,
                                         placements=placements)
        else:
            placements = [self.placement(role)] * count
            actors = self.launcher.start(config, count, self.workers_on_node)
        logger.info("scaling: starting %d %s worker(s)", count, role)
        started: list[str] = []
        try:
            infos = await asyncio.to_thread(self.launcher.wait_ready, actors)
        except BaseException:
            # NOTE: a failed start, or the caller cancelled: half a resize is none, and a
            # worker still starting in the waiting thread is no one's once this returns
            for actor in actors:
                self.launcher.remove(actor)
            raise
        for actor, info, placement in zip(actors, infos, placements):
            self.members[role].append(_Member(actor, info.worker_id, placement))
            started.append(info.worker_id)
            logger.info("scaling: %s worker %s ready (gRPC %s)", role, info.worker_id,
                        info.grpc_address)
        if self.on_change is not None:
            await self.on_change(started, [])

    async def _remove(self, role: str, count: int) -> None:
        leaving = self.members[role][-count:]
        del self.members[role][-count:]
        ids = [m.worker_id for m in leaving]
        logger.info("scaling: draining %s worker(s) %s", role, ", ".join(ids))
        if self.on_change is not None:
            await self.on_change([], ids)
        await asyncio.gather(*(self._drain(m) for m in leaving))

    async def _drain(self, member: _Member) -> None:
        timeout_s = self.drain_grace_s + DRAIN_CALL_MARGIN_S
        try:
            drained = await asyncio.wait_for(
                asyncio.wrap_future(member.actor.drain.remote(self.drain_grace_s).future()),
                timeout_s)
            if not drained:
                logger.warning("scaling: %s still had requests after %.0f s; they migrate",
                               member.worker_id, self.drain_grace_s)
        except Exception:  # NOTE: dead already, or stuck: it goes either way
            logger.warning("scaling: draining %s failed; stopping it", member.worker_id,
                           exc_info=True)
        self.launcher.remove(member.actor)
        logger.info("scaling: %s removed", member.worker_id)
