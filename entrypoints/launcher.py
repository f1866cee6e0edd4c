"""Start prefill and decode workers as Ray actors (docs/architecture.md, Launch).

Each worker is one actor running its gRPC server on an event loop thread. Actors restart
when they die (``max_restarts=-1``); a restarted actor is a new incarnation with a new
worker id, so the registry and prefix index never mix its empty cache with the old one's.
On GPU nodes each actor takes one GPU; on CPU the machine's cores are split between the
workers (``num_threads``), so two workers on one machine do not oversubscribe it; on one
CPU node ``start`` may pin an actor to a CPU set (``Placement``) and ``resplit`` moves a
running one to another (``PoolScaler`` re-splits the node's cores at each resize).

A local Ray (no ``ray_address``) binds as narrowly as Ray allows: with node IP 127.0.0.1
Ray's gRPC servers (GCS, raylet, object manager, every worker's and driver's core worker),
its dashboard agent, metrics exporter and runtime-env agent all listen on loopback only,
and there is no dashboard unless asked for. Ray keys all of that on the node IP being
exactly ``127.0.0.1``, and on Linux ``ray.init`` replaces a loopback node IP by the
routable one unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (its single-node mode, the
default on Windows and macOS) is set before Ray is imported.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pdserve.cluster import event_loop
from pdserve.cluster.metrics_auth import is_loopback_host
from pdserve.cluster.worker_config import WorkerConfig, default_num_threads

logger = logging.getLogger(__name__)
START_TIMEOUT_S = 300.0
PREPARE_TIMEOUT_S = 3600.0
"""Seconds every node has to download (or find) a model before its workers start."""
WAIT_SLICE_S = 0.5  # the longest one blocking Ray call of wait_ready keeps a signal waiting


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A running worker: its id, role, addresses (``metrics_address`` "" when it serves
    no metrics) and process id."""

    worker_id: str
    role: str
    grpc_address: str
    kv_address: str
    pid: int
    metrics_address: str = ""
    node_id: str = ""  # the Ray node it runs on


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a worker computes, as its launcher places it: ``host`` (its hostname, as
    ``compute_placement`` records it; "" where the launcher cannot tell, as on a GPU node
    or a multi-node cluster, where Ray picks the node), the CPUs it may run on
    (``cpus``, empty when unknown) and its OpenMP team's ``num_threads``."""

    host: str
    cpus: frozenset[int]
    num_threads: int

    @property
    def compute(self) -> str:
        """``cpu@<host>:<cpus>``, the ``compute`` of the worker's registry record
        (``cluster.worker_runtime.compute_placement``); "" when unknown, which the
        router's ``shares_compute`` treats as sharing nothing."""
        if not self.host or not self.cpus:
            return ""
        return f"cpu@{self.host}:{','.join(str(c) for c in sorted(self.cpus))}"


class WorkerActor:
    """The body of a worker actor (wrapped by ``ray.remote`` in ``RayLauncher``)."""

    def __init__(self, config: WorkerConfig, cpus: frozenset[int] | None = None) -> None:
        from pdserve.entrypoints.worker_main import make_worker

        if cpus:  # NOTE: before the engine's threads exist: they inherit it
            from pdserve.engine.cpu_threads import set_process_affinity

            set_process_affinity(cpus)
        # A new incarnation (first start or a Ray restart) gets its own worker id.
        config = dataclasses.replace(config, worker_id=f"{config.worker_id}-{os.getpid()}")
        config = _on_this_node(config)
        self.loop = event_loop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                       name="worker-loop")
        self.thread.start()
        self.worker = make_worker(config)
        self._run(self.worker.start(), START_TIMEOUT_S)

    def _run(self, coro, timeout_s: float):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def info(self) -> WorkerInfo:
        import ray

        metrics = self.worker.runtime.metrics_server
        return WorkerInfo(self.worker.worker_id, self.worker.config.role,
                          self.worker.grpc_address, self.worker.kv_address, os.getpid(),
                          metrics.address if metrics is not None else "",
                          ray.get_runtime_context().get_node_id())

    def stop(self) -> None:
        self._run(self.worker.stop(), 30.0)

    def resplit(self, cpus: list[int], num_threads: int) -> str:
        """Run on ``cpus`` with ``num_threads`` intra-op threads from the next engine
        step on (``WorkerRuntime.resplit``); returns the registry record's new
        ``compute``."""
        return self._run(self.worker.runtime.resplit(cpus, num_threads), 60.0)

    def drain(self, grace_s: float) -> bool:
        """Drain (``Worker.drain``: out of the registry, no new requests, ``grace_s``
        seconds for those running and the KV leases), then stop; True if all ended."""
        return self._run(self._drain_and_stop(grace_s), grace_s + 30.0)

    async def _drain_and_stop(self, grace_s: float) -> bool:
        drained = await self.worker.drain(grace_s)
        await self.worker.stop(grace_s=0.0)  # NOTE: the grace is spent; the rest migrates
        return drained


