"""``pdserve serve``: the whole cluster from one command (DESIGN.md, Launch).

Starts (or joins, ``--ray-address``) a Ray cluster, a private Redis unless ``--redis-url``
names one, ``--prefill-workers`` and ``--decode-workers`` as Ray actors, and the
OpenAI-compatible router on ``--host:--port``. With no ``--model`` it serves the demo
model, written on first use. Ctrl-C stops everything it started.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

logger = logging.getLogger(__name__)
DEMO_MODEL_NAME = "pdserve-demo"  # the API's model name when serving the demo model


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="router HTTP address")
    parser.add_argument("--port", type=int, default=8000, help="router HTTP port")
    parser.add_argument("--grpc-port", type=int, default=50050,
                        help="router gRPC port (pdserve.v1.Router; 0: none)")
    parser.add_argument("--ray-address", default=None,
                        help="join this Ray cluster ('auto' for the local head); "
                             "default: start a local one")
    parser.add_argument("--prefill-workers", type=int, default=1)
    parser.add_argument("--decode-workers", type=int, default=1)
    parser.add_argument("--redis-url", default=None,
                        help="Redis for the registry and prefix index (default: start a "
                             "private redis-server on a free loopback port)")
    parser.add_argument("--worker-host", default="127.0.0.1",
                        help="address workers bind for gRPC and KV transfer")
    parser.add_argument("--kv-lease-s", type=float, default=30.0)
    parser.add_argument("--local-prefill-threshold", type=int, default=None,
                        help="prompts shorter than this many tokens skip the prefill pool")


async def run_router(router, app, host: str, port: int, grpc_port: int, note: str = "") -> None:
    """Serve ``app`` (HTTP) and, with a ``grpc_port``, the router's gRPC API on one event
    loop until SIGINT/SIGTERM."""
    import uvicorn

    from pdserve.router.grpc_server import start_grpc_server

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    grpc_server = None
    if grpc_port:
        grpc_server, grpc_port = await start_grpc_server(router, host, grpc_port)
    grpc_note = f", gRPC {host}:{grpc_port}" if grpc_server else ""
    print(f"pdserve serving {router.served_model_name} on http://{host}:{port}/v1"
          f"{grpc_note} {note}", flush=True)
    try:
        await server.serve()
    finally:
        if grpc_server is not None:
            await grpc_server.stop(2)


def cmd_serve(args: argparse.Namespace) -> int:
    from pdserve.cluster.cli import engine_kwargs
    from pdserve.cluster.launcher import RayLauncher
    from pdserve.cluster.redis_server import RedisServer
    from pdserve.cluster.worker_config import WorkerConfig
    from pdserve.engine.llm_engine import EngineConfig
    from pdserve.router.http import build_app
    from pdserve.router.service import Router, RouterConfig

    if args.prefill_workers < 0 or args.decode_workers < 1:
        raise ValueError("--decode-workers must be >= 1 and --prefill-workers >= 0")
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = EngineConfig(**engine_kwargs(args), load_progress=False)
    if args.model is None and args.served_model_name is None:
        engine.served_model_name = DEMO_MODEL_NAME
    redis = None if args.redis_url else RedisServer()
    redis_url = args.redis_url or redis.url
    launcher = None
    try:
        launcher = RayLauncher(args.ray_address)
        common = dict(engine=engine, redis_url=redis_url, host=args.worker_host,
                      kv_host=args.worker_host, lease_s=args.kv_lease_s)
        total = args.prefill_workers + args.decode_workers
        workers = []
        if args.prefill_workers:
            workers += launcher.launch(WorkerConfig("prefill", **common), args.prefill_workers,
                                       workers_on_node=total)
        workers += launcher.launch(WorkerConfig("decode", **common), args.decode_workers,
                                   workers_on_node=total)
        for worker in workers:
            print(f"{worker.role} worker {worker.worker_id}: gRPC {worker.grpc_address}",
                  flush=True)
        router_config = RouterConfig(
            model=engine.model, redis_url=redis_url,
            served_model_name=engine.served_model_name, block_size=engine.block_size,
            max_model_len=engine.max_model_len)
        if args.local_prefill_threshold is not None:
            router_config.local_prefill_threshold = args.local_prefill_threshold
        if args.prefill_workers == 0:
            router_config.local_prefill_threshold = engine.max_model_len or 1 << 30
        router = Router(router_config)
        try:
            asyncio.run(run_router(router, build_app(router), args.host, args.port,
                                   args.grpc_port, f"(Redis {redis_url})"))
        except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled
            pass
    finally:
        if launcher is not None:
            launcher.shutdown()
        if redis is not None:
            redis.close()
        print("pdserve stopped", flush=True)
    return 0
