"""The HTTP API's admin routes (``router/api_keys.py`` lets only operators call them):
``GET /admin/pools`` and ``POST /admin/scale`` (``pdserve scale``), and
``GET /metrics/targets`` (the workers' metrics, for Prometheus's HTTP service discovery).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, StrictInt

from pdserve.router.http_guard import json_body
from pdserve.router.protocol import RequestError
from pdserve.router.served_models import ServedModels


class ScaleRequest(BaseModel):
    """``POST /admin/scale``: the pool sizes wanted (workers) of ``model`` (needed when
    the cluster serves several); a pool left out keeps its size."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = None

    prefill_workers: StrictInt | None = None
    decode_workers: StrictInt | None = None


def add_admin_routes(app: FastAPI, routers: ServedModels, scalers: Mapping[str, Any] | None,
                     max_body_bytes: int) -> None:
    """Add, in this order, ``GET /admin/pools``, ``POST /admin/scale`` and ``GET
    /metrics/targets`` to ``app``. ``scalers``: the pools' owner of each model by name
    (``entrypoints/scaling.py``'s ``PoolScaler``); without them the pool routes answer
    501. A scale body over ``max_body_bytes`` gets a 413."""

    def need_scaler(model: str | None):
        if scalers is None:
            raise RequestError("pool scaling needs the workers' owner: `pdserve serve` "
                               "(Ray); this router was started without one", status=501)
        if model is None and len(routers) > 1:
            raise RequestError(f"this cluster serves {len(routers)} models: name one in "
                               "'model'", "model")
        return scalers[routers.pick(model).served_model_name]

    @app.get("/admin/pools")
    async def pools(model: str | None = None) -> Response:
        """The pool sizes ``pdserve serve`` keeps (workers per pool) of ``model``."""
        sizes = need_scaler(model).sizes()
        return JSONResponse({f"{role}_workers": n for role, n in sizes.items()})

    @app.post("/admin/scale")
    async def scale(raw: Request) -> Response:
        """Resize a model's pools; answers once new workers serve and removed ones have
        drained (minutes, when a model loads). An admin endpoint (``router/api_keys.py``)."""
        request = ScaleRequest.model_validate(await json_body(raw, max_body_bytes))
        owner = need_scaler(request.model)
        wanted = {"prefill": request.prefill_workers, "decode": request.decode_workers}
        try:
            sizes = await owner.scale(wanted)
        except ValueError as exc:  # ScaleError: its param names the field, if one
            raise RequestError(str(exc), getattr(exc, "param", None)) from exc
        return JSONResponse({f"{role}_workers": n for role, n in sizes.items()})

    @app.get("/metrics/targets")
    async def metrics_targets() -> Response:
        """Prometheus HTTP service discovery (``http_sd_configs``) of every worker's
        ``/metrics``, from the registry. An admin endpoint: it names internal addresses
        (Prometheus sends the admin API key as ``authorization``)."""
        return JSONResponse([t for r in routers
                             for t in r.pool.metrics_targets(r.served_model_name)])
