"""The HTTP routes about what is served rather than generation: /v1/models (every name in the
ModelCatalog), /health and /ready (per model where there are several), /metrics."""

from __future__ import annotations

import logging
import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from splitserve.cluster.frontend.http.errors import retry_after
from splitserve.cluster.frontend.model_catalog import ModelCatalog
from splitserve.cluster.frontend.openai.responses import ModelCard, ModelList

logger = logging.getLogger(__name__)


def add_model_routes(app: FastAPI, catalog: ModelCatalog, auth: list, errors: dict) -> None:
    created = int(time.time())

    def model_card(name: str) -> ModelCard:
        api = catalog.resolve(name)
        return ModelCard(id=name, created=created, max_model_len=api.max_model_len, parent=catalog.parent(name))

    def health_state() -> dict:
        try:
            return catalog.health()
        except Exception:
            logger.exception("health check failed")
            return {"ok": False, "serving": False, "error": "health check failed"}

    def health_response(state: dict, ok: bool) -> JSONResponse:
        if ok:
            return JSONResponse(state)
        return JSONResponse(state, status_code=503, headers={"Retry-After": retry_after(1.0)})

    @app.get("/health", responses={503: {"description": "a pool is below its floor, or no decode replica is live"}})
    async def health() -> JSONResponse:
        """Every pool at or above its floor; the body gives each pool's live/expected/min (and,
        serving several models, each model's state under `models`)."""
        state = health_state()
        return health_response(state, bool(state.get("ok")))

    @app.get("/ready", responses={503: {"description": "no decode replica is live: nothing can be served"}})
    async def ready() -> JSONResponse:
        """Requests can be served at all, degraded or not (the readiness probe's endpoint)."""
        state = health_state()
        return health_response(state, bool(state.get("serving", state.get("ok"))))

    @app.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
    async def metrics() -> Response:
        # Any model's backend renders the deployment's merged view (every model's series).
        return Response(await catalog.default.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList, dependencies=auth, responses=errors)
    async def list_models() -> ModelList:
        return ModelList(data=[model_card(name) for name in catalog.served()])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, dependencies=auth, responses=errors)
    async def get_model(model_id: str) -> ModelCard:
        return model_card(model_id)  # an unknown one: 404 model_not_found
