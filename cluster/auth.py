"""Cluster authentication (docs/architecture.md, Lifecycle and failure): every internal RPC and
every registry record carries proof of the cluster secret, and, when certificates are
given, the workers' gRPC servers and channels use mutual TLS.

The secret is random bytes that every member of one cluster shares (``pdserve serve``
generates one and hands it to the workers it starts; plain processes read
``--cluster-secret-file`` or ``PDSERVE_CLUSTER_SECRET``). It is never used directly: each
use gets its own key, ``HMAC-SHA256(secret, label)`` (the extract-free form of HKDF's
expand step, RFC 5869), so a token seen on the wire reveals nothing about the registry's
signing key.

- An RPC carries ``x-pdserve-cluster-auth: v1:<unix seconds>:<hex HMAC of "method\\nts">``
  in its metadata; a server accepts it within ``MAX_CLOCK_SKEW_S`` of its own clock. A
  token is bound to one method and expires, but is not single-use: on an untrusted network,
  add mutual TLS (``ClusterTLS``), which also encrypts the RPCs.
- A registry record is signed over its canonical JSON (``sign_record``); the router
  ignores a record it cannot verify.

Secrets come from files or the environment, never from the command line (where ``ps``
shows them).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import hmac
import logging
import os
import secrets
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote, unquote, urlsplit, urlunsplit

if TYPE_CHECKING:
    import grpc

# NOTE: grpc is imported where it is used: `pdserve --help` reads the flags below
logger = logging.getLogger(__name__)

SECRET_ENV = "PDSERVE_CLUSTER_SECRET"
REDIS_PASSWORD_ENV = "PDSERVE_REDIS_PASSWORD"
METADATA_KEY = "x-pdserve-cluster-auth"
MAX_CLOCK_SKEW_S = 300  # seconds a token is valid either side of the server's clock
MIN_SECRET_BYTES = 16
_TOKEN_VERSION = "v1"


class ClusterAuthError(ValueError):
    """A cluster secret, password or certificate is missing or unusable."""


@dataclass(frozen=True, slots=True)
class ClusterTLS:
    """Mutual TLS for the workers' gRPC: PEM bytes of this member's certificate chain and
    private key, and of the CA that signs every member's certificate. Servers require a
    client certificate from that CA; channels verify the server's against it (its
    certificate must name the advertised host, as a DNS or IP subject alternative name).
    """

    certificate_chain: bytes = field(repr=False)
    private_key: bytes = field(repr=False)
    root_certificates: bytes = field(repr=False)

    @classmethod
    def from_files(cls, certfile: str, keyfile: str, ca_certs: str) -> ClusterTLS:
        """Raises ClusterAuthError naming the file that cannot be read."""
        return cls(_read(certfile, "--cluster-ssl-certfile"),
                   _read(keyfile, "--cluster-ssl-keyfile"),
                   _read(ca_certs, "--cluster-ssl-ca-certs"))

    def server_credentials(self) -> grpc.ServerCredentials:
        import grpc

        return grpc.ssl_server_credentials([(self.private_key, self.certificate_chain)],
                                           root_certificates=self.root_certificates,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        import grpc

        return grpc.ssl_channel_credentials(root_certificates=self.root_certificates,
                                            private_key=self.private_key,
                                            certificate_chain=self.certificate_chain)


class ClusterAuth:
    """What one cluster member needs to prove itself to the others and check them.

    Args:
        secret: the cluster secret, at least ``MIN_SECRET_BYTES`` bytes.
        tls: mutual TLS for gRPC, or None for plain TCP (with tokens).

    Raises:
        ClusterAuthError: the secret is too short.

    Picklable (Ray passes it to worker actors); its repr shows no secret.
    """

    __slots__ = ("_kv_key", "_record_key", "_rpc_key", "tls")

    def __init__(self, secret: bytes, tls: ClusterTLS | None = None) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ClusterAuthError(f"the cluster secret has {len(secret)} bytes; it needs "
                                   f"at least {MIN_SECRET_BYTES}")
        self._rpc_key = _derive(secret, b"pdserve rpc v1")
        self._record_key = _derive(secret, b"pdserve registry record v1")
        self._kv_key = _derive(secret, b"pdserve kv transfer v1")
        self.tls = tls

    @classmethod
    def generate(cls, tls: ClusterTLS | None = None) -> ClusterAuth:
        """A new cluster with a random 32-byte secret."""
        return cls(secrets.token_bytes(32), tls)

    def __repr__(self) -> str:
        return f"ClusterAuth(tls={self.tls is not None})"

    def __getstate__(self) -> tuple:
        return self._rpc_key, self._record_key, self._kv_key, self.tls

    def __setstate__(self, state: tuple) -> None:
        self._rpc_key, self._record_key, self._kv_key, self.tls = state

    @property
    def kv_key(self) -> bytes:
        """32 bytes, the KV path's own key (``HMAC-SHA256(secret, "pdserve kv transfer
        v1")``): the KV store's handshake and every transfer's digest key derive from it
        (``pdserve.kvtransfer.auth``)."""
        return self._kv_key

    # RPCs

    def rpc_metadata(self, method: str, now: float | None = None
                     ) -> tuple[tuple[str, str], ...]:
        """gRPC metadata proving the secret for a call of ``method``
        (``/pdserve.v1.PrefillWorker/Prefill``) at unix time ``now`` (default: now);
        pass it as ``metadata=``."""
        now = str(int(time.time() if now is None else now))
        return ((METADATA_KEY, f"{_TOKEN_VERSION}:{now}:{self._mac(method, now)}"),)

    def check_rpc(self, method: str, metadata) -> str | None:
        """None if ``metadata`` (a call's invocation metadata) proves the secret for
        ``method`` now; else why not, in a few words."""
        token = next((value for key, value in metadata or () if key == METADATA_KEY), None)
        if token is None:
            return "no cluster credentials"
        version, _, rest = str(token).partition(":")
        when, _, mac = rest.partition(":")
        if version != _TOKEN_VERSION or not when.isdigit():
            return "malformed cluster credentials"
        if abs(time.time() - int(when)) > MAX_CLOCK_SKEW_S:
            return f"cluster credentials outside the {MAX_CLOCK_SKEW_S} s clock window"
        if not hmac.compare_digest(mac, self._mac(method, when)):
            return "invalid cluster credentials"
        return None

    def _mac(self, method: str, when: str) -> str:
        return hmac.new(self._rpc_key, f"{method}\n{when}".encode(), hashlib.sha256).hexdigest()

    def server_interceptor(self) -> grpc.aio.ServerInterceptor:
        """Refuses, with UNAUTHENTICATED and before the handler runs, every call without
        valid credentials (one check per call, nothing per message)."""
        return _interceptor_class()(self)

    def channel(self, address: str) -> grpc.aio.Channel:
        """A channel to a cluster member at ``host:port``: mutual TLS when configured."""
        import grpc

        if self.tls is None:
            return grpc.aio.insecure_channel(address)
        return grpc.aio.secure_channel(address, self.tls.channel_credentials())

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Bind ``server`` to ``address`` (mutual TLS when configured); the port, 0 if
        it could not be bound."""
        if self.tls is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, self.tls.server_credentials())

    # registry records

    def sign_record(self, payload: str) -> str:
        """The hex signature of a registry record's canonical JSON ``payload``."""
        return hmac.new(self._record_key, payload.encode(), hashlib.sha256).hexdigest()

    def verify_record(self, payload: str, signature: str) -> bool:
        return hmac.compare_digest(self.sign_record(payload), str(signature))


