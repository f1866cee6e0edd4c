"""The router's command-line flags, shared by ``python -m pdserve.router`` and ``pdserve
serve`` (README, Operating pdserve): generated from the fields of ``router/config.py``,
and read back into its dataclasses. Light on imports: ``pdserve --help`` reads them
without loading the router (``router/api_keys.py`` is imported by the functions that read
API keys)."""

from __future__ import annotations

import argparse
import logging
import os
from typing import TYPE_CHECKING

from pdserve.cluster.metrics_auth import is_loopback_host
from pdserve.router.config import (
    GROUPS,
    APIAuthSettings,
    GRPCLimits,
    HTTPLimits,
    RouterConfig,
    RouterListen,
    check_public_paths,
    check_router_flags,
    flag_dest,
    flag_fields,
    from_args,
)

if TYPE_CHECKING:
    from pdserve.router.api_keys import AdminAuth, ApiKeyAuth

logger = logging.getLogger(__name__)


def add_router_args(parser: argparse.ArgumentParser, *classes) -> None:
    """Add the flags of ``classes`` (dataclasses of ``router/config.py``; default: all of
    the router's but ``RouterListen``) to ``parser``, generated from their fields: name,
    default, help, type, choices and group. A ``shared`` field's flag is its other
    class's (``GRPCLimits``'s deadlines are ``HTTPLimits``' flags).

    Raises:
        argparse.ArgumentError: a flag ``parser`` has already.
    """
    groups: dict[str, argparse._ArgumentGroup] = {}
    for cls in classes or ROUTER_SETTINGS:
        for f in flag_fields(cls):
            if f.metadata.get("shared"):
                continue
            meta = f.metadata
            where = parser
            if meta["group"] is not None:
                if meta["group"] not in groups:
                    groups[meta["group"]] = parser.add_argument_group(
                        meta["group"], GROUPS[meta["group"]])
                where = groups[meta["group"]]
            where.add_argument(meta["flag"], **flag_kwargs(f))


def flag_kwargs(f) -> dict:
    """``add_argument``'s keyword arguments for the flag of ``router/config.py``'s field
    ``f``."""
    meta = f.metadata
    kwargs = {"help": meta["help"]}
    if meta["action"] == "store_true":
        return {**kwargs, "action": "store_true"}
    if meta["action"] is not None:
        kwargs["action"] = meta["action"]
    kind = meta["type"]
    if isinstance(kind, str):
        kind = _CONVERTERS[kind]
    elif kind is None and type(meta["flag_default"]) in (int, float):
        kind = type(meta["flag_default"])
    if kind is not None:
        kwargs["type"] = kind
    for key in ("choices", "metavar"):
        if meta[key] is not None:
            kwargs[key] = meta[key]
    kwargs["default"] = meta["flag_default"]
    return kwargs


def add_listen_args(parser: argparse.ArgumentParser) -> None:
    """The router's address and ports (``RouterListen``)."""
    add_router_args(parser, RouterListen)


def add_lifecycle_args(parser: argparse.ArgumentParser) -> None:
    """Admission control, migration, prefill routing, tool-calling and timeout flags
    (``RouterConfig``'s fields that are flags)."""
    add_router_args(parser, RouterConfig)


def add_http_args(parser: argparse.ArgumentParser) -> None:
    """The HTTP server's deadlines on the client's side of an exchange (``HTTPLimits``);
    the gRPC server takes the header and send deadlines too (``GRPCLimits``)."""
    add_router_args(parser, HTTPLimits)


def add_grpc_args(parser: argparse.ArgumentParser) -> None:
    """The gRPC server's limits per connection (``GRPCLimits``)."""
    add_router_args(parser, GRPCLimits)


def grpc_limits_from_args(args: argparse.Namespace) -> GRPCLimits:
    """``GRPCLimits`` from its flags (and ``add_http_args``'s deadlines).

    Raises:
        ValueError: a limit out of range (names the flag).
    """
    return from_args(GRPCLimits, args)


def http_timeouts_from_args(args: argparse.Namespace) -> HTTPLimits:
    """``HTTPLimits`` from ``add_http_args``'s flags.

    Raises:
        ValueError: a timeout that is not a positive number of seconds (names the flag).
    """
    return from_args(HTTPLimits, args)


def lifecycle_kwargs(args: argparse.Namespace) -> dict:
    """``RouterConfig`` keyword arguments from its flags (``add_lifecycle_args``).

    Raises:
        ValueError: ``--enable-auto-tool-choice`` without ``--tool-call-parser``, or a
            timeout out of range (checked here, before anything starts; names the flag).
    """
    kwargs = {f.name: getattr(args, flag_dest(f)) for f in flag_fields(RouterConfig)}
    check_router_flags(kwargs)
    return kwargs


def add_api_auth_args(parser: argparse.ArgumentParser) -> None:
    """Client and operator authentication flags, vLLM's ``--api-key`` and pdserve's own
    (``APIAuthSettings``; ``api_auth_from_args`` and ``admin_auth_from_args`` read them)."""
    add_router_args(parser, APIAuthSettings)


def _api_key(value: str) -> str:
    from pdserve.cluster.bearer_keys import check_key

    return _argument(check_key, value)


def _api_key_file(path: str) -> str:
    # NOTE: read now, and again by api_auth_from_args, so that a bad file stops
    # ``pdserve serve`` before it starts anything
    from pdserve.cluster.bearer_keys import read_key_file

    _argument(read_key_file, path)
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


_CONVERTERS = {"api_key": _api_key, "api_key_file": _api_key_file,
               "public_endpoints": _public_endpoints}
ROUTER_SETTINGS = (RouterConfig, HTTPLimits, GRPCLimits, APIAuthSettings)


def api_auth_from_args(args: argparse.Namespace,
                       environ: dict[str, str] | None = None) -> ApiKeyAuth | None:
    """The client authentication that ``add_api_auth_args``'s flags and the environment
    (``environ``, default ``os.environ``) ask for, or None when they give no key (an
    open API); logs which, and warns when a key was given on the command line.

    Raises:
        ValueError: a key is empty or invalid, or the key file is unusable; the message
            names the flag, file and line, or variable (``router/api_keys.py``,
            ``load_api_keys``).
    """
    from pdserve.router.api_keys import ApiKeyAuth, load_api_keys

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
    from pdserve.router.api_keys import AdminAuth, load_admin_api_keys

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
