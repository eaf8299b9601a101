"""ModelCatalog: the model names an ingress replica answers to, each resolving to a ServingAPI.

Every model of the deployment registers its ServingBackend under its served name; aliases and
virtual models (any object implementing ServingAPI, cluster/frontend/serving_api.py) register
under their own names the same way. The HTTP and gRPC frontends resolve each request's `model`
here: an unknown name is RequestError(NOT_FOUND, code "model_not_found"), which HTTP answers
404 with OpenAI's error body and gRPC NOT_FOUND. /v1/models lists served() in registration
order; the first name registered is the default (a gRPC request with no model, and what
needs one model's settings, e.g. the deployment-wide cfg).

A LoRA adapter (--lora-modules) is a name of its own too: it resolves to its base model's
ServingAPI, and lora_adapter(name) is what the ModelService sets as the request's
SamplingParams.lora_adapter; /v1/models lists it after the models, with its base as `parent`.
Adapters loaded or unloaded at runtime reach it with the controller's membership view
(set_adapters).
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
        self._adapters: dict[str, str] = {}  # LoRA adapter name -> its base model's name

    @classmethod
    def of(cls, *apis: ServingAPI) -> ModelCatalog:
        """A catalog of these backends, each under its own model_name, and the LoRA adapters
        each one's config serves."""
        catalog = cls()
        for api in apis:
            catalog.register(api.model_name, api)
        for api in apis:
            cfg = getattr(api, "cfg", None)
            for adapter in cfg.lora_modules if cfg is not None and cfg.enable_lora else ():
                catalog.register_adapter(adapter, api.model_name)
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

    def register_adapter(self, name: str, base: str) -> None:
        """Serve the LoRA adapter `name` on the served model `base`. ValueError if the name
        is taken or base is not a served model."""
        if base not in self._apis or base in self._routed:
            raise ValueError(f"LoRA adapter {name!r}: {base!r} is not a served model")
        if not name or name in self._apis or name in self._adapters:
            raise ValueError(f"LoRA adapter {name!r}: the name is empty or already served")
        self._adapters[name] = base

    def set_adapters(self, base: str, names: list[str]) -> None:
        """The LoRA adapters `base` serves now (the controller's view: loaded and unloaded at
        runtime): the ones gone stop resolving, the new ones resolve. A name that is a model's
        is left out (the controller refuses such a load)."""
        for name in [n for n, b in self._adapters.items() if b == base and n not in names]:
            del self._adapters[name]
        for name in names:
            if name not in self._adapters and name not in self._apis:
                self._adapters[name] = base

    def lora_adapter(self, name: str) -> str | None:
        """The adapter a request for `name` runs with (None: a model, alias or route)."""
        return name if name in self._adapters else None

    def adapters(self) -> list[str]:
        """The LoRA adapters' names, in registration order."""
        return list(self._adapters)

    def parent(self, name: str) -> str | None:
        """The base model of a LoRA adapter (None for anything else): /v1/models' `parent`."""
        return self._adapters.get(name)

    def resolve(self, name: str) -> ServingAPI:
        """The ServingAPI serving `name`; RequestError(NOT_FOUND, param "model", code
        "model_not_found") when nothing does."""
        api = self._apis.get(name) or self._apis.get(self._adapters.get(name, ""))
        if api is None:
            raise RequestError(
                ErrorKind.NOT_FOUND,
                f"the model {echoed(name)} does not exist; this server serves {', '.join(map(repr, self.served()))}",
                param="model",
                code=MODEL_NOT_FOUND,
            )
        return api

    def served(self) -> list[str]:
        """Every name registered, in registration order, then the LoRA adapters (what
        /v1/models lists)."""
        return [*self._apis, *self._adapters]

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
