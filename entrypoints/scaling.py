"""Resizing the prefill and decode pools of a running ``pdserve serve`` (Ray workers).

``PoolScaler.scale`` adds workers (Ray actors started like the first ones) and tells the
router about them the moment they serve, or removes workers by draining them: a worker
to remove leaves the registry and takes no new request (the router routes elsewhere at
once), its running requests and KV leases get ``drain_grace_s`` seconds to end, and what
still runs after that migrates to another decode worker. The newest workers leave first.
One resize runs at a time; within it the pools change together (both start their new
workers at once, then both wait), each all or nothing.

It also says where each worker computes and where a new one would (``placements``,
``placement``: the launcher's ``Placement``), which the SLO planner's policy asks.

The router's ``POST /admin/scale`` calls it (``router/http.py``), and ``pdserve scale``
posts there (``entrypoints/cli.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)
MAX_WORKERS_PER_POOL = 64
DRAIN_CALL_MARGIN_S = 30.0  # beyond the grace: the stop after a drain


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
    """

    def __init__(self, launcher, configs: dict, workers_on_node: int, drain_grace_s: float,
                 on_change: Callable[[list[str], list[str]], Awaitable[None]] | None = None
                 ) -> None:
        self.launcher = launcher
        self.configs = configs
        self.workers_on_node = workers_on_node
        self.drain_grace_s = drain_grace_s
        self.on_change = on_change
        self.members: dict[str, list[_Member]] = {role: [] for role in configs}
        self._lock = asyncio.Lock()

    def adopt(self, role: str, actor, worker_id: str, placement=None) -> None:
        """Count an actor started before the scaler (at start-up) in ``role``'s pool;
        ``placement`` (a ``Placement``) defaults to where the launcher places ``role``'s
        workers (``placement``)."""
        self.members[role].append(_Member(actor, worker_id, placement or self.placement(role)))

    def sizes(self) -> dict[str, int]:
        """Workers per pool, ``{"prefill": n, "decode": m}``."""
        return {role: len(members) for role, members in self.members.items()}

    def placement(self, role: str):
        """Where a new worker of ``role`` would compute (the launcher's ``Placement``:
        host, CPUs, threads); None when the launcher cannot say."""
        place = getattr(self.launcher, "placement", None)
        if place is None or role not in self.configs or self.configs[role] is None:
            return None
        return place(self.configs[role], self.workers_on_node)

    def placements(self) -> dict[str, list]:
        """Role -> the ``Placement`` of each of its workers (None where unknown)."""
        return {role: [m.placement for m in members] for role, members in self.members.items()}

    async def scale(self, sizes: dict[str, int | None]) -> dict[str, int]:
        """Resize the pools named in ``sizes`` (None leaves one as it is); returns the new
        sizes. Adding waits until the new workers serve (model loaded); removing waits
        until the workers drained and stopped.

        The pools change at once: the new workers of both start together and are waited
        for together, so a resize of both takes about as long as the slower pool's.

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
            changes = []
            for role, size in sizes.items():
                current = len(self.members[role])
                if size is not None and size > current:
                    changes.append(self._add(role, size - current))
                elif size is not None and size < current:
                    changes.append(self._remove(role, current - size))
            errors = [r for r in await asyncio.gather(*changes, return_exceptions=True)
                      if isinstance(r, BaseException)]
            if errors:
                raise errors[0]
            return self.sizes()

    async def _add(self, role: str, count: int) -> None:
        config = self.configs[role]
        placement = self.placement(role)
        actors = self.launcher.start(config, count, self.workers_on_node)
        logger.info("scaling: starting %d %s worker(s)", count, role)
        started: list[str] = []
        try:
            infos = await asyncio.to_thread(self.launcher.wait_ready, actors)
        except RuntimeError:
            for actor in actors:  # NOTE: half a resize is none: stop the lot
                self.launcher.remove(actor)
            raise
        for actor, info in zip(actors, infos):
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