def _derive(secret: bytes, label: bytes) -> bytes:
    return hmac.new(secret, label, hashlib.sha256).digest()


@functools.cache
def _interceptor_class() -> type:
    import grpc

    class ClusterAuthInterceptor(grpc.aio.ServerInterceptor):
        def __init__(self, auth: ClusterAuth) -> None:
            self._auth = auth
            self._num_refused = 0

        async def intercept_service(self, continuation, handler_call_details):
            method = handler_call_details.method
            reason = self._auth.check_rpc(method, handler_call_details.invocation_metadata)
            if reason is None:
                return await continuation(handler_call_details)
            self._num_refused += 1
            if self._num_refused <= 10 or self._num_refused % 1000 == 0:
                logger.warning("refused %s: %s (%d refused so far)", method, reason,
                               self._num_refused)
            return unauthenticated_handler(f"{method}: {reason}")

    return ClusterAuthInterceptor


def unauthenticated_handler(message: str) -> grpc.RpcMethodHandler:
    """A handler that ends a call with UNAUTHENTICATED and ``message`` without reading its
    request: a streaming one, so grpc does not wait for a whole request message first
    (the client's call kind does not matter on the wire)."""
    import grpc

    async def refuse(request_iterator, context) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return grpc.stream_stream_rpc_method_handler(refuse)


# Where secrets come from

