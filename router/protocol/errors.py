"""Errors: ``RequestError`` (a refused request, naming its field) and OpenAI's error body.

A ``RequestError`` carries the offending field as ``param``, set where it is raised; an
error body is ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's), and a
pydantic validation error becomes one naming its first offending field
(``validation_error_response``).
"""

from __future__ import annotations

import reprlib
from collections.abc import Sequence

from pydantic import BaseModel, ValidationError

INTERNAL_ERROR = "internal error; the server has logged it"  # all a client learns of a bug
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error",
                500: "internal_server_error", 503: "service_unavailable"}


class RequestError(Exception):
    """A request the server refuses: ``status`` (HTTP code), ``message``, and ``param``, the
    offending field (e.g. ``max_tokens``, ``messages[0].role``; None when no one field is
    at fault), given by the code that raises it. The HTTP API answers it as an error body
    (``error_response``), the gRPC API as a status whose details are ``message``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


class ErrorInfo(BaseModel):
    """``message``, ``type`` (e.g. ``invalid_request_error``), ``param``, ``code``."""

    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


def error_response(status: int, message: str, param: str | None = None,
                   type: str | None = None, code: int | str | None = None) -> ErrorResponse:
    """An ``ErrorResponse``; ``type`` defaults from the HTTP ``status`` (400 ->
    ``invalid_request_error``) and ``code`` to the status, as vLLM sends it (OpenAI's own
    codes, such as ``invalid_api_key``, where one fits)."""
    err_type = type or _ERROR_TYPES.get(status, "server_error" if status >= 500 else
                                        "invalid_request_error")
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param,
                                         code=status if code is None else code))


def validation_error_response(exc: ValidationError | Sequence[dict]) -> ErrorResponse:
    """A 400 ``ErrorResponse`` for a pydantic ``ValidationError`` (or FastAPI's
    ``RequestValidationError.errors()``), naming the first offending field as ``param``,
    e.g. ``max_tokens`` or ``messages[0].role`` (pydantic's ``loc``, a structured path,
    not the message)."""
    errors = exc.errors() if isinstance(exc, ValidationError) else list(exc)
    first = errors[0]
    param = _param_from_loc(first.get("loc", ()))
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")
    shown = _SHORT_REPR.repr(first.get("input"))
    if len(shown) > 60:
        shown = shown[:57] + "..."
    where = f"'{param}'" if param else "the request body"
    return error_response(400, f"Invalid value for {where}: {msg} (got {shown})", param)


_SHORT_REPR = reprlib.Repr()  # bounded work even for a 16 MiB input
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = 60


def _param_from_loc(loc: Sequence[str | int]) -> str | None:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif item == "body" and not parts:
            continue
        elif "[" in item or item in ("str", "int", "float", "bool") or "-" in item:
            continue  # pydantic's union member tags, not field names
        else:
            parts.append(("." if parts else "") + item)
    return "".join(parts) or None
