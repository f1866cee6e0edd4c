"""Client authentication with API keys, as vLLM's ``--api-key`` does it, for the router's
HTTP and gRPC APIs.

Where the keys come from (``load_api_keys``): every ``--api-key`` and every non-empty line
of ``--api-key-file``; with neither, the environment's ``PDSERVE_API_KEY``, else
``VLLM_API_KEY``. With no key anywhere the APIs are open (the quickstart needs no flag).

A client sends one key as ``Authorization: Bearer <key>`` (HTTP) or as the metadata
``authorization: Bearer <key>`` (gRPC). Every HTTP path but the public ones
(``--public-endpoints``, default ``/health,/ready,/metrics``) needs it; a path that does
not exist needs it too, so that a client without a key learns nothing of the routes.
Over gRPC, ``Health`` is public when ``/health`` is, and every other method needs the key.
A missing, malformed or wrong key is refused before anything else happens (the request
body is not read): HTTP 401 with an OpenAI error body (``code: invalid_api_key``) and
``WWW-Authenticate: Bearer``; gRPC UNAUTHENTICATED.

Operators apart from clients (``load_admin_api_keys``, ``AdminAuth``): the admin
endpoints, ``/admin/*`` (``pdserve scale``: they resize the cluster) and
``/metrics/targets`` (it names every worker's internal address), take only an admin key:
every ``--admin-api-key``, every line of ``--admin-api-key-file``, else
``PDSERVE_ADMIN_API_KEY``. A client key there gets 403 (``code: admin_key_required``), no
key or an unknown one 401. An admin key is also accepted wherever a client key is (as
SGLang's ``--admin-api-key`` is: the operator's key is the stronger one), but it never
closes an API that has no client key. With no admin key, the admin endpoints answer only
clients on loopback (127.0.0.0/8, ::1) that came through no proxy (no ``Forwarded``,
``X-Forwarded-For`` or ``X-Real-IP`` header), whatever key they send, and refuse every
other with 403, whatever address the router listens on. No path under them can be made
public (``--public-endpoints`` refuses them). The gRPC API has no admin method.

Keys are compared as SHA-256 digests with ``hmac.compare_digest``, against every key
each time: how long a check takes says nothing of how close a guess was, nor which key
matched.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import grpc
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.cluster.auth import unauthenticated_handler
from pdserve.cluster.bearer_keys import check_key, digest, load_keys, matches
from pdserve.router.config import (
    DEFAULT_PUBLIC_ENDPOINTS,
    check_public_paths,
    is_admin_path,
)
from pdserve.router.http_guard import ErrorJSONResponse
from pdserve.router.protocol import error_response

logger = logging.getLogger(__name__)

ENV_VARS = ("PDSERVE_API_KEY", "VLLM_API_KEY")  # read in this order, when no flag gives a key
ADMIN_ENV_VARS = ("PDSERVE_ADMIN_API_KEY",)  # never a client key's variable
PROXY_HEADERS = (b"forwarded", b"x-forwarded-for", b"x-real-ip")
GRPC_SERVICE = "pdserve.v1.Router"
MISSING_KEY = ("Missing API key: send it in the Authorization header as 'Bearer <key>'.")
MALFORMED_KEY = ("Malformed Authorization header: it must be 'Bearer <key>', "
                 "given once.")
INVALID_KEY = "Invalid API key."
ADMIN_KEY_NEEDED = ("This endpoint needs an admin API key (--admin-api-key); a client API "
                    "key is not accepted here.")
LOOPBACK_ONLY = ("Admin endpoints answer only loopback clients (127.0.0.0/8, ::1, "
                 "not through a proxy) when the router has no admin API key "
                 "(--admin-api-key).")


def load_api_keys(cli_keys: Iterable[str] = (), key_file: str | None = None,
                  environ: Mapping[str, str] | None = None) -> tuple[list[str], str | None]:
    """The API keys and where they came from (for the log), e.g.
    ``(["k1", "k2"], "--api-key, --api-key-file")``, or ``([], None)`` when no source
    gives one: then the APIs are open.

    The flags (``cli_keys``, ``key_file``) together; without them ``PDSERVE_API_KEY``,
    else ``VLLM_API_KEY`` from ``environ`` (default ``os.environ``). A variable that is
    set but empty is an error, not "no key": an unset variable in a launch script must
    not open the API.

    Raises:
        ValueError: a key is empty or invalid, or the file is unusable; the message starts
            with the flag or variable (``PDSERVE_API_KEY: the API key is empty``) and
            names the file and line where there is one.
    """
    return load_keys(cli_keys, key_file, environ, "--api-key", ENV_VARS)


def load_admin_api_keys(cli_keys: Iterable[str] = (), key_file: str | None = None,
                        environ: Mapping[str, str] | None = None
                        ) -> tuple[list[str], str | None]:
    """The admin API keys and where they came from, as ``load_api_keys`` reads the
    client keys: ``--admin-api-key`` (``cli_keys``) and ``--admin-api-key-file``
    (``key_file``) together, else ``PDSERVE_ADMIN_API_KEY``; ``([], None)`` when none
    gives one (then the admin endpoints answer loopback clients only).

    Raises:
        ValueError: as ``load_api_keys``, naming ``--admin-api-key``,
            ``--admin-api-key-file`` or ``PDSERVE_ADMIN_API_KEY``.
    """
    return load_keys(cli_keys, key_file, environ, "--admin-api-key", ADMIN_ENV_VARS)


def _bearer_digest(authorization: list[bytes]) -> bytes | str:
    """The SHA-256 digest of the one ``Bearer <key>`` among the ``Authorization`` values
    (the scheme's case does not matter), else why not: ``MISSING_KEY`` or
    ``MALFORMED_KEY``."""
    if not authorization:
        return MISSING_KEY
    scheme, _, token = authorization[0].strip().partition(b" ")
    token = token.strip()
    if len(authorization) > 1 or scheme.lower() != b"bearer" or not token:
        return MALFORMED_KEY
    return digest(token)


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (a peer's address as the server saw it) is on loopback:
    127.0.0.0/8, ::1, or an IPv4 loopback address mapped into IPv6."""
    if not host:
        return False
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


@dataclass(frozen=True, slots=True)
class ApiKeyAuth:
    """The router's client authentication: the accepted keys (kept as SHA-256 digests
    only, so neither a repr nor a log line shows a key) and the HTTP paths open without
    one. Build it with ``ApiKeyAuth.of(keys, public_paths)``."""

    key_digests: tuple[bytes, ...] = field(repr=False)
    public_paths: frozenset[str] = frozenset(DEFAULT_PUBLIC_ENDPOINTS)

    @classmethod
    def of(cls, keys: Iterable[str],
           public_paths: Iterable[str] = DEFAULT_PUBLIC_ENDPOINTS) -> ApiKeyAuth:
        """Accept each of ``keys`` (checked with ``bearer_keys.check_key``).

        Raises:
            ValueError: no key, one that ``bearer_keys.check_key`` refuses, or an admin path
                (``is_admin_path``) among ``public_paths``.
        """
        digests = tuple(digest(check_key(key).encode("ascii")) for key in keys)
        if not digests:
            raise ValueError("ApiKeyAuth needs at least one API key")
        check_public_paths(public_paths)
        return cls(digests, frozenset(public_paths))

    def is_public(self, path: str) -> bool:
        """Whether the HTTP ``path`` (exactly, no prefix) is served without a key."""
        return path in self.public_paths

    def check(self, authorization: list[bytes], also: tuple[bytes, ...] = ()) -> str | None:
        """None when the ``Authorization`` values (every one the request carries) are
        exactly one ``Bearer <key>`` with an accepted key, or one whose digest is in
        ``also`` (the admin keys), else why not: ``MISSING_KEY``, ``MALFORMED_KEY`` or
        ``INVALID_KEY``."""
        token_digest = _bearer_digest(authorization)
        if isinstance(token_digest, str):
            return token_digest
        matched = matches(token_digest, self.key_digests) | matches(token_digest, also)
        return None if matched else INVALID_KEY


@dataclass(frozen=True, slots=True)
class AdminAuth:
    """Who may use the admin endpoints (module docstring): the holders of an admin key
    (SHA-256 digests only), or with none, loopback clients. ``AdminAuth()`` has no key."""

    key_digests: tuple[bytes, ...] = field(default=(), repr=False)

    @classmethod
    def of(cls, keys: Iterable[str] = ()) -> AdminAuth:
        """Accept each of ``keys`` (checked with ``bearer_keys.check_key``); none: loopback only.

        Raises:
            ValueError: a key that ``bearer_keys.check_key`` refuses.
        """
        return cls(tuple(digest(check_key(key).encode("ascii")) for key in keys))

    @property
    def has_keys(self) -> bool:
        """Whether an admin key is set (else the admin endpoints are loopback-only)."""
        return bool(self.key_digests)

    def check(self, authorization: list[bytes], peer: str | None, proxied: bool,
              client: ApiKeyAuth | None) -> tuple[int, str, str] | None:
        """None when a request may use an admin endpoint, else its refusal as
        ``(HTTP status, message, OpenAI error code)``.

        Args:
            authorization: every ``Authorization`` value the request carries.
            peer: the client's address as the server saw it (``scope["client"][0]``).
            proxied: the request names a forwarded client (``PROXY_HEADERS``).
            client: the client authentication, to tell a client key (403) from an
                unknown one (401).
        """
        if not self.has_keys:
            if is_loopback(peer) and not proxied:
                return None
            return 403, LOOPBACK_ONLY, "admin_loopback_only"
        token_digest = _bearer_digest(authorization)
        if isinstance(token_digest, str):
            return 401, token_digest, "invalid_api_key"
        is_admin = matches(token_digest, self.key_digests)
        is_client = client is not None and matches(token_digest, client.key_digests)
        if is_admin:
            return None
        if is_client:
            return 403, ADMIN_KEY_NEEDED, "admin_key_required"
        return 401, INVALID_KEY, "invalid_api_key"


def unauthorized_body(reason: str) -> dict:
    """The OpenAI error body of a refused key, e.g. ``{"error": {"message":
    "Invalid API key.", "type": "invalid_request_error", "param": null, "code":
    "invalid_api_key"}}``."""
    return error_response(401, reason, type="invalid_request_error",
                          code="invalid_api_key").model_dump()


def forbidden_body(reason: str, code: str) -> dict:
    """The OpenAI error body of a refused admin request, e.g. ``{"error": {"message":
    "This endpoint needs an admin API key ...", "type": "permission_error", "param":
    null, "code": "admin_key_required"}}``."""
    return error_response(403, reason, type="permission_error", code=code).model_dump()


class ApiKeyMiddleware:
    """Pure ASGI middleware (it never buffers a response: streams pass straight through)
    that lets an HTTP request reach ``app`` only when its key fits the path.

    - An admin path (``is_admin_path``) is decided by ``admin`` alone (``AdminAuth``):
      401 (``unauthorized_body``) or 403 (``forbidden_body``) when refused.
    - Any other path: with ``auth`` (client keys), only with one of its keys or of the
      admin keys, or on a public path; otherwise 401 with ``unauthorized_body``. Without
      ``auth`` every such path is open.

    A refusal is sent at once, without reading the body; a 401 carries
    ``WWW-Authenticate: Bearer``. A WebSocket that is refused is closed (1008, policy
    violation) before it is accepted."""

    def __init__(self, app: ASGIApp, auth: ApiKeyAuth | None,
                 admin: AdminAuth | None = None) -> None:
        self.app = app
        self.auth = auth
        self.admin = AdminAuth() if admin is None else admin

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        authorization = [value for name, value in scope["headers"] if name == b"authorization"]
        if is_admin_path(path):
            client = scope.get("client")
            proxied = any(name in PROXY_HEADERS for name, _ in scope["headers"])
            refusal = self.admin.check(authorization, client[0] if client else None,
                                       proxied, self.auth)
        elif self.auth is None or self.auth.is_public(path):
            refusal = None
        else:
            reason = self.auth.check(authorization, also=self.admin.key_digests)
            refusal = None if reason is None else (401, reason, "invalid_api_key")
        if refusal is None:
            await self.app(scope, receive, send)
            return
        status, reason, code = refusal
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": reason})
        elif status == 401:
            response = ErrorJSONResponse(unauthorized_body(reason), status_code=401,
                                         headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
        else:
            response = ErrorJSONResponse(forbidden_body(reason, code), status_code=status)
            await response(scope, receive, send)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Checks the ``authorization: Bearer <key>`` metadata once per call, when it starts
    (no cost per message); a call without an accepted key ends at once with
    UNAUTHENTICATED, before its request is read, whatever its method (an unknown method
    included). ``pdserve.v1.Router/Health`` is public when ``/health`` is public over
    HTTP. The ``admin`` keys are accepted too, as over HTTP; no method is an admin
    one."""

    def __init__(self, auth: ApiKeyAuth, admin: AdminAuth | None = None) -> None:
        self.auth = auth
        self.admin_digests = () if admin is None else admin.key_digests
        self.public_methods = frozenset(
            {f"/{GRPC_SERVICE}/Health"} if auth.is_public("/health") else ())

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method in self.public_methods:
            return await continuation(handler_call_details)
        metadata = handler_call_details.invocation_metadata or ()
        reason = self.auth.check([value.encode("ascii", "replace") if isinstance(value, str)
                                  else value for name, value in metadata
                                  if name == "authorization"], also=self.admin_digests)
        if reason is None:
            return await continuation(handler_call_details)
        return unauthenticated_handler(reason)