# Ray's variables for the ports of the Prometheus exporters of its autoscaler monitor
# (ray/autoscaler/_private/constants.py, default 44217) and of its dashboard head
# (ray/dashboard/consts.py, default 44227); read once, when each of those processes starts
RAY_HEAD_EXPORTER_PORT_ENVS = ("AUTOSCALER_METRIC_PORT", "DASHBOARD_METRIC_PORT")
NO_PORT = "-1"  # a port no socket can bind


@contextlib.contextmanager
def _without_head_exporters(routable: bool) -> Iterator[None]:
    """While ``ray.init`` starts a local Ray's head (``routable``: on a routable node IP),
    its autoscaler monitor and dashboard head start no Prometheus exporter.

    Each of them binds its exporter (``prometheus_client.start_http_server``) to every
    interface, with no credential, unless the node IP is loopback, and Ray has no switch
    that turns them off or narrows them (neither ``ray.init`` nor its system config; the
    monitor is started for every head, the dashboard head also without
    ``include_dashboard``). Ray takes their ports from the variables
    ``RAY_HEAD_EXPORTER_PORT_ENVS`` and treats an exporter that cannot bind as
    non-fatal (logged to monitor.log and dashboard.log, as when the port is taken);
    so, in the environment these two processes inherit, each is a port nothing can bind
    (``NO_PORT``). Only the processes ``ray.init`` starts inherit it (Ray's own, and the
    workers its raylet spawns, which never read it); this process gets its previous
    values back once ``ray.init`` returns. pdserve reads none of Ray's metrics.
    ``tests/test_listeners.py`` asserts that a routable local Ray listens on neither.
    """
    if not routable:
        yield
        return
    saved = {name: os.environ.get(name) for name in RAY_HEAD_EXPORTER_PORT_ENVS}
    os.environ.update(dict.fromkeys(RAY_HEAD_EXPORTER_PORT_ENVS, NO_PORT))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


_WILDCARDS = ("0.0.0.0", "::", "")
LOOPBACK_NODE_IP = "127.0.0.1"  # the one node IP for which Ray binds loopback only
SINGLE_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": ray.init keeps 127.0.0.1
ADVERTISE_HOST_ENV = "PDSERVE_ADVERTISE_HOST"  # a node's name for its workers' gRPC


def node_ip_for(*hosts: str) -> str | None:
    """The node IP a local Ray should take for workers and a router on ``hosts``.

    127.0.0.1 (loopback only) when every host is a loopback address; Ray's own choice
    (``None``: the routable address) when one is a wildcard; else the first other host,
    which other nodes can reach.
    """
    others = [host for host in hosts if not is_loopback_host(host)]
    if not others:
        return LOOPBACK_NODE_IP
    if any(host in _WILDCARDS for host in others):
        return None
    return others[0]


def _on_this_node(config: WorkerConfig) -> WorkerConfig:
    """Replace wildcard addresses (``--worker-host 0.0.0.0``: "whichever node a worker
    lands on") with this node's IP, for the gRPC server and the KV channel alike: each
    binds the address it advertises, which the other nodes must reach, and nothing else.

    Where this node's environment sets ``$PDSERVE_ADVERTISE_HOST`` (a Kubernetes pod's
    DNS name, the one its certificate names: deploy/kuberay/cert-manager.yaml), the gRPC
    server advertises that name instead of the IP it binds."""
    advertise = os.environ.get(ADVERTISE_HOST_ENV, "").strip()
    if advertise and config.advertise_host is None:
        config = dataclasses.replace(config, advertise_host=advertise)
    if config.host not in _WILDCARDS and config.kv_host not in _WILDCARDS:
        return config
    import ray

    node_ip = ray.util.get_node_ip_address()
    return dataclasses.replace(
        config, host=node_ip if config.host in _WILDCARDS else config.host,
        kv_host=node_ip if config.kv_host in _WILDCARDS else config.kv_host)



