"""vLLM's runtime LoRA endpoints: POST /v1/load_lora_adapter {"lora_name", "lora_path"} and
POST /v1/unload_lora_adapter {"lora_name"}, answered by the controller
(cluster/control/lora_adapter_control.py), which changes every replica of both pools and every
ingress's ModelCatalog before it answers.

Who may call them: the API key's holder (RequestGuard checks it, as on every /v1/ path);
with tenants, only the admin key (a tenant's key: 403; without an admin_api_key configured
nobody). Answers: 200 with vLLM's success line; 400 for a bad adapter (its one-line refusal:
a missing file, a rank above --max-lora-rank, another base's shapes, unknown targets) or a
name that is taken; 404 unloading an adapter not loaded; 409 when its requests did not finish
within the unload timeout (it stays loaded).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from splitserve.cluster.frontend.http.caller import Callers
from splitserve.cluster.frontend.http.errors import OpenAIHTTPError

_CODES = {400: None, 404: "not_found", 409: "conflict", 500: None, 503: None}


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # vLLM's clients may send it; the name is what counts


def add_lora_routes(app: FastAPI, backend, callers: Callers, auth: list, responses: dict) -> None:
    """backend: the ServingBackend of the model the adapters sit on (its cluster calls the controller)."""

    def check_admin(request: Request) -> None:
        if callers.tenants is not None and not callers.of(request.scope).is_admin:
            raise OpenAIHTTPError(
                403,
                "loading and unloading LoRA adapters needs the admin key (admin_api_key)",
                error_type="permission_error",
                code="forbidden",
            )

    def answer(outcome: tuple[int, str]) -> PlainTextResponse:
        status, message = outcome
        if status != 200:
            error_type = "server_error" if status >= 500 else "invalid_request_error"
            raise OpenAIHTTPError(status, message, error_type, param="lora_name", code=_CODES.get(status))
        return PlainTextResponse(message)

    @app.post("/v1/load_lora_adapter", dependencies=auth, responses=responses)
    async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> PlainTextResponse:
        check_admin(request)
        return answer(await backend.cluster.load_lora_adapter(body.lora_name, body.lora_path))

    @app.post("/v1/unload_lora_adapter", dependencies=auth, responses=responses)
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request) -> PlainTextResponse:
        check_admin(request)
        return answer(await backend.cluster.unload_lora_adapter(body.lora_name))
