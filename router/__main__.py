"""``python -m pdserve.router``: the OpenAI-compatible router as a plain process.

Finds the workers through Redis (``--redis-url``) and serves HTTP with uvicorn until
SIGINT or SIGTERM. Example::

    python -m pdserve.router --redis-url redis://127.0.0.1:6379/0 --model /path/to/model \\
        --port 8000
"""

from __future__ import annotations

import argparse
import logging

import uvicorn

from pdserve.router.http import build_app
from pdserve.router.service import DEFAULT_LOCAL_PREFILL_THRESHOLD, Router, RouterConfig


def add_lifecycle_args(parser: argparse.ArgumentParser) -> None:
    """Admission control and migration flags (README, Operating pdserve); shared by
    ``pdserve serve``. Defaults are ``RouterConfig``'s."""
    defaults = RouterConfig(model="", redis_url="")
    parser.add_argument("--migration-limit", type=int, default=defaults.migration_limit,
                        help="attempts after the first a request may make when a worker "
                             "fails (retries, and migrations of running streams)")
    parser.add_argument("--max-waiting-requests", type=int,
                        default=defaults.max_waiting_requests,
                        help="admitted requests without their first token; past it: 503")
    parser.add_argument("--prefill-max-inflight", type=int,
                        default=defaults.prefill_max_inflight,
                        help="Prefill calls in flight per prefill worker from this router")
    parser.add_argument("--decode-max-inflight", type=int,
                        default=defaults.decode_max_inflight,
                        help="streams in flight per decode worker from this router")
    parser.add_argument("--decode-max-kv-usage", type=float,
                        default=defaults.decode_max_kv_usage,
                        help="decode workers whose KV cache usage (0-1) is at or past this "
                             "get no new request")


def lifecycle_kwargs(args: argparse.Namespace) -> dict:
    """``RouterConfig`` keyword arguments from ``add_lifecycle_args``'s flags."""
    return {name: getattr(args, name) for name in (
        "migration_limit", "max_waiting_requests", "prefill_max_inflight",
        "decode_max_inflight", "decode_max_kv_usage")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The router's flags (vLLM's names where vLLM has one)."""
    parser = argparse.ArgumentParser(prog="python -m pdserve.router", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", required=True,
                        help="Redis of the worker registry and prefix index")
    parser.add_argument("--model", required=True, help="checkpoint folder (for the tokenizer)")
    parser.add_argument("--served-model-name", default=None,
                        help="model name in the API and in block hashes (default: --model); "
                             "must match the workers'")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--block-size", type=int, default=16,
                        help="tokens per KV block; must match the workers'")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt + completion, tokens (default: the model's)")
    parser.add_argument("--local-prefill-threshold", type=int,
                        default=DEFAULT_LOCAL_PREFILL_THRESHOLD,
                        help="prompts shorter than this many tokens are prefilled on the "
                             "decode worker (0: never; default: one block)")
    add_lifecycle_args(parser)
    parser.add_argument("--log-level", default="info")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Run the router until interrupted."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    router = Router(RouterConfig(
        model=args.model, redis_url=args.redis_url, served_model_name=args.served_model_name,
        block_size=args.block_size, max_model_len=args.max_model_len,
        local_prefill_threshold=args.local_prefill_threshold, **lifecycle_kwargs(args)))
    uvicorn.run(build_app(router), host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
