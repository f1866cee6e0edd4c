"""The OpenAI-compatible HTTP API of the router (FastAPI): ``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``, ``/health`` (liveness, with the router's state), ``/ready`` (readiness),
``/metrics``, ``/metrics/targets`` (the workers' metrics, for Prometheus's HTTP service
discovery); vLLM's ``/v1/models/{id}``, ``/tokenize``, ``/detokenize`` and ``/version``;
``/admin/scale`` and ``/admin/pools`` (``pdserve scale``).

Every error is an OpenAI error body (``router/protocol/errors.py``): 401 without an accepted API
key where keys are set, 403 on an admin endpoint for a client key or, with no admin key,
a client not on loopback (``router/api_keys.py``), 400 naming the offending
field for invalid JSON or values, 404 for an unknown model or path, 413 for a body over
``max_body_bytes``, 503 with ``Retry-After`` when no worker can take the request, and 500
("internal error", nothing more) for a bug, whose stack goes to the log; the connection
stays open after every one of them. Streams are server-sent events,
``data: {json}\\n\\n`` chunks ending with ``data: [DONE]\\n\\n``; a stream is started only
once its first token arrived, so errors before it are plain HTTP errors.

The routes are added in groups: the OpenAI and vLLM ones (``router/http_openai.py``,
answers written by ``router/http_format.py``), the service's state (here) and the admin
ones (``router/http_admin.py``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve import __version__ as pdserve_version
from pdserve.router.api_keys import AdminAuth, ApiKeyAuth, ApiKeyMiddleware
from pdserve.router.config import HTTPLimits
from pdserve.router.grpc_server import GRPCServerMetrics
from pdserve.router.http_admin import add_admin_routes
from pdserve.router.http_guard import (
    MAX_BODY_BYTES,
    ErrorJSONResponse,
    InternalErrorMiddleware,
)
from pdserve.router.http_openai import add_openai_routes
from pdserve.router.http_server import HTTPServerMetrics
from pdserve.router.model_service import ModelService
from pdserve.router.protocol import (
    INTERNAL_ERROR,
    RequestError,
    error_response,
    validation_error_response,
)
from pdserve.router.served_models import ServedModels

# NOTE: the formatters moved to router/http_format.py; importers of this module find them here
__all__ = ["build_app"]

logger = logging.getLogger(__name__)


def build_app(router: ModelService | Sequence[ModelService], *, max_body_bytes: int = MAX_BODY_BYTES,
              api_auth: ApiKeyAuth | None = None, admin_auth: AdminAuth | None = None,
              scaler=None,
              background: Sequence[Callable[[], Awaitable[None]]] = (),
              http_timeouts: HTTPLimits | None = None) -> FastAPI:
    """The FastAPI app serving ``router``, or several routers, one per model (their
    ``served_model_name``s distinct; a request's ``model`` picks one, the first when it
    names none); its lifespan starts and stops them.

    ``scaler`` (``entrypoints/scaling.py``'s ``PoolScaler``, from ``pdserve serve``; with
    several models a dict of them by model name) resizes the pools behind ``POST
    /admin/scale``; without one, ``/admin/*`` answers 501 (a router run alone does not
    own its workers). ``background``: coroutine functions run as tasks while the router
    serves (started after it, cancelled before it stops), such as the SLO planner's loop.

    ``max_body_bytes`` bounds a request body (413 beyond it, from ``Content-Length`` or
    while reading). With ``api_auth``, every path but its public ones needs one of its
    API keys (401 otherwise, ``router/api_keys.py``); it is kept as ``app.state.api_auth``,
    so that a gRPC server started beside the app can take the same keys. The admin
    endpoints (``/admin/*``, ``/metrics/targets``) take ``admin_auth``'s keys only, or
    with none (the default) answer loopback clients only (403 otherwise); kept as
    ``app.state.admin_auth``.

    ``http_timeouts`` (default ``HTTPLimits()``) bound how long a request may take to
    arrive; kept as ``app.state.http_timeouts`` beside ``app.state.http_metrics`` for the
    server that ``router/http_server.py``'s ``uvicorn_config`` makes for the app.
    ``app.state.grpc_metrics`` (shown on ``/metrics``) is for a gRPC server beside it.

    Raises:
        ValueError: no router, or two serving the same model name.
    """
    routers = ServedModels([router] if isinstance(router, ModelService) else list(router))
    scalers = scaler if isinstance(scaler, Mapping) or scaler is None else \
        {routers.first.served_model_name: scaler}
    app = FastAPI(title="pdserve router", lifespan=_lifespan(routers, background))
    _add_error_handlers(app, routers.first)
    app.add_middleware(InternalErrorMiddleware)
    app.state.api_auth = api_auth
    app.state.admin_auth = admin_auth = admin_auth or AdminAuth()
    app.state.http_timeouts = http_timeouts or HTTPLimits()
    app.state.http_metrics = http_metrics = HTTPServerMetrics()
    # NOTE: on /metrics with the HTTP server's, from the start: a gRPC server started
    # beside the app (entrypoints/serve.py's run_router) counts in it
    app.state.grpc_metrics = GRPCServerMetrics(http_metrics.registry)
    # NOTE: added last, so it runs first: before anything else
    app.add_middleware(ApiKeyMiddleware, auth=api_auth, admin=admin_auth)
    add_openai_routes(app, routers, max_body_bytes)
    _add_status_routes(app, routers, http_metrics)
    add_admin_routes(app, routers, scalers, max_body_bytes)
    return app


def _lifespan(routers: ServedModels, background: Sequence[Callable[[], Awaitable[None]]]):
    """The app's lifespan: start ``routers``, then run ``background`` as tasks; on exit
    cancel the tasks (waiting up to 30 s for them), then stop the routers."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        for each in routers:
            await each.start()
        tasks = [asyncio.create_task(fn()) for fn in background]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=30.0)
            for each in routers:
                await each.stop()

    return lifespan


def _add_status_routes(app: FastAPI, routers: ServedModels, http_metrics: HTTPServerMetrics) -> None:
    """Add, in this order, ``GET /version``, ``/health``, ``/ready`` and ``/metrics``."""

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": pdserve_version})

    @app.get("/health")
    async def health() -> Response:
        """Liveness: 200 while the router runs, with its state (``ModelService.health``):
        ``status`` ``ok``, ``degraded`` (Redis unreachable: serving on the last view) or
        ``unavailable`` (no live decode worker); with several models, the worst of theirs
        and each model's under ``models``."""
        return JSONResponse(routers.health())

    @app.get("/ready")
    async def ready() -> Response:
        """Readiness: 200 when a request can be served now (for every model), else 503
        with the state."""
        state = routers.health()
        return JSONResponse(state, status_code=503 if state["status"] == "unavailable" else 200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(routers.exposition(http_metrics.registry),
                        media_type=routers.first.metrics.CONTENT_TYPE)


def _add_error_handlers(app: FastAPI, router: ModelService) -> None:
    """Answer every error as an OpenAI error body (module docstring); a 503 carries
    ``Retry-After`` (``router``'s ``retry_after_s``)."""
    retry_after = {"Retry-After": str(router.config.retry_after_s)}

    def reply(status: int, body: BaseModel) -> JSONResponse:
        return ErrorJSONResponse(body.model_dump(), status_code=status,
                                 headers=retry_after if status == 503 else None)

    @app.exception_handler(RequestError)
    async def on_request_error(request: Request, exc: RequestError) -> JSONResponse:
        if exc.status >= 500 and exc.status != 503:  # a worker's error: details to the log
            logger.error("%s %s failed: %s", request.method, request.url.path, exc.message)
            return reply(exc.status, error_response(exc.status, INTERNAL_ERROR))
        return reply(exc.status, error_response(exc.status, exc.message, exc.param))

    @app.exception_handler(ValidationError)
    async def on_validation_error(request: Request, exc: ValidationError) -> JSONResponse:
        return reply(400, validation_error_response(exc))

    @app.exception_handler(RequestValidationError)
    async def on_request_validation(request: Request, exc: RequestValidationError
                                    ) -> JSONResponse:
        return reply(400, validation_error_response(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"{request.method} {request.url.path}: no such route"
        return reply(exc.status_code, error_response(exc.status_code, message))
