"""``pdserve serve``: the whole cluster from one command (docs/architecture.md, Launch).

Start-up runs in phases, each printing one line (``pdserve: ...``) once done:

1. the router's ports: ``--host:--port`` (HTTP) is bound and listening, and held until
   uvicorn takes the socket; ``--grpc-port`` is held the same way until the gRPC server
   binds it (it cannot take a socket). A port that is taken ends the command at once,
   status 2, before anything is started;
2. the model: a hub id is downloaded into the Hugging Face cache (or found there), once
   for this node, so the workers get its local folder; then the model is checked as
   pdserve computes it (``engine/model_resolution.py``), its weights unread. A model
   pdserve cannot serve exactly ends the command here, status 2, naming the field;
3. Redis: ``--redis-url``, or a private ``redis-server`` (entrypoints/redis_server.py);
4. Ray: joins ``--ray-address`` or starts a local one, bound to 127.0.0.1 unless
   ``--host`` or ``--worker-host`` names another address (entrypoints/launcher.py);
5. the C++ CPU kernels, when the workers run on the CPU and no build is cached: built once
   here, so the workers load the build instead of each compiling it;
6. the ``--prefill-workers`` and ``--decode-workers`` Ray actors, all at once, each
   reported as it becomes ready;
7. the OpenAI-compatible router: ``pdserve serving ...`` is printed once it accepts
   connections.

SIGINT or SIGTERM during start-up stops everything started so far and exits with
128 + the signal number (``pdserve: start-up interrupted ...`` on stderr); after
``serving`` they stop everything and print ``pdserve stopped``. Every child pdserve starts
(Redis, the kernel build, Ray's processes) is out of reach of a terminal's Ctrl-C, which
signals the whole foreground process group: pdserve alone decides when they stop.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Self

from pdserve.cluster import event_loop
from pdserve.cluster.auth import (
    cluster_auth_from_args,
    redact_url,
    redis_password_from_args,
    redis_url_with_password,
)
from pdserve.cluster.metrics_auth import metrics_auth_from_args
from pdserve.entrypoints.serve_models import (
    DEMO_MODEL_NAME,
    ModelSpec,
    models_from_config,
    pool_engine_config,
    pool_flags,
    refuse_repeated,
)
from pdserve.router.serving import bind_listener, run_router

logger = logging.getLogger(__name__)
WORKER_STOP_TIMEOUT_S = 30.0  # the workers' graceful stop, all together, after serving
KERNEL_BUILD_TIMEOUT_S = 1800.0
_BUILD_KERNELS = "from pdserve.kernels import cpu_ext; cpu_ext.main()"


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    from pdserve.cluster.auth import add_cluster_auth_args
    from pdserve.cluster.metrics_auth import add_metrics_auth_args
    from pdserve.cluster.worker_config import worker_default as d
    from pdserve.router.flags import add_listen_args, add_router_args

    add_listen_args(parser)
    parser.add_argument("--ray-address", default=None,
                        help="join this Ray cluster ('auto' for the local head); "
                             "default: start a local one, on 127.0.0.1 only unless --host "
                             "or --worker-host is another address")
    parser.add_argument("--ray-dashboard", action="store_true",
                        help="start the local Ray's dashboard (on 127.0.0.1:8265)")
    parser.add_argument("--prefill-workers", type=int, default=1)
    parser.add_argument("--decode-workers", type=int, default=1)
    parser.add_argument("--models-config", default=None, metavar="FILE",
                        help="serve several models, each with its own prefill and decode "
                             "pools: a YAML or JSON file listing them (README, Several "
                             "models); instead of --model and --served-model-name")
    parser.add_argument("--redis-url", default=None,
                        help="Redis for the registry and prefix index (default: start a "
                             "private redis-server on a free loopback port)")
    parser.add_argument("--worker-host", default=d("host"),
                        help="address workers bind for gRPC and KV transfer")
    parser.add_argument("--kv-lease-s", type=float, default=d("lease_s"),
                        help="seconds prefilled KV stays pinned waiting for its decode worker")
    parser.add_argument("--kv-transfer-timeout-s", type=float,
                        default=d("kv_transfer_timeout_s"),
                        help="seconds one KV transfer (pull and send) may take; past it the "
                        "request is resumed without that KV")
    parser.add_argument("--kv-connect-timeout-s", type=float,
                        default=d("kv_connect_timeout_s"),
                        help="seconds to reach a peer's KV store and set up a pair channel")
    parser.add_argument("--kv-alloc-timeout-s", type=float, default=d("kv_alloc_timeout_s"),
                        help="seconds a request with prefilled KV may wait for free blocks "
                        "on its decode worker before it tries another")
    parser.add_argument("--drain-grace-s", type=float, default=d("drain_grace_s"),
                        help="seconds a worker that `pdserve scale` removes gives its "
                        "requests and KV leases to end (the rest migrate)")
    parser.add_argument("--prefill-engine-args", default="", metavar="FLAGS",
                        help="engine flags for the prefill pool only, over the shared ones, "
                        "e.g. '--max-num-batched-tokens 4096'")
    parser.add_argument("--decode-engine-args", default="", metavar="FLAGS",
                        help="engine flags for the decode pool only, e.g. '--max-num-seqs 512'")
    for role in ("prefill", "decode"):
        parser.add_argument(f"--{role}-tensor-parallel-size", type=int, metavar="N",
                            help=f"ranks each {role} worker splits the model over (default: "
                            "--tensor-parallel-size); the pools may differ")
    add_planner_args(parser)
    refuse_repeated(parser, ("--model", "--served-model-name"))
    add_router_args(parser)
    add_cluster_auth_args(parser, generated=True)
    add_metrics_auth_args(parser)


def add_planner_args(parser: argparse.ArgumentParser) -> None:
    """``--autoscale`` and the SLO planner's flags; each default is ``PlannerConfig``'s
    field, declared there once."""
    from pdserve.entrypoints.planner import PlannerConfig

    d = PlannerConfig()
    planner = parser.add_argument_group("SLO planner (--autoscale)")
    planner.add_argument("--autoscale", action="store_true",
                         help="size the pools from TTFT, TPOT, ITL, queues and KV usage "
                         "(entrypoints/planner.py)")
    planner.add_argument("--ttft-target-s", type=float, default=d.ttft_target_s,
                         help="p90 TTFT target, seconds (default: %(default)s)")
    planner.add_argument("--tpot-target-s", type=float, default=d.tpot_target_s,
                         help="p90 TPOT target, seconds (default: %(default)s)")
    planner.add_argument("--itl-target-s", type=float, default=d.itl_target_s,
                         help="p90 inter-token latency target, seconds, as Dynamo's "
                         "planner's ITL; a breach adds decode workers (default: none)")
    planner.add_argument("--min-prefill-workers", type=int, default=d.min_workers["prefill"],
                         help="the prefill pool's minimum (default: %(default)s)")
    planner.add_argument("--max-prefill-workers", type=int, default=d.max_workers["prefill"],
                         help="the prefill pool's maximum (default: %(default)s)")
    planner.add_argument("--min-decode-workers", type=int, default=d.min_workers["decode"],
                         help="the decode pool's minimum (default: %(default)s)")
    planner.add_argument("--max-decode-workers", type=int, default=d.max_workers["decode"],
                         help="the decode pool's maximum (default: %(default)s)")
    planner.add_argument("--planner-interval-s", type=float, default=d.interval_s,
                         help="seconds between two decisions (default: %(default)s)")
    planner.add_argument("--planner-cooldown-s", type=float, default=d.cooldown_s,
                         help="seconds after a resize before the next (default: "
                         "%(default)s)")


class Interrupts:
    """While entered, SIGINT and SIGTERM raise KeyboardInterrupt in the main thread (the
    first one's number is kept in ``signum``); on exit the previous handlers return.

    ``deferred()`` holds the first signal back until a short step that must not be cut in
    half (start a child and register its stop) is done; a second one raises at once.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._deferring = False
        self._pending = False

    def __enter__(self) -> Self:
        self.install()
        return self

    def __exit__(self, *exc_info) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def install(self) -> None:
        """(Re)install the handlers: ``ray.init`` replaces the SIGTERM one."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)

    @contextlib.contextmanager
    def deferred(self):
        self._deferring = True
        try:
            yield
        finally:
            self._deferring, pending, self._pending = False, self._pending, False
        if pending:
            raise KeyboardInterrupt

    def _handle(self, signum: int, frame) -> None:
        if self.signum is None:
            self.signum = signum
        if self._deferring and not self._pending:
            self._pending = True
            return
        raise KeyboardInterrupt


def say(line: str) -> None:
    """One start-up phase line on stdout."""
    print(f"pdserve: {line}", flush=True)


def cmd_serve(args: argparse.Namespace) -> int:
    """Run ``pdserve serve`` until SIGINT/SIGTERM; returns the exit status (0 once it
    served, 128 + the signal's number when a signal ended start-up).

    Raises:
        StartupError: a router port is taken (nothing was started).
        ValueError: bad worker counts.
        RuntimeError: a worker or Redis failed to start (all started so far is stopped).
    """
    if args.prefill_workers < 0 or args.decode_workers < 1:
        raise ValueError("--decode-workers must be >= 1 and --prefill-workers >= 0")
    with Interrupts() as interrupts:
        run = _ServeRun(args, interrupts)
        try:
            with contextlib.ExitStack() as stack:
                run.run(stack)
        except KeyboardInterrupt:
            pass  # NOTE: a signal; the stack has stopped everything
    if run.announced:
        print("pdserve stopped", flush=True)
        return 0
    name = signal.Signals(interrupts.signum or signal.SIGINT).name
    print(f"pdserve: start-up interrupted by {name}; stopped everything it had started",
          file=sys.stderr, flush=True)
    return 128 + (interrupts.signum or signal.SIGINT)


class _ServeRun:
    """One run of ``pdserve serve``: each phase starts one thing and, in the same step,
    registers how to stop it on the run's ``ExitStack``, which stops all in reverse."""

    def __init__(self, args: argparse.Namespace, interrupts: Interrupts) -> None:
        """Raises ValueError for unusable API keys or cluster credentials, before anything
        starts."""
        from pdserve.router.flags import admin_auth_from_args, api_auth_from_args

        self.args = args
        self.interrupts = interrupts
        self.api_auth = api_auth_from_args(args)
        self.admin_auth = admin_auth_from_args(args, self.api_auth)
        self.metrics_auth = metrics_auth_from_args(  # the workers' /metrics
            args, self.admin_auth.key_digests,
            self.api_auth.key_digests if self.api_auth else (), args.worker_host)
        self.auth = cluster_auth_from_args(args, generate=True)
        self.announced = False  # "pdserve serving" printed
        from pdserve.engine.engine_config import EngineConfig

        for role in ("prefill", "decode"):  # NOTE: a bad flag stops us before anything starts
            pool_engine_config(EngineConfig("<model>"), pool_flags(args, role), role)
        from pdserve.entrypoints.planner import planner_config_from_args

        self.planner_config = planner_config_from_args(args) if args.autoscale else None
        from pdserve.router.flags import (
            grpc_limits_from_args,
            http_timeouts_from_args,
            lifecycle_kwargs,
        )

        lifecycle_kwargs(args)  # NOTE: checks the router's flags before anything starts
        self.http_timeouts = http_timeouts_from_args(args)
        self.grpc_limits = grpc_limits_from_args(args)
        self.models = self._models()

    def _models(self) -> list[ModelSpec]:
        """The models to serve: ``--models-config``'s, or the command line's one.

        Raises:
            ValueError: a bad ``--models-config``, or one beside ``--model`` or
                ``--served-model-name``.
        """
        from pdserve.engine.args import served_model_aliases

        engine = self._engine_config()
        if self.args.models_config is None:
            return [ModelSpec(engine, self.args.prefill_workers, self.args.decode_workers,
                              served_model_aliases(self.args), demo=self.args.model is None)]
        for flag in ("model", "served_model_name"):
            if getattr(self.args, flag) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} and --models-config exclude "
                                 "each other: name every model in the file")
        return models_from_config(self.args.models_config, engine, self.args)

    def run(self, stack: contextlib.ExitStack) -> None:
        args = self.args
        http_sock = stack.enter_context(bind_listener(args.host, args.port, "router HTTP, --port"))
        grpc_sock = None
        if args.grpc_port:
            grpc_sock = stack.enter_context(
                bind_listener(args.host, args.grpc_port, "router gRPC, --grpc-port"))
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        from pdserve.router.flags import log_exposure

        ports = f"{args.port} (HTTP)" + (f", {args.grpc_port} (gRPC)" if args.grpc_port else "")
        log_exposure(args.host, self.api_auth, self.admin_auth, ports)
        self._resolve_models()
        redis_url = self._start_redis(stack)
        launcher = self._start_ray(stack)
        auth = self._cluster_tls(launcher)
        self._prepare_models(launcher)
        if any(self._workers_on_cpu(spec.engine, launcher) for spec in self.models):
            build_cpu_kernels(self.interrupts)
        # NOTE: every model's workers share the node's cores
        computing = sum(computing_workers(
            {"prefill": spec.prefill_workers, "decode": spec.decode_workers},
            args.disaggregation, launcher.has_gpus) for spec in self.models)
        routers, scalers, background = [], {}, []
        for spec in self.models:
            scaler = self._start_workers(launcher, spec, redis_url, auth, computing)
            router, tasks = self._make_router(spec, redis_url, auth, scaler)
            routers.append(router)
            scalers[spec.name] = scaler
            background += tasks
        from pdserve.router.http import build_app
        from pdserve.router.served_models import ServedModels

        app = build_app(routers, api_auth=self.api_auth, admin_auth=self.admin_auth,
                        scaler=scalers,
                        background=background, http_timeouts=self.http_timeouts)
        try:
            event_loop.run(run_router(ServedModels(routers), app, args.host, http_sock,
                                      grpc_sock, f"(Redis {redact_url(redis_url)})",
                                      self._on_serving, grpc_limits=self.grpc_limits))
        except KeyboardInterrupt:
            if not self.announced:
                raise

    def _resolve_models(self) -> None:
        """Phase 2: every model's hub ids as local paths (downloaded at most once, here),
        its chat template read, and the model checked, before any worker starts.

        Raises:
            FileNotFoundError: no such model or tokenizer (local, cached or on the hub).
            ValueError: a model pdserve does not compute exactly (UnsupportedModelError,
                naming the field), or a bad --generation-config / --chat-template.
        """
        from pdserve.engine.model_resolution import check_model, resolve_model_paths
        from pdserve.engine.tokenizer import read_chat_template

        self.asked_models = [spec.engine.model for spec in self.models]
        for spec in self.models:
            asked = spec.engine.model
            engine = resolve_model_paths(spec.engine)
            engine.chat_template = read_chat_template(engine.chat_template)
            check_model(engine)
            spec.engine = engine
            where = "" if engine.model == asked else f" (hub id {asked}, revision " \
                f"{engine.revision or 'main'})"
            say(f"model {spec.name or asked}: {engine.model}{where}")

    def _prepare_models(self, launcher) -> None:
        """Phase 4: every model local on every Ray node (a hub id downloaded once per
        node), before any worker starts.

        Raises: as ``RayLauncher.prepare_model``.
        """
        for spec, asked in zip(self.models, self.asked_models):
            engine = spec.engine
            nodes = launcher.prepare_model(asked, engine.model, revision=engine.revision,
                                           download_dir=engine.download_dir,
                                           demo=spec.demo)
            if nodes > 1:
                say(f"model {spec.name}: on all {nodes} Ray nodes")

    def _on_serving(self) -> None:
        self.announced = True

    def _engine_config(self):
        from pdserve.engine.args import engine_kwargs
        from pdserve.engine.engine_config import EngineConfig

        engine = EngineConfig(**engine_kwargs(self.args), load_progress=False)
        if self.args.model is None and self.args.served_model_name is None:
            engine.served_model_name = DEMO_MODEL_NAME
        return engine

    def _start_redis(self, stack: contextlib.ExitStack) -> str:
        """The Redis URL, with its password: ``--redis-url`` (and ``--redis-password-file``
        or ``$PDSERVE_REDIS_PASSWORD``), else a private server with a new random one."""
        from pdserve.entrypoints.redis_server import RedisServer

        if self.args.redis_url:
            url = redis_url_with_password(self.args.redis_url,
                                          redis_password_from_args(self.args))
            say(f"Redis at {redact_url(url)} (--redis-url)")
            return url
        with self.interrupts.deferred():
            redis = stack.enter_context(RedisServer())
        say(f"Redis at {redis.display_url} (private redis-server, with a password)")
        return redis.url

    def _start_ray(self, stack: contextlib.ExitStack):
        from pdserve.entrypoints.launcher import RayLauncher, node_ip_for

        args = self.args
        node_ip = node_ip_for(args.worker_host, args.host)
        stack.callback(_ray_shutdown)  # NOTE: also stops a Ray whose ray.init was cut short
        try:
            launcher = RayLauncher(args.ray_address, node_ip=node_ip,
                                   dashboard=args.ray_dashboard)
        except SystemExit as exc:  # NOTE: ray.init's own SIGTERM handler exits
            if exc.code != signal.SIGTERM:
                raise
            self.interrupts.signum = self.interrupts.signum or signal.SIGTERM
            raise KeyboardInterrupt from None
        stack.callback(lambda: launcher.shutdown(
            WORKER_STOP_TIMEOUT_S if self.announced else 0.0))
        self.interrupts.install()  # NOTE: ray.init installs its own SIGTERM handler
        where = (f"joined {args.ray_address}" if args.ray_address
                 else f"started locally on {launcher.node_ip()}")
        say(f"Ray {where} ({'GPU' if launcher.has_gpus else 'CPU'} workers)")
        return launcher

    def _cluster_tls(self, launcher):
        """Phase 3b, ``--cluster-tls auto``: a new cluster CA, in this process only; the
        router's own certificate (naming this node's address), and the launcher issues
        each worker its own as it starts it. Returns the router's ``ClusterAuth``."""
        if self.args.cluster_tls != "auto":
            return self.auth
        from pdserve.cluster.certificates import ClusterCA
        from pdserve.entrypoints.launcher import _WILDCARDS

        ca = ClusterCA.generate()
        launcher.certificate_authority = ca
        host = self.args.host if self.args.host not in _WILDCARDS else launcher.node_ip()
        self.auth = self.auth.with_tls(ca.issue("router", [host]))
        say("mutual TLS between the router and workers: a cluster CA made for this run, a "
            "certificate per member (--cluster-tls auto)")
        return self.auth

    def _workers_on_cpu(self, engine, launcher) -> bool:
        return engine.device == "cpu" or (engine.device == "auto" and not launcher.has_gpus)

    def _start_workers(self, launcher, spec: ModelSpec, redis_url: str, auth,
                       computing: int):
        """Start the pools of model ``spec`` (``computing``: the workers of every model
        that compute at once on a node, to split its cores); returns the ``PoolScaler``
        that owns them from now on."""
        from pdserve.cluster.worker_config import WorkerConfig
        from pdserve.entrypoints.scaling import PoolScaler, split_roles

        args = self.args
        common = {"redis_url": redis_url, "host": args.worker_host,
                  "kv_host": args.worker_host, "lease_s": args.kv_lease_s,
                  "kv_transfer_timeout_s": args.kv_transfer_timeout_s,
                  "kv_connect_timeout_s": args.kv_connect_timeout_s,
                  "kv_alloc_timeout_s": args.kv_alloc_timeout_s,
                  "drain_grace_s": args.drain_grace_s, "auth": auth,
                  "metrics_auth": self.metrics_auth}
        configs = {role: WorkerConfig(role, engine=pool_engine_config(
                       spec.engine, pool_flags(args, role), role), **common)
                   for role in ("prefill", "decode")}
        counts = {"prefill": spec.prefill_workers, "decode": spec.decode_workers}
        model = f"{spec.name}: " if len(self.models) > 1 else ""
        say(f"{model}starting {counts['prefill']} prefill and {counts['decode']} decode "
            "workers")
        if counts["prefill"] and computing_workers(
                counts, args.disaggregation, launcher.has_gpus) == counts["decode"]:
            say("the prefill workers share this node's CPUs with the decode workers: with "
                "--disaggregation auto, prompts are prefilled on the decode workers "
                "(pdserve:prefill_path counts each choice)")
        actors = []
        for role, count in counts.items():
            if count:
                actors += launcher.start(configs[role], count, workers_on_node=computing)
        ready = dict.fromkeys(counts, 0)

        def report(info) -> None:
            ready[info.role] += 1
            say(f"{model}{info.role} worker {ready[info.role]}/{counts[info.role]} ready "
                f"(gRPC {info.grpc_address}, KV {info.kv_address}, metrics "
                f"{info.metrics_address or 'none'}, id {info.worker_id}, node "
                f"{info.node_id[:12]})")

        infos = launcher.wait_ready(actors, on_ready=report)
        scaler = PoolScaler(launcher, configs, computing, args.drain_grace_s, split=split_roles(
            args.disaggregation, launcher.has_gpus, len(self.models)))
        for actor, info in zip(actors, infos):
            scaler.adopt(info.role, actor, info.worker_id)
        return scaler

    def _make_router(self, spec: ModelSpec, redis_url: str, auth, scaler=None):
        """The router of model ``spec`` and its background tasks (the SLO planner of
        its pools with ``--autoscale``)."""
        from pdserve.router.config import RouterConfig
        from pdserve.router.flags import lifecycle_kwargs
        from pdserve.router.model_service import ModelService

        engine = spec.engine
        config = RouterConfig(
            model=engine.model, redis_url=redis_url,
            served_model_name=engine.served_model_name, served_model_aliases=spec.aliases,
            tokenizer=engine.tokenizer, chat_template=engine.chat_template,
            generation_config=engine.generation_config, block_size=engine.block_size,
            kv_cache_dtype=engine.kv_cache_dtype, max_model_len=engine.max_model_len,
            auth=auth, **lifecycle_kwargs(self.args))
        if spec.prefill_workers == 0:
            config.local_prefill_threshold = engine.max_model_len or 1 << 30
        router = ModelService(config)
        background = []
        if scaler is not None:
            scaler.on_change = router.pool.workers_changed
            if self.args.autoscale:
                from pdserve.entrypoints.planner import SLOPlanner

                planner = SLOPlanner(self.planner_config, router, scaler)
                background.append(planner.run)
        return router, background


