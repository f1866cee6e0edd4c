"""The router's admission, migration, timeout and client authentication flags (README, Operating
pdserve), shared by ``python -m pdserve.router`` and ``pdserve serve``. Light on imports:
``pdserve --help`` reads them without loading the router."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pdserve.router.limits import MAX_NUM_SEQUENCES

if TYPE_CHECKING:
    from pdserve.router.auth import AdminAuth, ApiKeyAuth

logger = logging.getLogger(__name__)

# NOTE: the defaults admit any one request (at most MAX_NUM_SEQUENCES sequences) on an
# idle cluster of one worker per pool
DEFAULT_MIGRATION_LIMIT = 3
DEFAULT_MAX_WAITING_REQUESTS = 2 * MAX_NUM_SEQUENCES
DEFAULT_PREFILL_MAX_INFLIGHT = MAX_NUM_SEQUENCES
DEFAULT_DECODE_MAX_INFLIGHT = 2 * MAX_NUM_SEQUENCES
DEFAULT_DECODE_MAX_KV_USAGE = 0.98
DEFAULT_PUBLIC_ENDPOINTS = ("/health", "/ready", "/metrics")  # served without an API key
# the admin endpoints (router/auth.py), and every path under them: never public
ADMIN_PATHS = ("/admin", "/metrics/targets")
DISAGGREGATION_MODES = ("auto", "always")
PREFILL_ROUTING_POLICIES = ("prefix-aware", "round-robin")
# Dynamo's conditional disaggregation uses a queue of 2; a prefill worker batches the
# Prefill calls waiting for it, so a few waiting ones still finish together.
DEFAULT_MAX_PREFILL_QUEUE_SIZE = 4
LIFECYCLE_FIELDS = ("migration_limit", "max_waiting_requests", "prefill_max_inflight",
                    "decode_max_inflight", "decode_max_kv_usage", "disaggregation",
                    "max_prefill_queue_size", "prefill_routing", "enable_auto_tool_choice",
                    "tool_call_parser")
# seconds a request's headers, then its body, may take to arrive (router/http_server.py)
DEFAULT_REQUEST_HEADER_TIMEOUT_S = 10.0
DEFAULT_REQUEST_BODY_TIMEOUT_S = 60.0
DEFAULT_RESPONSE_SEND_TIMEOUT_S = 60.0  # a client that takes no bytes of its response
# the router's gRPC API (router/grpc_server.py): streams one connection may run at once
# (nginx's http2_max_concurrent_streams is 128, Go's 250), and seconds a connection may
# stay open without one before the router closes it (clients reconnect by themselves)
DEFAULT_GRPC_MAX_CONCURRENT_STREAMS = 256
DEFAULT_GRPC_MAX_CONNECTION_IDLE_S = 300.0
# vLLM's --tool-call-parser names (router/tool_parsers.py)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")
# The router's deadlines on its side of a request (add_timeout_args; RouterConfig).
# Prefill and decode streams have none: a call silent for DEFAULT_STALL_INTERVAL_S has its
# worker asked for Health, and only DEFAULT_HEALTH_FAILURE_THRESHOLD calls in a row without
# an answer (DEFAULT_HEALTH_CHECK_TIMEOUT_S each) make the worker dead: about 14 s at most
# to tell a hung worker, one Health call per 10 s of silence for a slow one.
DEFAULT_STALL_INTERVAL_S = 10.0
DEFAULT_HEALTH_CHECK_INTERVAL_S = 0.5
DEFAULT_HEALTH_CHECK_TIMEOUT_S = 1.0
DEFAULT_HEALTH_FAILURE_THRESHOLD = 3  # SGLang's router's --health-failure-threshold
DEFAULT_CONTROL_TIMEOUT_S = 5.0
TIMEOUT_FIELDS = {"stall_interval_s": "stall_interval_s",
                  "health_check_interval_s": "health_interval_s",
                  "health_check_timeout_s": "health_timeout_s",
                  "health_failure_threshold": "health_failure_threshold",
                  "control_timeout_s": "control_timeout_s"}  # flag's dest -> RouterConfig's


def is_admin_path(path: str) -> bool:
    """Whether the HTTP ``path`` is an admin endpoint: ``/admin``, ``/metrics/targets``
    or a path under one of them."""
    return any(path == p or path.startswith(p + "/") for p in ADMIN_PATHS)


def check_public_paths(paths: Iterable[str]) -> None:
    """Raise ValueError naming the first admin path (``is_admin_path``) in ``paths``: an
    admin endpoint is never public."""
    for path in sorted(paths):
        if is_admin_path(path):
            raise ValueError(f"{path} is an admin endpoint: it cannot be public (it takes "
                             "the admin API key, --admin-api-key, or with none a loopback "
                             "client)")


def check_seconds(value, flag: str) -> None:
    """Raise ValueError naming ``flag`` unless ``value`` is a positive finite number of
    seconds (the HTTP and gRPC servers' deadlines)."""
    if isinstance(value, bool) or not (isinstance(value, (int, float)) and
                                       0 < value < float("inf")):
        raise ValueError(f"{flag} must be a positive number of seconds, not {value!r}")


def add_lifecycle_args(parser: argparse.ArgumentParser) -> None:
    """Admission control, migration, prefill routing and tool-calling flags
    (``RouterConfig``'s fields of those names)."""
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
    parser.add_argument("--disaggregation", choices=DISAGGREGATION_MODES, default="auto",
                        help="auto: decide per request whether the prefill pool pays "
                             "(prefill on the decode worker when little of the prompt is "
                             "left after its prefix cache, when every prefill worker "
                             "computes on the decode worker's own CPUs or GPU, or when the "
                             "pool is busy); always: the pool prefills every prompt of at "
                             "least --local-prefill-threshold tokens")
    parser.add_argument("--max-prefill-queue-size", type=int,
                        default=DEFAULT_MAX_PREFILL_QUEUE_SIZE,
                        help="with --disaggregation auto, a prefill worker with this many "
                             "prefills waiting counts as busy: prompts are prefilled on "
                             "their decode worker instead")
    parser.add_argument("--prefill-routing", choices=PREFILL_ROUTING_POLICIES,
                        default="prefix-aware",
                        help="prefix-aware: the prefill worker with the lowest "
                             "uncached blocks + load (the Redis prefix index); round-robin: "
                             "the next one in turn (a baseline to compare with)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="let the model decide when to call tools (tool_choice "
                             "'auto', the default with tools); needs --tool-call-parser")
    parser.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                        help="how the model writes tool calls: hermes (Hermes, Qwen), "
                             "llama3_json (Llama 3.1-3.3), mistral")
    add_timeout_args(parser)


def add_timeout_args(parser: argparse.ArgumentParser) -> None:
    """The router's deadlines towards its workers (``RouterConfig``'s ``stall_interval_s``,
    ``health_*`` and ``control_timeout_s``; read back by ``lifecycle_kwargs``)."""
    group = parser.add_argument_group(
        "router timeouts", "A Prefill call or decode stream has no deadline: a slow one is "
        "never taken for a failed worker. One silent for --stall-interval-s has its worker "
        "asked for Health; only a worker that gives no answer --health-failure-threshold "
        "times in a row (--health-check-timeout-s each) is dead, and its requests move to "
        "another worker.")
    group.add_argument("--stall-interval-s", type=float, default=DEFAULT_STALL_INTERVAL_S,
                       help="seconds a Prefill call or a decode stream may send nothing "
                            "before its worker is asked for Health, and again after each "
                            "further such silence (%(default)s)")
    group.add_argument("--health-check-interval-s", type=float,
                       default=DEFAULT_HEALTH_CHECK_INTERVAL_S,
                       help="seconds between the Health polls of every worker (their load, "
                            "for routing) and between the tries of a stall probe "
                            "(%(default)s)")
    group.add_argument("--health-check-timeout-s", type=float,
                       default=DEFAULT_HEALTH_CHECK_TIMEOUT_S,
                       help="seconds one Health call may take; a worker past it gets no new "
                            "request until it answers again (%(default)s)")
    group.add_argument("--health-failure-threshold", type=int,
                       default=DEFAULT_HEALTH_FAILURE_THRESHOLD,
                       help="Health calls in a row a worker with a silent call must leave "
                            "unanswered to be taken for dead (%(default)s)")
    group.add_argument("--control-timeout-s", type=float, default=DEFAULT_CONTROL_TIMEOUT_S,
                       help="seconds each GrantKV, Abort and Release call may take, and the "
                            "wait at shutdown for those under way (%(default)s)")


def add_http_args(parser: argparse.ArgumentParser) -> None:
    """The HTTP server's deadlines on the client's side of an exchange
    (``router/http_server.py``; read back by ``http_timeouts_from_args``); the gRPC server
    takes the header and send deadlines too (``grpc_limits_from_args``)."""
    parser.add_argument("--request-header-timeout-s", type=float,
                        default=DEFAULT_REQUEST_HEADER_TIMEOUT_S,
                        help="seconds a request's line and headers may take to arrive "
                             "(from the connection's opening, or the previous response's "
                             "end), and a gRPC connection's HTTP/2 preface; past it the "
                             "connection is closed (%(default)s)")
    parser.add_argument("--request-body-timeout-s", type=float,
                        default=DEFAULT_REQUEST_BODY_TIMEOUT_S,
                        help="seconds a request's body may take to arrive after its "
                             "headers; past it the connection is closed (%(default)s)")
    parser.add_argument("--response-send-timeout-s", type=float,
                        default=DEFAULT_RESPONSE_SEND_TIMEOUT_S,
                        help="seconds a client may take no bytes of a response while "
                             "the router has more to send; past it the connection is "
                             "dropped (a gRPC stream ends with DEADLINE_EXCEEDED) and "
                             "the request cancelled (%(default)s)")


def add_grpc_args(parser: argparse.ArgumentParser) -> None:
    """The gRPC server's limits per connection (``router/grpc_server.py``; read back with
    ``add_http_args``'s deadlines by ``grpc_limits_from_args``)."""
    parser.add_argument("--grpc-max-concurrent-streams", type=int,
                        default=DEFAULT_GRPC_MAX_CONCURRENT_STREAMS,
                        help="RPCs one gRPC connection may run at once (HTTP/2 "
                             "SETTINGS_MAX_CONCURRENT_STREAMS); a client queues the "
                             "rest (%(default)s)")
    parser.add_argument("--grpc-max-connection-idle-s", type=float,
                        default=DEFAULT_GRPC_MAX_CONNECTION_IDLE_S,
                        help="seconds a gRPC connection may stay open with no RPC before "
                             "the router closes it (GOAWAY; clients reconnect) "
                             "(%(default)s)")


def grpc_limits_from_args(args: argparse.Namespace):
    """``GRPCLimits`` from ``add_grpc_args``'s and ``add_http_args``'s flags.

    Raises:
        ValueError: a limit out of range (names the flag).
    """
    from pdserve.router.grpc_server import GRPCLimits

    return GRPCLimits(handshake_timeout_s=args.request_header_timeout_s,
                      send_timeout_s=args.response_send_timeout_s,
                      max_concurrent_streams=args.grpc_max_concurrent_streams,
                      max_connection_idle_s=args.grpc_max_connection_idle_s)


def http_timeouts_from_args(args: argparse.Namespace):
    """``HTTPTimeouts`` from ``add_http_args``'s flags.

    Raises:
        ValueError: a timeout that is not a positive number of seconds (names the flag).
    """
    from pdserve.router.http_server import HTTPTimeouts

    return HTTPTimeouts(args.request_header_timeout_s, args.request_body_timeout_s,
                        args.response_send_timeout_s)


def lifecycle_kwargs(args: argparse.Namespace) -> dict:
    """``RouterConfig`` keyword arguments from ``add_lifecycle_args``'s flags.

    Raises:
        ValueError: ``--enable-auto-tool-choice`` without ``--tool-call-parser``, or a
            timeout out of range (checked here, before anything starts; names the flag).
    """
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the format "
                         "the model writes its tool calls in)")
    kwargs = {name: getattr(args, name) for name in LIFECYCLE_FIELDS}
    for dest, field in TIMEOUT_FIELDS.items():
        if dest != "health_failure_threshold":
            check_seconds(getattr(args, dest), "--" + dest.replace("_", "-"))
        kwargs[field] = getattr(args, dest)
    if args.health_failure_threshold < 1:
        raise ValueError("--health-failure-threshold must be at least 1, not "
                         f"{args.health_failure_threshold}")
    return kwargs


