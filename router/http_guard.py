"""What stands between a client's bytes and the router's HTTP handlers: the request-body
size limit, strict JSON parsing with a nesting limit, ASCII error bodies, and the middleware
that turns a bug into a clean 500 (issue 12: no request body may cause a 5xx, and none may
drop the connection).
"""

from __future__ import annotations

import json
import logging

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.router.protocol import INTERNAL_ERROR, RequestError, error_response

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 2**20  # a request body beyond this gets 413
MAX_JSON_DEPTH = 64  # nesting of JSON arrays and objects; deeper gets 400


class ErrorJSONResponse(JSONResponse):
    """A JSON response written as ASCII: an error message that quotes the client's input
    renders even when that input has no UTF-8 form (a lone surrogate)."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False,
                          separators=(",", ":")).encode("ascii")


class InternalErrorMiddleware:
    """ASGI middleware: an exception that escapes a handler before its response started
    becomes a 500 OpenAI error saying only "internal error"; its stack goes to the log.

    NOTE: Starlette's ``exception_handler(Exception)`` replies and then re-raises, and
    uvicorn drops the connection; answering here ends the exchange cleanly, so the
    client's keep-alive connection stays usable. Once a response started (a stream),
    the exception is re-raised: the headers are gone, and the stream reports its own.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except ClientDisconnect:  # gone before its body arrived: nothing to answer
            logger.debug("client left during %s %s", scope.get("method"), scope.get("path"))
        except Exception:
            logger.exception("internal error in %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise
            body = error_response(500, INTERNAL_ERROR).model_dump()
            await ErrorJSONResponse(body, status_code=500)(scope, receive, send)


async def json_body(raw: Request, max_body_bytes: int) -> dict:
    """The request's JSON object: at most ``max_body_bytes`` bytes of UTF-8 JSON (no
    ``NaN``/``Infinity``), nested at most ``MAX_JSON_DEPTH`` deep.

    Raises:
        RequestError: 413 for a body over ``max_body_bytes`` (by ``Content-Length`` or as
            read); 400 for a body that is not valid JSON, too deep, or not an object.
    """
    length = raw.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_body_bytes:
        raise _too_large(max_body_bytes)
    chunks, size = [], 0
    async for chunk in raw.stream():
        size += len(chunk)
        if size > max_body_bytes:
            raise _too_large(max_body_bytes)
        chunks.append(chunk)
    value = parse_json(b"".join(chunks))
    if not isinstance(value, dict):
        raise RequestError(f"the request body must be a JSON object, not {type(value).__name__}")
    return value


def _too_large(max_body_bytes: int) -> RequestError:
    return RequestError(f"the request body is larger than {max_body_bytes} bytes", status=413)


def parse_json(body: bytes):
    """``body`` parsed as JSON, strictly: UTF-8 (or UTF-16/32, as ``json.loads`` detects),
    no ``NaN``/``Infinity``, no number over 4300 digits, nested at most ``MAX_JSON_DEPTH``.

    Raises:
        RequestError: 400, saying what is wrong (never a RecursionError).
    """
    def no_constants(name: str):
        raise ValueError(f"{name} is not a JSON value")

    try:
        value = json.loads(body, parse_constant=no_constants)
    except json.JSONDecodeError as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}") from None
    except UnicodeDecodeError:
        raise RequestError("the request body is not valid JSON: it is not UTF-8") from None
    except RecursionError:
        raise RequestError(f"the request body is not valid JSON: it is nested more than "
                           f"{MAX_JSON_DEPTH} levels deep") from None
    except ValueError as exc:  # NaN, Infinity, a number of more than 4300 digits
        reason = str(exc) if "JSON value" in str(exc) else "a number has too many digits"
        raise RequestError(f"the request body is not valid JSON: {reason}") from None
    if _nested_deeper(value, MAX_JSON_DEPTH, body):
        raise RequestError(f"the request body is not valid JSON: it is nested more than "
                           f"{MAX_JSON_DEPTH} levels deep")
    return value


def _nested_deeper(value, max_depth: int, body: bytes) -> bool:
    """Whether arrays and objects nest more than ``max_depth`` deep in ``value``, parsed
    from ``body`` (iterative: a deep value must not exhaust the stack here either)."""
    if body.count(b"[") + body.count(b"{") <= max_depth:
        return False  # too few brackets to be that deep
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        for child in children:
            if isinstance(child, (dict, list)):
                if depth + 1 > max_depth:
                    return True
                stack.append((child, depth + 1))
    return False
