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

Keys are compared as SHA-256 digests with ``hmac.compare_digest``, against every key
each time: how long a check takes says nothing of how close a guess was, nor which key
matched.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import grpc
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.cluster.auth import unauthenticated_handler
from pdserve.router.flags import DEFAULT_PUBLIC_ENDPOINTS
from pdserve.router.http_guard import ErrorJSONResponse
from pdserve.router.protocol import error_response

logger = logging.getLogger(__name__)

ENV_VARS = ("PDSERVE_API_KEY", "VLLM_API_KEY")  # read in this order, when no flag gives a key
GRPC_SERVICE = "pdserve.v1.Router"
MISSING_KEY = ("Missing API key: send it in the Authorization header as 'Bearer <key>'.")
MALFORMED_KEY = ("Malformed Authorization header: it must be 'Bearer <key>', "
                 "given once.")
INVALID_KEY = "Invalid API key."


def check_api_key(key: str) -> str:
    """``key`` itself, when it can be sent in an HTTP header and in gRPC metadata: not
    empty, printable ASCII without spaces (as a bearer token is).

    Raises:
        ValueError: saying what is wrong, never showing the key.
    """
    if not key:
        raise ValueError("the API key is empty")
    if not all("!" <= ch <= "~" for ch in key):
        raise ValueError("an API key must be printable ASCII without spaces (as sent in "
                         "'Authorization: Bearer <key>')")
    return key


def read_api_key_file(path: str) -> list[str]:
    """The keys in the file ``path``: one per non-empty line, surrounding whitespace
    removed.

    Raises:
        ValueError: the file cannot be read, is not UTF-8, holds no key, or a line is not a
            valid key (``check_api_key``); the message names the path and the line.
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text") from None
    keys = [_named(f"{path}, line {number}", check_api_key, line.strip())
            for number, line in enumerate(lines, 1) if line.strip()]
    if not keys:
        raise ValueError(f"{path} holds no API key (one key per non-empty line)")
    return keys


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
    environ = os.environ if environ is None else environ
    keys = [_named("--api-key", check_api_key, key) for key in cli_keys]
    sources = ["--api-key"] if keys else []
    if key_file is not None:
        keys += _named("--api-key-file", read_api_key_file, key_file)
        sources.append("--api-key-file")
    if keys:
        return keys, ", ".join(sources)
    for name in ENV_VARS:
        if name in environ:
            return [_named(name, check_api_key, environ[name])], name
    return [], None


def _named(source: str, check, value):
    """``check(value)``, its ValueError prefixed with ``source``."""
    try:
        return check(value)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


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
        """Accept each of ``keys`` (checked with ``check_api_key``).

        Raises:
            ValueError: no key, or one that ``check_api_key`` refuses.
        """
        digests = tuple(_digest(check_api_key(key).encode("ascii")) for key in keys)
        if not digests:
            raise ValueError("ApiKeyAuth needs at least one API key")
        return cls(digests, frozenset(public_paths))

    def is_public(self, path: str) -> bool:
        """Whether the HTTP ``path`` (exactly, no prefix) is served without a key."""
        return path in self.public_paths

    def check(self, authorization: list[bytes]) -> str | None:
        """None when the ``Authorization`` values (every one the request carries) are
        exactly one ``Bearer <key>`` with an accepted key (the scheme's case does not
        matter), else why not: ``MISSING_KEY``, ``MALFORMED_KEY`` or ``INVALID_KEY``."""
        if not authorization:
            return MISSING_KEY
        scheme, _, token = authorization[0].strip().partition(b" ")
        token = token.strip()
        if len(authorization) > 1 or scheme.lower() != b"bearer" or not token:
            return MALFORMED_KEY
        token_digest = _digest(token)
        matched = False
        for digest in self.key_digests:  # NOTE: every key, no early exit: constant time
            matched |= hmac.compare_digest(token_digest, digest)
        return None if matched else INVALID_KEY


def unauthorized_body(reason: str) -> dict:
    """The OpenAI error body of a refused key, e.g. ``{"error": {"message":
    "Invalid API key.", "type": "invalid_request_error", "param": null, "code":
    "invalid_api_key"}}``."""
    return error_response(401, reason, type="invalid_request_error",
                          code="invalid_api_key").model_dump()


class ApiKeyMiddleware:
    """Pure ASGI middleware (it never buffers a response: streams pass straight through)
    that lets an HTTP request reach ``app`` only with an accepted key or on a public path;
    otherwise it answers 401 at once, without reading the body, with
    ``unauthorized_body`` and ``WWW-Authenticate: Bearer``. A WebSocket without a key is
    closed (1008, policy violation) before it is accepted."""

    def __init__(self, app: ASGIApp, auth: ApiKeyAuth) -> None:
        self.app = app
        self.auth = auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self.auth.is_public(scope["path"]):
            await self.app(scope, receive, send)
            return
        reason = self.auth.check([value for name, value in scope["headers"]
                                  if name == b"authorization"])
        if reason is None:
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": reason})
        else:
            response = ErrorJSONResponse(unauthorized_body(reason), status_code=401,
                                         headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Checks the ``authorization: Bearer <key>`` metadata once per call, when it starts
    (no cost per message); a call without an accepted key ends at once with
    UNAUTHENTICATED, before its request is read, whatever its method (an unknown method
    included). ``pdserve.v1.Router/Health`` is public when ``/health`` is public over
    HTTP."""

    def __init__(self, auth: ApiKeyAuth) -> None:
        self.auth = auth
        self.public_methods = frozenset(
            {f"/{GRPC_SERVICE}/Health"} if auth.is_public("/health") else ())

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method in self.public_methods:
            return await continuation(handler_call_details)
        metadata = handler_call_details.invocation_metadata or ()
        reason = self.auth.check([value.encode("ascii", "replace") if isinstance(value, str)
                                  else value for name, value in metadata
                                  if name == "authorization"])
        if reason is None:
            return await continuation(handler_call_details)
        return unauthenticated_handler(reason)

