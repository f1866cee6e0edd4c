"""``python -m pdserve.router``: the OpenAI-compatible router as a plain process.

Finds the workers through Redis (``--redis-url``) and serves HTTP with uvicorn until
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
import logging
import sys

from pdserve.cluster.auth import (
    add_cluster_auth_args,
    cluster_auth_from_args,
    redis_password_from_args,
    redis_url_with_password,
)
from pdserve.engine.hub import resolve_model, resolve_tokenizer
from pdserve.kernels.kv_quant import KV_CACHE_DTYPE_NAMES
from pdserve.router.flags import (
    add_api_auth_args,
    add_http_args,
    add_lifecycle_args,
    admin_auth_from_args,
    api_auth_from_args,
    http_timeouts_from_args,
    lifecycle_kwargs,
    log_exposure,
)
from pdserve.router.http import build_app
from pdserve.router.http_server import serve_app
from pdserve.router.service import DEFAULT_LOCAL_PREFILL_THRESHOLD, Router, RouterConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The router's flags (vLLM's names where vLLM has one)."""
    parser = argparse.ArgumentParser(prog="python -m pdserve.router", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", required=True,
                        help="Redis of the worker registry and prefix index")
    parser.add_argument("--model", required=True,
                        help="the workers' model, for its tokenizer and configuration: a "
                             "checkpoint folder, a .gguf file, or a hub id (from the "
                             "Hugging Face cache, downloaded when missing)")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="model name(s) in the API; the first also in block hashes "
                             "(default: --model); must match the workers'")
    parser.add_argument("--tokenizer", help="tokenizer folder, .gguf file or hub id "
                        "(default: --model's); must match the workers'")
    parser.add_argument("--revision", help="the hub id's branch, tag or commit")
    parser.add_argument("--download-dir", help="Hugging Face cache (default: $HF_HOME/hub)")
    parser.add_argument("--chat-template", help="a Jinja chat template, or a file holding one")
    parser.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                        help="sampling defaults for requests that leave them unset")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--block-size", type=int, default=16,
                        help="tokens per KV block; must match the workers'")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_NAMES,
                        help="the workers' --kv-cache-dtype; part of the block hashes the "
                        "prefix index holds, so it must match the workers'")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt + completion, tokens (default: the model's)")
    parser.add_argument("--local-prefill-threshold", type=int,
                        default=DEFAULT_LOCAL_PREFILL_THRESHOLD,
                        help="prompts shorter than this many tokens are prefilled on the "
                             "decode worker (0: never; default: one block)")
    add_lifecycle_args(parser)
    add_http_args(parser)
    add_api_auth_args(parser)
    add_cluster_auth_args(parser)
    parser.add_argument("--log-level", default="info")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Run the router until interrupted."""
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
        model = resolve_model(args.model, revision=args.revision,
                              download_dir=args.download_dir)
        tokenizer = args.tokenizer and resolve_tokenizer(args.tokenizer,
                                                         download_dir=args.download_dir)
    except (ValueError, FileNotFoundError) as exc:
        print(f"python -m pdserve.router: error: {exc}", file=sys.stderr)
        sys.exit(2)
    names = args.served_model_name or [args.model]
    router = Router(RouterConfig(
        model=model, redis_url=redis_url, served_model_name=names[0],
        served_model_aliases=tuple(names[1:]), tokenizer=tokenizer,
        chat_template=args.chat_template, generation_config=args.generation_config,
        block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.max_model_len,
        local_prefill_threshold=args.local_prefill_threshold, auth=auth, **router_kwargs))
    log_exposure(args.host, api_auth, admin_auth, f"{args.port} (HTTP)")
    serve_app(build_app(router, api_auth=api_auth, admin_auth=admin_auth,
                        http_timeouts=http_timeouts),
              host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