def read_secret_file(path: str, what: str) -> bytes:
    """A secret file's bytes, surrounding whitespace stripped. Warns when other users may
    read it (as ssh does for keys).

    Raises:
        ClusterAuthError: unreadable or empty; the message names ``what`` (the flag).
    """
    data = _read(path, what).strip()
    if not data:
        raise ClusterAuthError(f"{what} {path} is empty")
    try:
        if os.stat(path).st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning("%s %s is readable by other users; chmod 600 it", what, path)
    except OSError:
        pass
    return data


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ClusterAuthError(f"{what} {path}: {exc.strerror or exc}") from None


def write_secret_file(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to a new file only its owner can read (mode 0600)."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def add_cluster_auth_args(parser: argparse.ArgumentParser, *, generated: bool = False) -> None:
    """``--cluster-secret-file``, the mutual-TLS files and ``--redis-password-file``.
    ``generated``: the command makes its own secret when none is given (``pdserve
    serve``)."""
    default = ("default: $" + SECRET_ENV + ", else a new random one"
               if generated else "default: $" + SECRET_ENV + "; one of the two is required")
    parser.add_argument("--cluster-secret-file", default=None,
                        help="file holding the secret every member of this cluster shares "
                             f"(at least {MIN_SECRET_BYTES} bytes; {default})")
    parser.add_argument("--cluster-ssl-certfile", default=None,
                        help="PEM certificate of this member, for mutual TLS between the "
                             "router and workers (with --cluster-ssl-keyfile and "
                             "--cluster-ssl-ca-certs)")
    parser.add_argument("--cluster-ssl-keyfile", default=None,
                        help="PEM private key of --cluster-ssl-certfile")
    parser.add_argument("--cluster-ssl-ca-certs", default=None,
                        help="PEM CA certificate that signs every member's certificate")
    parser.add_argument("--redis-password-file", default=None,
                        help=f"file holding the Redis password (default: ${REDIS_PASSWORD_ENV}"
                             ", or the password in --redis-url)")


def cluster_auth_from_args(args: argparse.Namespace, *, generate: bool = False) -> ClusterAuth:
    """The cluster's ``ClusterAuth`` from ``add_cluster_auth_args``'s flags and the
    environment; a new secret when none is given and ``generate``.

    Raises:
        ClusterAuthError: no secret (and not ``generate``), or an unusable one or an
            incomplete set of TLS files; the message names the flag.
    """
    tls_files = (args.cluster_ssl_certfile, args.cluster_ssl_keyfile, args.cluster_ssl_ca_certs)
    tls = None
    if any(tls_files):
        if not all(tls_files):
            raise ClusterAuthError("mutual TLS needs all of --cluster-ssl-certfile, "
                                   "--cluster-ssl-keyfile and --cluster-ssl-ca-certs")
        tls = ClusterTLS.from_files(*tls_files)
    if args.cluster_secret_file:
        return ClusterAuth(read_secret_file(args.cluster_secret_file, "--cluster-secret-file"),
                           tls)
    if os.environ.get(SECRET_ENV, "").strip():
        return ClusterAuth(os.environ[SECRET_ENV].strip().encode(), tls)
    if generate:
        return ClusterAuth.generate(tls)
    raise ClusterAuthError(
        f"no cluster secret: pass --cluster-secret-file or set ${SECRET_ENV} (the same on "
        "every member; e.g. `python -c 'import secrets; print(secrets.token_hex(32))' > "
        "secret && chmod 600 secret`)")


def redis_password_from_args(args: argparse.Namespace) -> str | None:
    """The Redis password from ``--redis-password-file`` or ``$PDSERVE_REDIS_PASSWORD``;
    None when neither is set. Warns when ``--redis-url`` itself holds a password (other
    local users see it in ``ps``)."""
    if getattr(args, "redis_url", None) and urlsplit(args.redis_url).password:
        logger.warning("--redis-url holds a password, which other local users can read in "
                       "`ps`; use --redis-password-file or $%s", REDIS_PASSWORD_ENV)
    if getattr(args, "redis_password_file", None):
        return read_secret_file(args.redis_password_file, "--redis-password-file").decode()
    return os.environ.get(REDIS_PASSWORD_ENV) or None


def redis_url_with_password(url: str, password: str | None) -> str:
    """``url`` with ``password`` as its password (``redis://:password@host:port/db``);
    ``url`` itself when ``password`` is None."""
    if password is None:
        return url
    parts = urlsplit(url)
    user = unquote(parts.username or "")
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def redact_url(url: str) -> str:
    """``url`` with its password (if any) shown as ``***``, for logs and errors."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit((parts.scheme, f"{user}:***@{netloc}", parts.path, parts.query,
                       parts.fragment))
