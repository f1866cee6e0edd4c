"""Who may scrape a worker's Prometheus ``/metrics`` (``cluster/worker_metrics.py``).

A worker's metrics name its id, role and load, which is what an attacker on the network
needs to aim at one worker (README, Security), so they are for the operator's Prometheus
only. Prometheus presents a scrape key as ``Authorization: Bearer <key>`` (its
``authorization: {credentials_file: ...}``). The keys:

- every ``--metrics-api-key`` and every non-empty line of ``--metrics-api-key-file``;
  with neither, ``$PDSERVE_METRICS_API_KEY``. A variable that is set but empty is an
  error, not "no key";
- under ``pdserve serve``, the router's admin keys too (``--admin-api-key``: the
  operator's key works wherever a lesser one does); never a client key (``pdserve
  serve`` refuses a metrics key that is also one).

A worker holds only the keys' SHA-256 digests (``MetricsAuth``): ``pdserve serve`` hands
its actors the digests, not the keys. A presented key is hashed and compared with every
digest with ``hmac.compare_digest``, so how long a check takes says nothing of how close
a guess was, nor which key matched.

Where a worker serves its metrics (``WorkerRuntime.start_metrics``): with a key, on its
``--host`` (the address it advertises in the registry), every scrape without the key
answered 401. With no key, on a loopback ``--host`` as before (open: only this machine
reaches it); on a routable one, on 127.0.0.1 only, not advertised in the registry (so
the router's ``/metrics/targets`` does not list it), and the worker says so once at
start-up.

Imports nothing heavy: ``pdserve --help`` reads the flags below.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pdserve.cluster.bearer_keys import digest, load_keys, matches

logger = logging.getLogger(__name__)

METRICS_KEY_ENV = "PDSERVE_METRICS_API_KEY"
LOOPBACK_HOST = "127.0.0.1"  # where a routable worker with no key serves its metrics


def load_metrics_keys(cli_keys: Iterable[str] = (), key_file: str | None = None,
                      environ: Mapping[str, str] | None = None
                      ) -> tuple[list[str], str | None]:
    """The metrics keys and where they came from (for the log), e.g.
    ``(["k"], "--metrics-api-key-file")``, or ``([], None)`` when nothing gives one:
    ``cli_keys`` and ``key_file`` together, else ``$PDSERVE_METRICS_API_KEY`` from
    ``environ`` (default ``os.environ``).

    Raises:
        ValueError: a key is empty or invalid, the file is unusable, or the variable is
            set but empty; the message names the flag, file and line, or variable.
    """
    return load_keys(cli_keys, key_file, environ, "--metrics-api-key", (METRICS_KEY_ENV,))


@dataclass(frozen=True, slots=True)
class MetricsAuth:
    """The SHA-256 digests (32 bytes each) of the keys a worker's ``/metrics`` accepts;
    none: no key is set (see the module docstring for where it then listens). Picklable
    (Ray hands it to the worker actors); its repr shows no digest."""

    key_digests: tuple[bytes, ...] = field(default=(), repr=False)

    @classmethod
    def of(cls, keys: Iterable[str] = (), also: Iterable[bytes] = ()) -> MetricsAuth:
        """Accept each of ``keys`` and each digest in ``also`` (the router's admin keys,
        ``AdminAuth.key_digests``)."""
        digests = [digest(key.encode("ascii")) for key in keys]
        return cls(tuple(dict.fromkeys([*digests, *also])))

    def __bool__(self) -> bool:
        return bool(self.key_digests)

    def allows(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header value is ``Bearer <one of the keys>``;
        False with no key set. Compares with every digest, in constant time each."""
        scheme, _, token = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip() or not self.key_digests:
            return False
        return matches(digest(token.strip().encode("utf-8", "surrogateescape")),
                       self.key_digests)


def is_loopback_host(host: str) -> bool:
    """Whether a listening address reaches this machine only: ``localhost``,
    127.0.0.0/8 or ``::1`` (IPv4-mapped too). A wildcard, any other address or a host
    name is routable."""
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


def add_metrics_auth_args(parser: argparse.ArgumentParser, *, cli_key: bool = True) -> None:
    """``--metrics-api-key-file`` and, with ``cli_key``, ``--metrics-api-key``
    (``metrics_auth_from_args`` reads them, with ``$PDSERVE_METRICS_API_KEY``)."""
    group = parser.add_argument_group(
        "worker metrics authentication",
        "Each worker's Prometheus /metrics takes a scrape key as 'Authorization: Bearer "
        f"<key>' (from a flag, else {METRICS_KEY_ENV}; under pdserve serve an admin key "
        "works too). With none, a worker on a routable address serves /metrics on "
        "127.0.0.1 only.")
    if cli_key:
        group.add_argument("--metrics-api-key", action="append", metavar="KEY",
                           help="accept this key on the workers' /metrics; repeat for "
                           f"several (visible in ps: prefer {METRICS_KEY_ENV} or "
                           "--metrics-api-key-file)")
    group.add_argument("--metrics-api-key-file", metavar="PATH",
                       help="accept the keys in this file on the workers' /metrics, one "
                       "per non-empty line")


def metrics_auth_from_args(args: argparse.Namespace, admin_digests: Iterable[bytes] = (),
                           client_digests: Iterable[bytes] = (), worker_host: str = "",
                           environ: Mapping[str, str] | None = None) -> MetricsAuth:
    """The ``MetricsAuth`` that ``add_metrics_auth_args``'s flags and the environment ask
    for, with ``admin_digests`` also accepted; logs where its keys came from, or, for
    workers on a routable ``worker_host`` with no key, that their metrics stay on
    loopback.

    Raises:
        ValueError: as ``load_metrics_keys``, or a metrics key is one of
            ``client_digests`` (a client must not read the workers' metrics).
    """
    cli_keys = getattr(args, "metrics_api_key", None) or ()
    keys, source = load_metrics_keys(cli_keys, args.metrics_api_key_file, environ)
    if cli_keys:
        logger.warning("a metrics API key given with --metrics-api-key is visible to other "
                       "local users (ps, /proc/<pid>/cmdline); prefer %s or "
                       "--metrics-api-key-file", METRICS_KEY_ENV)
    own = MetricsAuth.of(keys)
    if set(own.key_digests) & set(client_digests):
        raise ValueError(f"{source}: a metrics API key is also a client API key; give "
                         "Prometheus a key of its own")
    auth = MetricsAuth.of((), [*own.key_digests, *admin_digests])
    if auth:
        logger.info("worker metrics authentication on: %d metrics key(s)%s, %d admin "
                    "key(s)", len(keys), f" from {source}" if source else "",
                    len(auth.key_digests) - len(own.key_digests))
    elif worker_host and not is_loopback_host(worker_host):
        logger.warning("no metrics or admin API key (--metrics-api-key, "
                       "--metrics-api-key-file, %s, --admin-api-key): workers on %s serve "
                       "/metrics on %s only, and the router's /metrics/targets does not "
                       "list them", METRICS_KEY_ENV, worker_host, LOOPBACK_HOST)
    return auth
