"""ModelCatalog: the model names an ingress replica answers to, each resolving to a ServingAPI.

Every model of the deployment registers its ServingBackend under its served name; aliases and
virtual models (any object implementing ServingAPI, cluster/frontend/serving_api.py) register
under their own names the same way. The HTTP and gRPC frontends resolve each request's `model`
here: an unknown name is RequestError(NOT_FOUND, code "model_not_found"), which HTTP answers
404 with OpenAI's error body and gRPC NOT_FOUND. /v1/models lists served() in registration
order; the first name registered is the default (a gRPC request with no model, and what
needs one model's settings, e.g. the deployment-wide cfg).
"""

from __future__ import annotations

from typing import Any

from splitserve.cluster.frontend.serving_api import ServingAPI
from splitserve.cluster.request_error import ErrorKind, RequestError, echoed

MODEL_NOT_FOUND = "model_not_found"  # OpenAI's error code for an unknown model


class ModelCatalog:
    def __init__(self) -> None:
        self._apis: dict[str, ServingAPI] = {}
        self._routed: set[str] = set()  # aliases and virtual models: listed, not health-checked

    @classmethod
    def of(cls, *apis: ServingAPI) -> ModelCatalog:
        """A catalog of these backends, each under its own model_name."""
        catalog = cls()
        for api in apis:
            catalog.register(api.model_name, api)
        return catalog

    def register(self, name: str, api: ServingAPI, routed: bool = False) -> None:
        """Serve `api` under `name`. ValueError if the name is empty or already taken (a config
        error: two things answering to one name). routed: an alias or virtual model, which
        /v1/models lists but /health leaves out (its targets are there already)."""
        if not name:
            raise ValueError("a served model name must not be empty")
        if name in self._apis:
            raise ValueError(f"the model name {name!r} is already served; give each model, alias or route its own name")
        self._apis[name] = api
        if routed:
            self._routed.add(name)

    def resolve(self, name: str) -> ServingAPI:
        """The ServingAPI serving `name`; RequestError(NOT_FOUND, param "model", code
        "model_not_found") when nothing does."""
        api = self._apis.get(name)
        if api is None:
            raise RequestError(
                ErrorKind.NOT_FOUND,
                f"the model {echoed(name)} does not exist; this server serves {', '.join(map(repr, self._apis))}",
                param="model",
                code=MODEL_NOT_FOUND,
            )
        return api

    def served(self) -> list[str]:
        """Every name registered, in registration order (what /v1/models lists)."""
        return list(self._apis)

    def items(self) -> list[tuple[str, ServingAPI]]:
        return list(self._apis.items())

    @property
    def default(self) -> ServingAPI:
        """The first model registered."""
        if not self._apis:
            raise LookupError("the model catalog is empty")
        return next(iter(self._apis.values()))

    def health(self) -> dict[str, Any]:
        """One model: its health, as it is. Several: `ok` when every model is, `serving` when any
        can serve, `models` each one's state, and `pools` keyed "<model>/<pool>" (the gRPC
        health service names of the pools)."""
        served = {name: api for name, api in self._apis.items() if name not in self._routed}
        if len(served) == 1:
            return dict(self.default.health())
        models = {name: dict(api.health()) for name, api in served.items()}
        degraded = [name for name, state in models.items() if not state.get("ok")]
        state: dict[str, Any] = {
            "ok": not degraded,
            "serving": any(s.get("serving", s.get("ok")) for s in models.values()),
            "models": models,
            "pools": {f"{name}/{pool}": p for name, s in models.items() for pool, p in s.get("pools", {}).items()},
        }
        if degraded:
            state["degraded"] = degraded
            state["reason"] = "; ".join(f"{name}: {models[name].get('reason', 'not ok')}" for name in degraded)
        return state