def add_api_auth_args(parser: argparse.ArgumentParser) -> None:
    """Client and operator authentication flags, vLLM's ``--api-key`` and pdserve's own
    (``router/auth.py``; ``api_auth_from_args`` and ``admin_auth_from_args`` read them)."""
    group = parser.add_argument_group(
        "client authentication", "With an API key (from a flag, else PDSERVE_API_KEY, else "
        "VLLM_API_KEY) clients must send 'Authorization: Bearer <key>' (gRPC: the same "
        "metadata); with none, the API is open.")
    group.add_argument("--api-key", action="append", type=_api_key, metavar="KEY",
                       help="accept this API key; repeat for several (visible to local "
                            "users in ps: prefer PDSERVE_API_KEY or --api-key-file)")
    group.add_argument("--api-key-file", type=_api_key_file, metavar="PATH",
                       help="accept the API keys in this file, one per non-empty line")
    group.add_argument("--public-endpoints", type=_public_endpoints,
                       default=",".join(DEFAULT_PUBLIC_ENDPOINTS), metavar="PATHS",
                       help="comma-separated HTTP paths served without a key (gRPC Health "
                            "follows /health); '' protects every path; never an admin "
                            "endpoint (default: %(default)s)")
    admin = parser.add_argument_group(
        "operator authentication", "The admin endpoints (/admin/*: pdserve scale; "
        "/metrics/targets) take only an admin key (from a flag, else "
        "PDSERVE_ADMIN_API_KEY), never a client key; an admin key also works as a client "
        "key. With none, they answer loopback clients only.")
    admin.add_argument("--admin-api-key", action="append", type=_api_key, metavar="KEY",
                       help="accept this admin API key; repeat for several (visible in "
                            "ps: prefer PDSERVE_ADMIN_API_KEY or --admin-api-key-file)")
    admin.add_argument("--admin-api-key-file", type=_api_key_file, metavar="PATH",
                       help="accept the admin API keys in this file, one per non-empty line")