def computing_workers(counts: dict[str, int], disaggregation: str, has_gpus: bool) -> int:
    """How many of the workers that ``pdserve serve`` starts on its node compute at once,
    to split the node's cores between them (``counts``: workers per role). They share the
    node's CPUs, so with ``--disaggregation auto`` the router prefills on the decode
    workers (a remote prefill would take the same cores): only those compute. With
    ``always``, or on GPUs (one each), every worker does."""
    if disaggregation == "always" or has_gpus:
        return sum(counts.values())
    return max(1, counts["decode"])


def _ray_shutdown() -> None:
    ray = sys.modules.get("ray")  # NOTE: not imported here: the launcher imports it first
    if ray is not None:
        ray.shutdown()


def build_cpu_kernels(interrupts: Interrupts) -> None:
    """Build the C++ CPU kernels (``pdserve.kernels.cpu_ext``) in a child process unless
    they are off (``PDSERVE_CPU_KERNELS=0``) or already built for this machine.

    The child runs in its own session; on an interrupt it and its compilers get SIGINT
    (so torch releases its build lock) and then, after 10 s, SIGKILL. A failed build is
    only reported: the workers then use the PyTorch references.
    """
    from pdserve.kernels import cpu_ext

    if not cpu_ext.enabled() or cpu_ext.is_built():
        return
    say("building CPU kernels (first start only, about a minute)")
    start = time.monotonic()
    proc = None
    try:
        with interrupts.deferred():
            proc = subprocess.Popen([sys.executable, "-c", _BUILD_KERNELS],
                                    start_new_session=True)
        status = proc.wait(KERNEL_BUILD_TIMEOUT_S)
    finally:
        if proc is not None:
            _stop_group(proc)
    if status == 0:
        say(f"CPU kernels built in {time.monotonic() - start:.0f} s")
    else:
        say("CPU kernels unavailable (see the warning above); workers use the PyTorch "
            "references")


def _stop_group(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGINT, then SIGKILL, to the process group that ``proc`` leads, unless it is done."""
    if proc.poll() is not None:
        return
    for sig in (signal.SIGINT, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout_s)
            return
