"""``python -m pdserve.router``: the OpenAI-compatible router as a plain process.

Finds the workers through Redis (``--redis-url``) and serves the same HTTP and gRPC APIs
as the router inside ``pdserve serve`` (``--port``, ``--grpc-port``; 0: no gRPC) until
SIGINT or SIGTERM. It needs the cluster secret its workers have (``--cluster-secret-file``
or ``$PDSERVE_CLUSTER_SECRET``). Example, with clients required to send ``Authorization:
Bearer <key>`` for a key in ``keys.txt``, and operators an admin key (``pdserve scale``,
``/metrics/targets``) from ``$PDSERVE_ADMIN_API_KEY``::

    PDSERVE_CLUSTER_SECRET=$(cat secret) PDSERVE_ADMIN_API_KEY=$(cat admin-key) \\
        python -m pdserve.router \\
        --redis-url redis://127.0.0.1:6379/0 --model /path/to/model --port 8000 \\
        --api-key-file keys.txt
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys

from pdserve.cluster import event_loop
from pdserve.cluster.auth import (
    add_cluster_auth_args,
    cluster_auth_from_args,
    redis_password_from_args,
    redis_url_with_password,
)
from pdserve.engine.args import add_engine_args
from pdserve.engine.hub import resolve_model, resolve_tokenizer
from pdserve.router.config import RouterConfig
from pdserve.router.flags import (
    add_listen_args,
    add_router_args,
    admin_auth_from_args,
    api_auth_from_args,
    grpc_limits_from_args,
    http_timeouts_from_args,
    lifecycle_kwargs,
    log_exposure,
)
from pdserve.router.http import build_app
from pdserve.router.model_service import ModelService
from pdserve.router.serving import StartupError, bind_listener, run_router

# the engine flags the router reads too (RouterConfig's model fields), with the engine's
# defaults; help that says more for the router
MODEL_FLAGS = {
    "model": "the workers' model, for its tokenizer and configuration: a checkpoint "
             "folder, a .gguf file, or a hub id (from the Hugging Face cache, downloaded "
             "when missing)",
    "served_model_name": "model name(s) in the API; the first also in block hashes "
                         "(default: --model); must match the workers'",
    "tokenizer": "tokenizer folder, .gguf file or hub id (default: --model's); must match "
                 "the workers'",
    "revision": None, "download_dir": None, "chat_template": None,
    "generation_config": "sampling defaults for requests that leave them unset",
    "block_size": "tokens per KV block; must match the workers'",
    "kv_cache_dtype": "the workers' --kv-cache-dtype; part of the block hashes the prefix "
                      "index holds, so it must match the workers'",
    "max_model_len": "longest prompt + completion, tokens (default: the model's)",
}


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The engine flags of ``MODEL_FLAGS``, as ``engine/args.py`` declares them (one
    default each); ``--model`` is required."""
    engine = argparse.ArgumentParser(add_help=False)
    add_engine_args(engine)
    for action in engine._actions:
        if action.dest in MODEL_FLAGS:
            action = copy.copy(action)
            action.required = action.dest == "model"
            action.help = MODEL_FLAGS[action.dest] or action.help
            parser._add_action(action)


def build_parser() -> argparse.ArgumentParser:
    """The router's flags (vLLM's names where vLLM has one)."""
    parser = argparse.ArgumentParser(prog="python -m pdserve.router", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", required=True,
                        help="Redis of the worker registry and prefix index")
    add_model_args(parser)
    add_listen_args(parser)
    add_router_args(parser)
    add_cluster_auth_args(parser)
    parser.add_argument("--log-level", default="info")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``build_parser()``'s flags in ``argv`` (default: the command line's)."""
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Run the router until interrupted; exit 2 on a bad flag, credential or model, or a
    port that is taken."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        api_auth = api_auth_from_args(args)
        admin_auth = admin_auth_from_args(args, api_auth)
        auth = cluster_auth_from_args(args)  # NOTE: ClusterAuthError is a ValueError
        redis_url = redis_url_with_password(args.redis_url, redis_password_from_args(args))
        router_kwargs = lifecycle_kwargs(args)
        http_timeouts = http_timeouts_from_args(args)
        grpc_limits = grpc_limits_from_args(args)
        model = resolve_model(args.model, revision=args.revision,
                              download_dir=args.download_dir)
        tokenizer = args.tokenizer and resolve_tokenizer(args.tokenizer,
                                                         download_dir=args.download_dir)
        http_sock = bind_listener(args.host, args.port, "router HTTP, --port")
        grpc_sock = args.grpc_port and bind_listener(args.host, args.grpc_port,
                                                     "router gRPC, --grpc-port")
    except (ValueError, FileNotFoundError, StartupError) as exc:
        print(f"python -m pdserve.router: error: {exc}", file=sys.stderr)
        sys.exit(2)
    names = args.served_model_name or [args.model]
    router = ModelService(RouterConfig(
        model=model, redis_url=redis_url, served_model_name=names[0],
        served_model_aliases=tuple(names[1:]), tokenizer=tokenizer,
        chat_template=args.chat_template, generation_config=args.generation_config,
        block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.max_model_len, auth=auth, **router_kwargs))
    ports = f"{args.port} (HTTP)" + (f", {args.grpc_port} (gRPC)" if args.grpc_port else "")
    log_exposure(args.host, api_auth, admin_auth, ports)
    app = build_app(router, api_auth=api_auth, admin_auth=admin_auth,
                    http_timeouts=http_timeouts)
    event_loop.run(run_router(router, app, args.host, http_sock, grpc_sock or None,
                              grpc_limits=grpc_limits, log_level=args.log_level))


if __name__ == "__main__":
    main()