def _api_key(value: str) -> str:
    from pdserve.router.auth import check_api_key

    return _argument(check_api_key, value)


def _api_key_file(path: str) -> str:
    # NOTE: read now, and again by api_auth_from_args, so that a bad file stops
    # ``pdserve serve`` before it starts anything
    from pdserve.router.auth import read_api_key_file

    _argument(read_api_key_file, path)
    return path


def _argument(check, value):
    """``check(value)``, its ValueError an argparse error (printed with the flag's name)."""
    try:
        return check(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _public_endpoints(value: str) -> frozenset[str]:
    paths = frozenset(path.strip() for path in value.split(",") if path.strip())
    for path in sorted(paths):
        if not path.startswith("/"):
            raise argparse.ArgumentTypeError(f"{path!r} is not a path (one starts with /)")
    _argument(check_public_paths, paths)
    return paths


def api_auth_from_args(args: argparse.Namespace,
                       environ: dict[str, str] | None = None) -> ApiKeyAuth | None:
    """The client authentication that ``add_api_auth_args``'s flags and the environment
    (``environ``, default ``os.environ``) ask for, or None when they give no key (an
    open API); logs which, and warns when a key was given on the command line.

    Raises:
        ValueError: a key is empty or invalid, or the key file is unusable; the message
            names the flag, file and line, or variable (``router/auth.py``,
            ``load_api_keys``).
    """
    from pdserve.router.auth import ApiKeyAuth, load_api_keys

    keys, source = load_api_keys(args.api_key or (), args.api_key_file,
                                 os.environ if environ is None else environ)
    if args.api_key:
        logger.warning("an API key given with --api-key is visible to other local users "
                       "(ps, /proc/<pid>/cmdline); prefer PDSERVE_API_KEY or --api-key-file")
    if not keys:
        logger.info("client authentication off: no API key (--api-key, --api-key-file, "
                    "PDSERVE_API_KEY, VLLM_API_KEY)")
        return None
    public = ", ".join(sorted(args.public_endpoints)) or "none"
    logger.info("client authentication on: %d API key(s) from %s; public endpoints: %s",
                len(keys), source, public)
    return ApiKeyAuth.of(keys, args.public_endpoints)


def admin_auth_from_args(args: argparse.Namespace, api_auth: ApiKeyAuth | None = None,
                         environ: dict[str, str] | None = None) -> AdminAuth:
    """The operator authentication that ``add_api_auth_args``'s admin flags and the
    environment (``environ``, default ``os.environ``: ``PDSERVE_ADMIN_API_KEY``) ask for:
    an ``AdminAuth`` with their keys, or with none (loopback clients only); logs which,
    and warns when a key was given on the command line.

    Raises:
        ValueError: a key is empty or invalid, the key file is unusable (named as
            ``load_admin_api_keys`` names it), or an admin key is also one of
            ``api_auth``'s client keys (operators and clients must hold different keys).
    """
    from pdserve.router.auth import AdminAuth, load_admin_api_keys

    keys, source = load_admin_api_keys(args.admin_api_key or (), args.admin_api_key_file,
                                       os.environ if environ is None else environ)
    if args.admin_api_key:
        logger.warning("an admin API key given with --admin-api-key is visible to other "
                       "local users (ps, /proc/<pid>/cmdline); prefer "
                       "PDSERVE_ADMIN_API_KEY or --admin-api-key-file")
    admin = AdminAuth.of(keys)
    if api_auth is not None and set(admin.key_digests) & set(api_auth.key_digests):
        raise ValueError(f"{source}: an admin API key is also a client API key; give "
                         "operators a key of their own")
    if keys:
        logger.info("operator authentication on: %d admin API key(s) from %s",
                    len(keys), source)
    return admin


def is_loopback_host(host: str) -> bool:
    """Whether a listening address (``--host``) is reachable from this machine only:
    ``localhost``, 127.0.0.0/8 or ``::1``. A wildcard (``0.0.0.0``, ``::``), any other
    address or a host name is routable."""
    from pdserve.router.auth import is_loopback

    return host.strip("[]").lower() == "localhost" or is_loopback(host.strip("[]"))


def log_exposure(host: str, api_auth: ApiKeyAuth | None, admin_auth: AdminAuth,
                 ports: str = "") -> None:
    """Say at start-up what the router's listening address ``host`` exposes (``ports``
    names them for the log, e.g. ``"8000 (HTTP), 50050 (gRPC)"``):

    - WARNING when the API is open (no client key) on a routable address: anyone who
      reaches it may use the model;
    - INFO when the admin endpoints have no admin key: loopback clients only (and none
      at all when ``host`` is one routable address, whose clients never come from
      loopback).
    """
    where = f"{host}" + (f", port(s) {ports}" if ports else "")
    if api_auth is None and not is_loopback_host(host):
        logger.warning(
            "THE API IS OPEN: no client API key (--api-key, --api-key-file, "
            "PDSERVE_API_KEY, VLLM_API_KEY) and the router listens on %s, a routable "
            "address: anyone who can reach it can run the model. Set an API key, or "
            "listen on 127.0.0.1 behind an authenticating proxy.", where)
    if admin_auth.has_keys:
        return
    wildcard = host.strip("[]") in ("0.0.0.0", "::", "")
    if is_loopback_host(host) or wildcard:
        logger.info("admin endpoints (/admin/*, /metrics/targets) answer loopback clients "
                    "only: no admin API key (--admin-api-key, --admin-api-key-file, "
                    "PDSERVE_ADMIN_API_KEY)")
    else:
        logger.info("admin endpoints (/admin/*, /metrics/targets) are unreachable: with no "
                    "admin API key (--admin-api-key, --admin-api-key-file, "
                    "PDSERVE_ADMIN_API_KEY) they answer loopback clients only, and the "
                    "router listens on %s, not on loopback", host)
