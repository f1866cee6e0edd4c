"""Settings of one prefill or decode worker process, and its command line.

Engine flags are vLLM's (``engine/args.py``); worker flags add where it listens, the Redis
registry, the KV lease and transfer timeouts, and the CPU threads it may use.
"""

from __future__ import annotations

import argparse
import os
import socket
import uuid
from dataclasses import dataclass, field, fields

from pdserve.cluster.auth import (
    ClusterAuth,
    add_cluster_auth_args,
    cluster_auth_from_args,
    redis_password_from_args,
    redis_url_with_password,
)
from pdserve.cluster.metrics_auth import (
    MetricsAuth,
    add_metrics_auth_args,
    metrics_auth_from_args,
)
from pdserve.engine.engine_config import EngineConfig

ROLES = ("prefill", "decode")


def available_cpus() -> int:
    """The CPUs this process may run on: its affinity mask where the OS has one (``taskset``,
    a container's cpuset, a SLURM allocation), else every CPU of the machine. A CPU quota
    without a cpuset (a Kubernetes limit alone) is not seen: give ``--num-threads``."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # NOTE: no affinity masks (macOS)
        return os.cpu_count() or 1


def default_num_threads(workers_on_node: int) -> int:
    """Split the CPUs this process may use (``available_cpus``; not the machine's count: 8
    of 64 CPUs under ``taskset`` gave each of 2 workers 32 threads on 8 CPUs) evenly
    between the workers placed on it (at least 1)."""
    return max(1, available_cpus() // max(1, workers_on_node))


def default_worker_id(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(slots=True)
class WorkerConfig:
    """One worker. Addresses are ``host:port`` (port 0 takes a free one); times in seconds.

    ``kv_host`` is the address the KV channel binds and advertises (the decode worker's
    KV store, gloo's sockets); it must be reachable from the other pool.
    ``advertise_host`` is the gRPC address written to the registry when ``host`` is a
    wildcard such as ``0.0.0.0`` (default: ``host``).
    ``auth``: the cluster secret (and mutual TLS) every RPC to and from this worker and
    its registry record are authenticated with; None runs without authentication (only
    for a worker built in-process; every command line sets one). ``redis_url`` may hold
    the Redis password. ``kv_connect_timeout_s`` bounds reaching a peer's KV store and
    setting up a pair channel; ``kv_transfer_timeout_s`` one KV transfer (the decode
    worker's pull, the prefill worker's send); ``kv_alloc_timeout_s`` how long a decode
    worker lets a request with prefilled KV wait for free blocks before refusing it
    (RESOURCE_EXHAUSTED: the router tries another decode worker). ``metrics_port``: the
    port of the worker's Prometheus ``/metrics`` (0 takes a free one, None serves none);
    ``metrics_auth``: the digests of the keys it takes. With a key it is bound on
    ``host`` and advertised in the registry; with none, on ``host`` when that is
    loopback, else on 127.0.0.1 only, unadvertised (``cluster/metrics_auth.py``).
    """

    role: str
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 0
    kv_host: str = "127.0.0.1"
    kv_port: int = 0
    advertise_host: str | None = None
    redis_url: str | None = None
    worker_id: str = ""
    lease_s: float = 30.0
    kv_transfer_timeout_s: float = 30.0
    heartbeat_ttl_s: float = 3.0
    drain_grace_s: float = 30.0
    kv_connect_timeout_s: float = 5.0
    kv_alloc_timeout_s: float = 30.0
    metrics_port: int | None = 0
    metrics_auth: MetricsAuth = field(default_factory=MetricsAuth, repr=False)
    auth: ClusterAuth | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role={self.role!r} must be one of {ROLES}")
        if self.lease_s <= 0:
            raise ValueError(f"lease_s={self.lease_s} must be > 0")
        for name in ("kv_connect_timeout_s", "kv_transfer_timeout_s", "kv_alloc_timeout_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name}={getattr(self, name)} must be a positive number "
                                 "of seconds")
        if self.engine.tensor_parallel_size > 1 and (
                self.engine.kv_cache_dtype != "auto" or self.engine.device.startswith("cuda")):
            # NOTE: KVShards gathers and scatters float heads through shared memory
            raise ValueError(
                f"tensor_parallel_size={self.engine.tensor_parallel_size} on a {self.role} "
                f"worker with kv_cache_dtype={self.engine.kv_cache_dtype!r} on device="
                f"{self.engine.device!r}: KV transfer between tensor-parallel workers runs "
                "on the CPU with kv_cache_dtype 'auto' only, so far")
        if not self.worker_id:
            self.worker_id = default_worker_id(self.role)

    @property
    def kv_key(self) -> bytes:
        """The KV path's key (``ClusterAuth.kv_key``); a worker built in-process without
        ``auth`` (no authentication anywhere) uses a well-known one."""
        if self.auth is None:
            from pdserve.kvtransfer.auth import UNAUTHENTICATED_KV_KEY

            return UNAUTHENTICATED_KV_KEY
        return self.auth.kv_key


def worker_default(name: str):
    """The default of ``WorkerConfig``'s field ``name``: the one default of its flag here
    and in ``pdserve serve`` (``--kv-lease-s``: ``lease_s``)."""
    return next(f.default for f in fields(WorkerConfig) if f.name == name)


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``python -m pdserve.{prefill,decode}_worker`` beyond the engine's."""
    d = worker_default
    parser.add_argument("--host", default=d("host"), help="gRPC listen address")
    parser.add_argument("--port", type=int, default=d("port"), help="gRPC port (0: a free one)")
    # NOTE: not kv_host's default: None is --advertise-host, else --host
    # (worker_config_from_args)
    parser.add_argument("--kv-host", default=None,
                        help="address of the KV transfer channel (default: --host)")
    parser.add_argument("--kv-port", type=int, default=d("kv_port"),
                        help="KV store port (decode workers)")
    parser.add_argument("--advertise-host", default=None,
                        help="address other machines reach this worker's gRPC at, when "
                        "--host is a wildcard like 0.0.0.0 (default: --host)")
    parser.add_argument("--metrics-port", type=int, default=d("metrics_port"),
                        help="port of this worker's Prometheus /metrics on --host (0: a free "
                        "one, advertised in the registry for the router's service discovery)")
    parser.add_argument("--redis-url", help="Redis of the worker registry and prefix index")
    parser.add_argument("--worker-id", default=d("worker_id"),
                        help="registry id (default: generated)")
    parser.add_argument("--kv-lease-s", type=float, default=d("lease_s"),
                        help="seconds prefilled KV stays pinned waiting for its decode worker")
    parser.add_argument("--kv-transfer-timeout-s", type=float,
                        default=d("kv_transfer_timeout_s"),
                        help="seconds one KV transfer (a decode worker's pull, a prefill "
                        "worker's send) may take; past it the pull fails and the router "
                        "resumes the request without that KV")
    parser.add_argument("--kv-connect-timeout-s", type=float,
                        default=d("kv_connect_timeout_s"),
                        help="seconds to reach a peer's KV store and set up a pair channel")
    parser.add_argument("--kv-alloc-timeout-s", type=float, default=d("kv_alloc_timeout_s"),
                        help="decode workers: seconds a request with prefilled KV may wait "
                        "for free KV blocks before it is refused (the router tries another "
                        "decode worker)")
    parser.add_argument("--drain-grace-s", type=float, default=d("drain_grace_s"),
                        help="on SIGTERM: seconds running requests and KV leases get to end "
                        "before the worker stops (the router migrates the rest)")
    add_cluster_auth_args(parser)
    add_metrics_auth_args(parser, cli_key=False)  # NOTE: secrets never on a worker's argv


def worker_config_from_args(role: str, args: argparse.Namespace) -> WorkerConfig:
    """A ``WorkerConfig`` from parsed engine and worker flags.

    Raises:
        ValueError: an unusable metrics key (``metrics_auth_from_args``), cluster secret
            or setting.
    """
    from pdserve.engine.args import engine_kwargs

    auth = cluster_auth_from_args(args)
    redis_url = args.redis_url and redis_url_with_password(args.redis_url,
                                                           redis_password_from_args(args))
    return WorkerConfig(
        role=role, engine=EngineConfig(**engine_kwargs(args)), host=args.host, port=args.port,
        kv_host=args.kv_host or args.advertise_host or args.host, kv_port=args.kv_port,
        advertise_host=args.advertise_host, redis_url=redis_url,
        worker_id=args.worker_id, lease_s=args.kv_lease_s,
        kv_transfer_timeout_s=args.kv_transfer_timeout_s, drain_grace_s=args.drain_grace_s,
        kv_connect_timeout_s=args.kv_connect_timeout_s,
        kv_alloc_timeout_s=args.kv_alloc_timeout_s, metrics_port=args.metrics_port,
        metrics_auth=metrics_auth_from_args(args), auth=auth)