def _worker_niceness() -> int:
    """``RAY_worker_niceness`` (default 0): the nice value of a local Ray's workers.

    Raises:
        ValueError: it is not an integer in [-20, 19], naming the variable.
    """
    raw = os.environ.get("RAY_worker_niceness", "0")
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or not -20 <= value <= 19:
        raise ValueError(f"RAY_worker_niceness must be an integer from -20 to 19 (a nice "
                         f"value), got {raw!r}")
    return value


RAY_START_ATTEMPTS = 2  # a local Ray whose node did not come up is started once more
_RAY_NODE_TIMED_OUT = "timed out during startup"  # Ray's message (its wait is fixed: 30 s)


def _init_ray(ray, local: bool, **kwargs) -> None:
    """``ray.init(**kwargs)``; a local Ray whose node did not register within Ray's fixed
    wait (30 s: on a loaded machine, or when its raylet died while starting) is started
    again, up to ``RAY_START_ATTEMPTS`` in all. The failed start's processes are Ray's
    reaper's to stop when this process exits.

    Raises:
        Exception: what ``ray.init`` raised, past the last attempt or when not a local
            node's start-up timeout.
    """
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        try:
            # NOTE: a copy each time: ray.init adds its own keys to _system_config
            ray.init(**{key: dict(value) if isinstance(value, dict) else value
                        for key, value in kwargs.items()})
            return
        except Exception as exc:
            if not local or _RAY_NODE_TIMED_OUT not in str(exc) or \
                    attempt == RAY_START_ATTEMPTS:
                raise
            logger.warning("Ray's node did not start (attempt %d of %d: %s); its raylet "
                           "said: %s; starting Ray again", attempt, RAY_START_ATTEMPTS,
                           exc, _raylet_errors() or "nothing")
            ray.shutdown()


def _raylet_errors(limit: int = 2000) -> str:
    """The end of the latest local Ray session's ``raylet.err`` (at most ``limit``
    characters), to say why a node did not start; empty when there is none."""
    try:
        from ray._common.utils import get_default_ray_temp_dir

        path = os.path.join(get_default_ray_temp_dir(), "session_latest", "logs",
                            "raylet.err")
        with open(path, errors="replace") as file:
            return file.read()[-limit:].strip()
    except (ImportError, OSError):
        return ""


