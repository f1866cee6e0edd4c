"""The served models of one router process: a ``ModelService`` per served model, which a
request's ``model`` picks; their health and metrics are served together (``router/http.py``,
``router/grpc_server.py``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from pdserve.router.model_service import ModelService
from pdserve.router.protocol import RequestError


class ServedModels:
    """The model services of one app, one per model: ``pick`` one by a request's
    ``model``; their health and metrics together.

    Raises:
        ValueError: no service, or two that share a served model name.
    """

    def __init__(self, routers: list[ModelService]) -> None:
        if not routers:
            raise ValueError("build_app needs at least one router")
        self._routers = list(routers)
        # NOTE: every name of a router picks it (vLLM's several --served-model-name)
        self.by_name = {name: r for r in routers for name in r.served_model_names}
        if len(self.by_name) != sum(len(r.served_model_names) for r in routers):
            raise ValueError("two routers serve the same model name")
        self.first = routers[0]

    def __iter__(self):
        return iter(self._routers)

    def __len__(self) -> int:
        return len(self._routers)

    def pick(self, model: str | None) -> ModelService:
        """The router of ``model`` (the first when None).

        Raises:
            RequestError: 404 naming ``model`` when no router serves it.
        """
        if model is None:
            return self.first
        router = self.by_name.get(model)
        if router is None:
            shown = model if len(model) <= 100 else model[:97] + "..."
            raise RequestError(f"The model `{shown}` does not exist.", "model", status=404)
        return router

    def health(self) -> dict:
        """One router's ``health()``; with several, the worst status and each model's."""
        if len(self) == 1:
            return self.first.health()
        states = {r.served_model_name: r.health() for r in self._routers}
        order = ("ok", "degraded", "unavailable")
        worst = max((s["status"] for s in states.values()), key=order.index)
        return {"status": worst, "models": states}

    def exposition(self, *extra: CollectorRegistry) -> bytes:
        """Every router's metrics, and those of the ``extra`` registries (the HTTP
        server's), in one Prometheus text exposition: the families of the same name
        merged (their samples differ by the ``model_name`` label)."""
        if len(self) == 1 and not extra:
            return self.first.metrics.exposition()
        return generate_latest(_MergedRegistry([r.metrics.registry for r in self] +
                                               list(extra)))


class _MergedRegistry:
    """``collect()`` over several ``CollectorRegistry``s, one family per name."""

    def __init__(self, registries) -> None:
        self.registries = registries

    def collect(self):
        families = {}
        for registry in self.registries:
            for family in registry.collect():
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        return list(families.values())
