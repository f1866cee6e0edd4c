"""The router's admission and migration flags (README, Operating pdserve), shared by
``python -m pdserve.router`` and ``pdserve serve``. Light on imports: ``pdserve --help``
reads them without loading the router."""

from __future__ import annotations

import argparse

from pdserve.router.limits import MAX_NUM_SEQUENCES

# NOTE: the defaults admit any one request (at most MAX_NUM_SEQUENCES sequences) on an
# idle cluster of one worker per pool
DEFAULT_MIGRATION_LIMIT = 3
DEFAULT_MAX_WAITING_REQUESTS = 2 * MAX_NUM_SEQUENCES
DEFAULT_PREFILL_MAX_INFLIGHT = MAX_NUM_SEQUENCES
DEFAULT_DECODE_MAX_INFLIGHT = 2 * MAX_NUM_SEQUENCES
DEFAULT_DECODE_MAX_KV_USAGE = 0.98
LIFECYCLE_FIELDS = ("migration_limit", "max_waiting_requests", "prefill_max_inflight",
                    "decode_max_inflight", "decode_max_kv_usage")


def add_lifecycle_args(parser: argparse.ArgumentParser) -> None:
    """Admission control and migration flags (``RouterConfig``'s fields of those names)."""
    parser.add_argument("--migration-limit", type=int, default=DEFAULT_MIGRATION_LIMIT,
                        help="attempts after the first a request may make when a worker "
                             "fails (retries, and migrations of running streams)")
    parser.add_argument("--max-waiting-requests", type=int,
                        default=DEFAULT_MAX_WAITING_REQUESTS,
                        help="admitted sequences without their first token; past it: 503")
    parser.add_argument("--prefill-max-inflight", type=int,
                        default=DEFAULT_PREFILL_MAX_INFLIGHT,
                        help="Prefill calls in flight per prefill worker from this router")
    parser.add_argument("--decode-max-inflight", type=int,
                        default=DEFAULT_DECODE_MAX_INFLIGHT,
                        help="streams in flight per decode worker from this router")
    parser.add_argument("--decode-max-kv-usage", type=float,
                        default=DEFAULT_DECODE_MAX_KV_USAGE,
                        help="decode workers whose KV cache usage (0-1) is at or past this "
                             "get no new request")


def lifecycle_kwargs(args: argparse.Namespace) -> dict:
    """``RouterConfig`` keyword arguments from ``add_lifecycle_args``'s flags."""
    return {name: getattr(args, name) for name in LIFECYCLE_FIELDS}