class RayLauncher:
    """Joins a Ray cluster (``ray_address``) or starts a local one, and runs worker actors.

    Without ``ray_address`` it always starts a new local Ray (it never joins one named by
    ``RAY_ADDRESS`` or left by ``ray start``), which takes ``node_ip`` (default 127.0.0.1:
    every Ray listener on loopback; ``None``: Ray's routable default) and starts its
    dashboard only with ``dashboard`` (on 127.0.0.1:8265, Ray's default). Neither applies
    when joining ``ray_address``. Ray's token authentication is on for a local
    Ray (Ray's default unless ``RAY_AUTH_MODE=disabled``; the token is
    ``~/.ray/auth_token``). A local Ray on a routable node IP runs without Ray's metrics
    collection (``enable_metrics_collection``), so its dashboard agent opens no Prometheus
    exporter: that one would bind every interface and answer anyone; nor do its
    autoscaler monitor and dashboard head (``_without_head_exporters``). A local Ray starts
    its workers at nice 0 (``RAY_worker_niceness`` sets another), not at Ray's default 15.

    Raises:
        RuntimeError: from the constructor when a loopback Ray was asked for but Ray was
            imported before this process could select its single-node mode; from
            ``launch`` and ``wait_ready`` when an actor fails to start, or does not within
            ``START_TIMEOUT_S`` seconds.
    """

    def __init__(self, ray_address: str | None = None, num_cpus: int | None = None,
                 node_ip: str | None = LOOPBACK_NODE_IP, dashboard: bool = False) -> None:
        local = ray_address is None
        loopback = local and node_ip == LOOPBACK_NODE_IP
        if loopback:
            os.environ[SINGLE_NODE_ENV] = "0"  # NOTE: read once, when Ray is imported
        import ray

        self.ray = ray
        if not ray.is_initialized():
            if loopback:
                _check_single_node_mode()
            init_kwargs = {"_node_ip_address": node_ip} if local and node_ip else {}
            if local:
                # NOTE: Ray starts its workers at nice 15; here they are the engines, and
                # the router, Redis and a client at nice 0 took their cores first
                init_kwargs["_system_config"] = {"worker_niceness": _worker_niceness()}
            if local and not loopback:
                # NOTE: a routable local Ray's agent would export its Prometheus metrics on
                # every interface to anyone; pdserve's own metrics do not go through Ray
                init_kwargs["_system_config"]["enable_metrics_collection"] = False
            # NOTE: "local", not None: None would join a cluster named by RAY_ADDRESS or
            # by the last `ray start` on this machine, with whatever listeners it has
            with _without_head_exporters(local and not loopback):
                _init_ray(ray, local, address=ray_address or "local", num_cpus=num_cpus,
                          include_dashboard=dashboard if local else False,
                          ignore_reinit_error=True, log_to_driver=False,
                          configure_logging=False, **init_kwargs)
        self.actors: list = []
        self.certificate_authority = None  # a ClusterCA: each new actor gets its own cert
        self._names: dict = {}  # actor handle -> its first worker id ("prefill-0")
        self._num_started = 0  # names stay unique when workers leave
        self._actor_cls = ray.remote(WorkerActor)
        self.has_gpus = ray.cluster_resources().get("GPU", 0) > 0

    def prepare_model(self, model: str, expected: str, *, revision: str | None = None,
                      download_dir: str | None = None, demo: bool = False,
                      timeout_s: float = PREPARE_TIMEOUT_S) -> int:
        """Make ``model`` local on every other alive node, once per node, before any worker
        starts there (this node resolved it already, to ``expected``): a hub id is found
        in, or downloaded into, that node's Hugging Face cache; a local path is checked;
        the demo model (``demo``) is written where it is missing. Returns the nodes it is
        ready on, this one included.

        Raises:
            FileNotFoundError: a node cannot have it (not on the hub, offline and not in its
                cache, no such path there), naming the node.
            RuntimeError: a node resolved it to another path than ``expected`` (give every
                node the same ``HF_HOME`` or ``--download-dir``), or did not answer within
                ``timeout_s``.
        """
        ray = self.ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = ray.get_runtime_context().get_node_id()
        nodes = [n for n in ray.nodes() if n["Alive"] and n["NodeID"] != here]
        task = ray.remote(num_cpus=0, max_retries=0)(_prepare_model_here)
        refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            n["NodeID"], soft=False)).remote(model, revision, download_dir,
                                             expected if demo else None) for n in nodes]
        try:
            paths = ray.get(refs, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            raise RuntimeError(f"--model {model}: a node did not have it within "
                               f"{timeout_s:.0f} s") from exc
        except ray.exceptions.RayTaskError as exc:
            raise FileNotFoundError(f"--model {model} on another node: "
                                    f"{str(exc.cause or exc).splitlines()[0]}") from exc
        for node, path in zip(nodes, paths):
            if path != expected:
                raise RuntimeError(
                    f"--model {model} is {path} on node {node['NodeManagerAddress']} but "
                    f"{expected} here: give every node the same HF_HOME or --download-dir")
        return len(nodes) + 1

    def launch(self, config: WorkerConfig, count: int, workers_on_node: int) -> list[WorkerInfo]:
        """Start ``count`` actors of ``config.role`` and wait until all serve
        (``start``, then ``wait_ready``)."""
        return self.wait_ready(self.start(config, count, workers_on_node))

    def start(self, config: WorkerConfig, count: int, workers_on_node: int,
              placements: list[Placement] | None = None) -> list:
        """Create ``count`` actors of ``config.role`` and return their handles at once; each
        starts its worker in its constructor (``wait_ready`` waits for that).

        ``workers_on_node``: the workers on this node that compute at the same time; their
        number splits the cores into each one's default CPU threads. ``placements`` (one
        per actor, from ``PoolScaler.plan``): each actor runs on its CPUs with its
        ``num_threads`` instead.

        With a ``certificate_authority`` (``pdserve serve --cluster-tls auto``), each actor
        gets a key and certificate of its own, issued here, naming the address it will
        advertise (``advertised_hosts``); the CA's key stays in this process.
        """
        engine = config.engine
        tp = engine.tensor_parallel_size
        if engine.num_threads is None and not self.has_gpus:  # NOTE: each rank's share
            engine = dataclasses.replace(
                engine, num_threads=self._cpu_threads(config, workers_on_node))
        # NOTE: SPREAD puts the workers on as many nodes as there are (on one node, all
        # there); the default packs them onto the first node with room. A tensor-parallel
        # worker takes one GPU per rank, all on one node (one actor's resources always
        # are: a STRICT_PACK placement of its ranks), and spawns its ranks there.
        options = {"max_restarts": -1, "max_task_retries": 3, "num_cpus": 0,
                   "num_gpus": tp if self.has_gpus else 0, "scheduling_strategy": "SPREAD"}
        actors = []
        for i in range(count):
            name = f"{config.role}-{self._num_started}"
            self._num_started += 1
            place = placements[i] if placements else None
            member = dataclasses.replace(config, worker_id=name, engine=engine if place is None
                                         else dataclasses.replace(
                                             engine, num_threads=place.num_threads))
            if self.certificate_authority is not None and config.auth is not None:
                member.auth = config.auth.with_tls(self.certificate_authority.issue(
                    name, self.advertised_hosts(config)))
            actor = self._actor_cls.options(**options).remote(
                member, None if place is None else place.cpus)
            self.actors.append(actor)
            self._names[actor] = name
            actors.append(actor)
        return actors

    def _cpu_threads(self, config: WorkerConfig, workers_on_node: int) -> int:
        """The intra-op threads an actor of ``config`` gets on CPU (``start``): its
        ``num_threads``, else its share of the node's cores split ``workers_on_node`` ways
        and then between its tensor-parallel ranks."""
        engine = config.engine
        if engine.num_threads is not None:
            return engine.num_threads
        return max(1, default_num_threads(workers_on_node) // engine.tensor_parallel_size)

    def placement(self, config: WorkerConfig, workers_on_node: int) -> Placement:
        """Where an actor of ``config`` started now (``start``) would compute. Actors are
        not pinned: each may run on every CPU its node allows Ray's workers (this
        process's affinity, which Ray's processes inherit), with ``_cpu_threads`` threads.
        On one CPU node that is this host's CPU set; on GPUs (a GPU of its own) or with
        several nodes (Ray picks one) the host and CPUs are unknown (empty)."""
        if self.has_gpus:
            return Placement("", frozenset(), 0)
        threads = self._cpu_threads(config, workers_on_node)
        if sum(1 for node in self.ray.nodes() if node["Alive"]) > 1:
            return Placement("", frozenset(), threads)
        return Placement(socket.gethostname(), frozenset(os.sched_getaffinity(0)), threads)

    def node_cpus(self) -> tuple[str, frozenset[int]] | None:
        """(this host's name, the CPUs Ray's workers may run on) on one CPU node, where
        ``resplit`` can give each worker CPUs of its own; None on GPUs or with several
        nodes (Ray picks each actor's node)."""
        if self.has_gpus or sum(1 for node in self.ray.nodes() if node["Alive"]) > 1:
            return None
        return socket.gethostname(), frozenset(os.sched_getaffinity(0))

    def resplit(self, actor, placement: Placement, timeout_s: float = 60.0) -> str:
        """Move running ``actor`` onto ``placement``'s CPUs and thread count (it applies
        them between two engine steps: ``WorkerActor.resplit``); blocks until it has and
        returns its new ``compute``.

        Raises:
            RuntimeError: the actor did not within ``timeout_s`` seconds, or failed.
        """
        ref = actor.resplit.remote(sorted(placement.cpus), placement.num_threads)
        try:
            return self.ray.get(ref, timeout=timeout_s)
        except Exception as exc:
            raise RuntimeError(f"worker {self._names.get(actor, '?')} did not re-split onto "
                               f"CPUs {placement.compute}: {exc}") from exc

    def wait_ready(self, actors: list, on_ready: Callable[[WorkerInfo], None] | None = None,
                   timeout_s: float = START_TIMEOUT_S) -> list[WorkerInfo]:
        """Wait until every actor in ``actors`` serves; return their infos in ``actors``'
        order, calling ``on_ready(info)`` for each as it becomes ready.

        Waits in ``ray.wait`` slices of ``WAIT_SLICE_S`` seconds, so a signal handler's
        exception (KeyboardInterrupt on SIGINT) reaches the caller within one slice.

        Raises:
            RuntimeError: an actor failed to start, or not all served within ``timeout_s``.
        """
        pending = {actor.info.remote(): i for i, actor in enumerate(actors)}
        infos: list[WorkerInfo | None] = [None] * len(actors)
        deadline = time.monotonic() + timeout_s
        while pending:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                names = ", ".join(self._names[actors[i]] for i in pending.values())
                raise RuntimeError(f"workers did not start within {timeout_s:.0f} s: {names}")
            ready, _ = self.ray.wait(list(pending), num_returns=1,
                                     timeout=min(WAIT_SLICE_S, left_s))
            for ref in ready:
                i = pending.pop(ref)
                try:
                    infos[i] = self.ray.get(ref)
                except Exception as exc:
                    raise RuntimeError(
                        f"worker {self._names[actors[i]]} did not start: {exc}") from exc
                if on_ready is not None:
                    on_ready(infos[i])
        return infos

    def infos(self, timeout_s: float = 60.0) -> list[WorkerInfo]:
        return self.ray.get([a.info.remote() for a in self.actors], timeout=timeout_s)

    def remove(self, actor) -> None:
        """Kill ``actor`` for good and forget it (a worker leaving its pool)."""
        if actor in self.actors:
            self.actors.remove(actor)
        self._names.pop(actor, None)
        self._kill_quietly(actor)

    def kill(self, index: int, no_restart: bool = False) -> None:
        """Kill actor ``index`` (Ray restarts it unless ``no_restart``): for failure tests."""
        self.ray.kill(self.actors[index], no_restart=no_restart)

    def shutdown(self, stop_timeout_s: float = 30.0) -> None:
        """Stop every actor and disconnect from Ray (which stops a Ray this launcher started).

        The actors are asked to stop all at once and given ``stop_timeout_s`` seconds in all
        (0: none, as when start-up is interrupted and they may still be starting); then each
        is killed without restart.
        """
        actors, self.actors = self.actors, []
        try:
            if stop_timeout_s > 0 and actors:
                refs = [actor.stop.remote() for actor in actors]
                _, not_ready = self.ray.wait(refs, num_returns=len(refs), timeout=stop_timeout_s)
                if not_ready:
                    logger.warning("%d worker actor(s) did not stop within %.0f s; killing",
                                   len(not_ready), stop_timeout_s)
        finally:
            for actor in actors:
                self._kill_quietly(actor)
            self._names.clear()
            self.ray.shutdown()

    def advertised_hosts(self, config: WorkerConfig) -> list[str]:
        """The gRPC hosts an actor of ``config`` may advertise: its ``advertise_host`` or
        ``host``; for a wildcard (``--worker-host 0.0.0.0``), the IP of every alive Ray node,
        since the actor advertises the IP of the node it lands on (``_on_this_node``)."""
        host = config.advertise_host or config.host
        if host not in _WILDCARDS:
            return [host]
        return sorted({n["NodeManagerAddress"] for n in self.ray.nodes() if n["Alive"]})

    def node_ip(self) -> str:
        """The IP address of the Ray node this process is on."""
        return self.ray.util.get_node_ip_address()

    def _kill_quietly(self, actor) -> None:
        try:
            self.ray.kill(actor, no_restart=True)
        except Exception:  # NOTE: already dead, or Ray is going down
            logger.debug("could not kill a worker actor", exc_info=True)


def _prepare_model_here(model: str, revision: str | None, download_dir: str | None,
                        demo_path: str | None) -> str:
    """On one node: the absolute local path of ``model`` there (``hub.resolve_model``), or
    the demo model written at ``demo_path``."""
    from pathlib import Path

    if demo_path is not None:
        from pdserve.engine.demo_model import ensure_demo_model

        return str(ensure_demo_model(demo_path))
    from pdserve.engine.hub import resolve_model

    return str(Path(resolve_model(model, revision=revision, download_dir=download_dir))
               .expanduser().absolute())


def _check_single_node_mode() -> None:
    """Raise unless Ray's single-node mode is on (it keeps node IP 127.0.0.1)."""
    from ray._private import ray_constants

    if ray_constants.ENABLE_RAY_CLUSTER:
        raise RuntimeError(
            f"cannot start Ray on 127.0.0.1 only: Ray was imported before {SINGLE_NODE_ENV}=0 "
            "was set; set it in the environment, or import pdserve's launcher first, or "
            "pass node_ip=None for Ray's routable node IP")
