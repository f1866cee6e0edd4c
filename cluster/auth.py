"""Cluster authentication (docs/architecture.md, Lifecycle and failure): every internal RPC and
every registry record carries proof of the cluster secret, and, when certificates are
given, the workers' gRPC servers and channels use mutual TLS.

The secret is random bytes that every member of one cluster shares (``pdserve serve``
generates one and hands it to the workers it starts; plain processes read
``--cluster-secret-file`` or ``PDSERVE_CLUSTER_SECRET``). It is never used directly: each
use gets its own key, ``HMAC-SHA256(secret, label)`` (the extract-free form of HKDF's
expand step, RFC 5869), so a token seen on the wire reveals nothing about the registry's
signing key.

- An RPC carries ``x-pdserve-cluster-auth: v2:<unix seconds>:<nonce>:<body>:<mac>`` in its
  metadata: ``nonce`` is 16 random bytes (hex), ``body`` the hex SHA-256 of the serialized
  request message (``stream`` for a method whose requests are a stream), and ``mac`` the
  hex HMAC of ``"v2\\n<method>\\n<ts>\\n<nonce>\\n<body>"``. A server accepts a token only
  within ``TOKEN_WINDOW_S`` of its own clock, only for that method, only with a request whose
  bytes hash to ``body``, and only once: it remembers every nonce it accepted until the
  token's time leaves the window (``NonceCache``), so a replay is refused with the same body
  or another. A streaming request binds the method and the nonce only: the stream's
  messages are protected by mutual TLS (``ClusterTLS``), which also encrypts the RPCs.
- A registry record is signed over its canonical JSON (``sign_record``); the router
  ignores a record it cannot verify.

Secrets come from files or the environment, never from the command line (where ``ps``
shows them).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import heapq
import hmac
import inspect
import logging
import os
import secrets
import stat
import threading
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
TOKEN_WINDOW_S = 60  # seconds a token is valid either side of the server's clock
TOKEN_VERSION = "v2"
STREAM_BODY = "stream"  # a token's body field for a method whose requests are a stream
NONCE_BYTES = 16
MAX_REMEMBERED_NONCES = 1_000_000  # a server's nonce cache: about 220 MB when full
MIN_SECRET_BYTES = 16


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


@dataclass(frozen=True, slots=True)
class TLSFiles:
    """Mutual TLS from PEM files read where the member runs: under ``pdserve serve
    --cluster-ssl-*`` every worker reads the paths on its own node, so each node can hold a
    certificate of its own there (Kubernetes: cert-manager's csi-driver mounts one per pod).
    Renewed files are taken up without a restart: a channel reads them when it opens, and a
    server checks them (their size and modification time) at each new connection.

    Raises ClusterAuthError from ``load`` (and the credential methods) naming the file
    that cannot be read.
    """

    certfile: str
    keyfile: str
    ca_certs: str

    def load(self) -> ClusterTLS:
        return ClusterTLS.from_files(self.certfile, self.keyfile, self.ca_certs)

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server credentials requiring a client certificate from ``ca_certs``, which
        take up renewed files at the next connection (a file that cannot be read then
        keeps the last good ones, with a warning)."""
        import grpc

        def configuration():
            tls = self.load()
            return grpc.ssl_server_certificate_configuration(
                [(tls.private_key, tls.certificate_chain)],
                root_certificates=tls.root_certificates)

        seen = [self._stamp()]

        def fetch():
            stamp = self._stamp()
            if stamp == seen[0]:
                return None
            try:
                renewed = configuration()
            except ClusterAuthError as exc:
                logger.warning("keeping the last TLS certificate: %s", exc)
                return None
            seen[0] = stamp
            return renewed

        return grpc.dynamic_ssl_server_credentials(configuration(), fetch,
                                                   require_client_authentication=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return self.load().channel_credentials()

    def _stamp(self) -> tuple:
        stamps = []
        for path in (self.certfile, self.keyfile, self.ca_certs):
            try:
                info = os.stat(path)
            except OSError:
                stamps.append(None)
                continue
            stamps.append((info.st_mtime_ns, info.st_size))
        return tuple(stamps)


class ClusterAuth:
    """What one cluster member needs to prove itself to the others and check them.

    Args:
        secret: the cluster secret, at least ``MIN_SECRET_BYTES`` bytes.
        tls: mutual TLS for gRPC (this member's certificate and key, in memory or in
            files read where it runs), or None for plain TCP (with tokens).

    Raises:
        ClusterAuthError: the secret is too short.

    Picklable (Ray passes it to worker actors); its repr shows no secret.
    """

    __slots__ = ("_kv_key", "_record_key", "_rpc_key", "tls")

    def __init__(self, secret: bytes, tls: ClusterTLS | TLSFiles | None = None) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ClusterAuthError(f"the cluster secret has {len(secret)} bytes; it needs "
                                   f"at least {MIN_SECRET_BYTES}")
        self._rpc_key = _derive(secret, b"pdserve rpc v2")
        self._record_key = _derive(secret, b"pdserve registry record v1")
        self._kv_key = _derive(secret, b"pdserve kv transfer v1")
        self.tls = tls

    @classmethod
    def generate(cls, tls: ClusterTLS | None = None) -> ClusterAuth:
        """A new cluster with a random 32-byte secret."""
        return cls(secrets.token_bytes(32), tls)

    def with_tls(self, tls: ClusterTLS | TLSFiles | None) -> ClusterAuth:
        """The same secret with ``tls`` (one member's certificate) in place of this one's."""
        copy = object.__new__(ClusterAuth)
        for name in ClusterAuth.__slots__:
            setattr(copy, name, getattr(self, name))
        copy.tls = tls
        return copy

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

    def rpc_metadata(self, method: str, request, *, now: float | None = None
                     ) -> tuple[tuple[str, str], ...]:
        """gRPC metadata proving the secret for one call of ``method``
        (``/pdserve.v1.PrefillWorker/Prefill``) with ``request`` (the request message, or
        its serialized bytes; None for a method whose requests are a stream), at unix time
        ``now`` (default: now); pass it as ``metadata=``. Single-use: a server accepts it
        once, with exactly this request, within ``TOKEN_WINDOW_S`` seconds of ``now``."""
        if request is None:
            body = STREAM_BODY
        else:
            data = request if isinstance(request, bytes) else request.SerializeToString()
            body = hashlib.sha256(data).hexdigest()
        when = str(int(time.time() if now is None else now))
        nonce = secrets.token_hex(NONCE_BYTES)
        mac = self._mac(method, when, nonce, body)
        return ((METADATA_KEY, f"{TOKEN_VERSION}:{when}:{nonce}:{body}:{mac}"),)

    def check_rpc(self, method: str, metadata) -> RpcToken | str:
        """The token in ``metadata`` (a call's invocation metadata) if it proves the secret
        for ``method`` now; else why not, in a few words. Checks the version, the time
        window and the MAC; the body digest and the nonce's single use are checked by the
        server interceptor (``server_interceptor``), which sees the request's bytes."""
        token = next((value for key, value in metadata or () if key == METADATA_KEY), None)
        if token is None:
            return "no cluster credentials"
        parts = str(token).split(":")
        if parts[0] != TOKEN_VERSION:
            return f"cluster credentials of version {parts[0][:8]!r}; {TOKEN_VERSION} is required"
        if len(parts) != 5 or not parts[1].isdigit() or not _is_hex(parts[2], NONCE_BYTES) \
                or not (parts[3] == STREAM_BODY or _is_hex(parts[3], 32)):
            return "malformed cluster credentials"
        _, when, nonce, body, mac = parts
        if abs(time.time() - int(when)) > TOKEN_WINDOW_S:
            return f"cluster credentials outside the {TOKEN_WINDOW_S} s clock window"
        if not hmac.compare_digest(mac, self._mac(method, when, nonce, body)):
            return "invalid cluster credentials"
        return RpcToken(int(when), nonce, body)

    def _mac(self, method: str, when: str, nonce: str, body: str) -> str:
        message = f"{TOKEN_VERSION}\n{method}\n{when}\n{nonce}\n{body}".encode()
        return hmac.new(self._rpc_key, message, hashlib.sha256).hexdigest()

    def server_interceptor(self) -> grpc.aio.ServerInterceptor:
        """Refuses, with UNAUTHENTICATED and before the servicer runs, every call without
        valid credentials: a token of another version, method or secret, outside the
        window, replayed (its nonce accepted before), or, for a unary request, minted for
        other request bytes. One check per call; a stream's later messages are not
        checked (mutual TLS protects them)."""
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


def _is_hex(text: str, num_bytes: int) -> bool:
    return len(text) == 2 * num_bytes and all(c in "0123456789abcdef" for c in text)


@dataclass(frozen=True, slots=True)
class RpcToken:
    """A token whose version, time window and MAC checked out: its unix time (seconds),
    nonce and body digest (hex SHA-256 of the request's bytes, or ``STREAM_BODY``)."""

    when: int
    nonce: str
    body: str


class NonceCache:
    """The nonces of the tokens a server accepted, each kept until its token's time leaves
    the window (``when + window_s``), so that a token is accepted at most once. Memory is
    bounded by the calls accepted within twice the window, and at most ``max_size``
    nonces: when full (after dropping expired ones) it refuses new ones, failing closed.
    Thread-safe.
    """

    def __init__(self, window_s: float = TOKEN_WINDOW_S,
                 max_size: int = MAX_REMEMBERED_NONCES) -> None:
        self.window_s = window_s
        self.max_size = max_size
        self._expiry: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._expiry)

    def seen(self, nonce: str) -> bool:
        """Whether ``nonce`` was accepted already (and has not expired)."""
        with self._lock:
            return nonce in self._expiry

    def add(self, token: RpcToken, now: float | None = None) -> str | None:
        """Remember ``token``'s nonce; None if it was new, else why it is refused
        (a replay, or the cache is full)."""
        now = time.time() if now is None else now
        with self._lock:
            while self._heap and self._heap[0][0] < now:
                _, nonce = heapq.heappop(self._heap)
                self._expiry.pop(nonce, None)
            if token.nonce in self._expiry:
                return "replayed cluster credentials (this nonce was accepted before)"
            if len(self._expiry) >= self.max_size:
                return f"too many calls: {self.max_size} nonces within the window"
            expiry = token.when + self.window_s
            self._expiry[token.nonce] = expiry
            heapq.heappush(self._heap, (expiry, token.nonce))
            return None


@functools.cache
def _interceptor_class() -> type:
    import grpc

    class ClusterAuthInterceptor(grpc.aio.ServerInterceptor):
        """Checks each call's token before its handler runs (version, window, MAC, that
        its nonce is new) and, for a unary request, the request's bytes against the
        token's digest before the servicer sees it; records the nonce once all passed."""

        def __init__(self, auth: ClusterAuth) -> None:
            self._auth = auth
            self._num_refused = 0
            self.nonces = NonceCache()

        def refused(self, method: str, reason: str) -> str:
            self._num_refused += 1
            if self._num_refused <= 10 or self._num_refused % 1000 == 0:
                logger.warning("refused %s: %s (%d refused so far)", method, reason,
                               self._num_refused)
            return f"{method}: {reason}"

        async def intercept_service(self, continuation, handler_call_details):
            method = handler_call_details.method
            token = self._auth.check_rpc(method, handler_call_details.invocation_metadata)
            if isinstance(token, str):
                return unauthenticated_handler(self.refused(method, token))
            if self.nonces.seen(token.nonce):
                return unauthenticated_handler(self.refused(
                    method, "replayed cluster credentials (this nonce was accepted before)"))
            handler = await continuation(handler_call_details)
            if handler is None:  # NOTE: no such method: grpc answers UNIMPLEMENTED
                return None
            if handler.request_streaming:
                reason = ("cluster credentials for one request message, on a method whose "
                          "requests are a stream") if token.body != STREAM_BODY \
                    else self.nonces.add(token)
                return handler if reason is None else \
                    unauthenticated_handler(self.refused(method, reason))
            if token.body == STREAM_BODY:
                return unauthenticated_handler(self.refused(
                    method, "cluster credentials not bound to the request message"))
            return _bound_handler(handler, token, self, method)

    return ClusterAuthInterceptor


def _bound_handler(handler, token: RpcToken, interceptor, method: str):
    """``handler`` (a unary-request method's) that hashes the request's bytes as grpc
    deserializes them and, before the servicer runs, ends the call with UNAUTHENTICATED
    unless they hash to ``token.body`` and ``token``'s nonce is new."""
    import grpc

    deserialize = handler.request_deserializer

    def hashing_deserializer(data: bytes):
        return hashlib.sha256(data).hexdigest(), \
            (deserialize(data) if deserialize is not None else data)

    async def check(digest: str, context) -> None:
        if not hmac.compare_digest(digest, token.body):
            reason = "cluster credentials minted for another request message"
        else:
            reason = interceptor.nonces.add(token)
        if reason is not None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                interceptor.refused(method, reason))

    if handler.unary_unary is not None:
        behavior = handler.unary_unary

        async def unary_unary(request, context):
            digest, message = request
            await check(digest, context)
            result = behavior(message, context)
            return await result if inspect.isawaitable(result) else result

        return handler._replace(unary_unary=unary_unary,
                                request_deserializer=hashing_deserializer)
    behavior = handler.unary_stream
    if inspect.isasyncgenfunction(behavior):
        async def unary_stream(request, context):
            digest, message = request
            await check(digest, context)
            async for response in behavior(message, context):
                yield response
    else:  # NOTE: a coroutine that writes its responses with context.write
        async def unary_stream(request, context):
            digest, message = request
            await check(digest, context)
            return await behavior(message, context)

    return handler._replace(unary_stream=unary_stream,
                            request_deserializer=hashing_deserializer)


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
    if generated:
        parser.add_argument("--cluster-tls", choices=("off", "auto"), default="off",
                            help="auto: mutual TLS between the router and workers with a "
                                 "certificate authority made in memory at start: the router "
                                 "and each worker get a key and certificate of their own, "
                                 "naming the address they advertise; the CA's key never "
                                 "leaves this process (default: off, or the --cluster-ssl-* "
                                 "files, which each node then reads on its own)")
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
        if getattr(args, "cluster_tls", "off") != "off":
            raise ClusterAuthError("--cluster-tls auto makes its own certificates: drop "
                                   "--cluster-ssl-certfile, --cluster-ssl-keyfile and "
                                   "--cluster-ssl-ca-certs, or --cluster-tls")
        tls = TLSFiles(*tls_files)
        tls.load()  # NOTE: an unreadable file stops us here, naming its flag
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
