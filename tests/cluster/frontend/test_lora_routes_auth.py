"""Who may load and unload LoRA adapters at runtime where tenants exist: the admin key only. A
tenant's key is 403 (it may still generate), no key or an unknown one 401, and only the admin's
calls reach the controller; the controller's answer becomes the HTTP status (404 unknown
adapter, 409 still in use). The real HTTP app and TenantGate on SQLite over a scripted
FakeBackend, whose cluster stands in for the controller (tests/cluster/test_lora_runtime_serving.py
runs the whole path on Ray)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.frontend.http.api import build_http_app
from splitserve.cluster.state.database import open_state_engine, state_database_url
from splitserve.cluster.tenants.tenant_gate import TenantGate
from splitserve.cluster.tenants.tenant_metrics import TenantMetrics
from tests.helpers.http_api import MODEL_NAME, FakeBackend, tiny_tokenizer

ADMIN = "sk-admin"
TENANTS = [{"name": "team-a", "api_keys": ["sk-a"]}]


class _Controller:
    """What the ingress's cluster forwards to: records the calls, answers as told."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.unload_answer = (200, "Success")

    async def load_lora_adapter(self, name: str, path: str) -> tuple[int, str]:
        self.calls.append(("load", name, path))
        return 200, f"Success: LoRA adapter '{name}' added successfully."

    async def unload_lora_adapter(self, name: str) -> tuple[int, str]:
        self.calls.append(("unload", name))
        return self.unload_answer


@pytest.fixture
def app(tmp_path):
    cfg = ServeConfig.model_validate(
        {"tenants": TENANTS, "admin_api_key": ADMIN, "state_dir": str(tmp_path), "enable_lora": True}
    )
    backend = FakeBackend(tiny_tokenizer(tmp_path / "tok"), cfg)
    engine = open_state_engine(state_database_url(cfg.state_dir, cfg.state_url))
    backend.tenants = TenantGate(cfg, engine, "ingress-a", TenantMetrics(CollectorRegistry()))
    backend.cluster = _Controller()
    with TestClient(build_http_app(backend)) as client:
        yield client, backend.cluster
    asyncio.run(backend.tenants.close())
    engine.dispose()


def _post(client, path: str, key: str | None, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return client.post(path, json=body, headers=headers)


def test_only_the_admin_key_loads_and_unloads_adapters(app):
    client, controller = app
    load = {"lora_name": "sql", "lora_path": "/adapters/sql"}
    assert _post(client, "/v1/load_lora_adapter", None, load).status_code == 401
    assert _post(client, "/v1/load_lora_adapter", "sk-wrong", load).status_code == 401
    refused = _post(client, "/v1/load_lora_adapter", "sk-a", load)
    assert refused.status_code == 403 and "admin key" in refused.json()["error"]["message"]
    assert _post(client, "/v1/unload_lora_adapter", "sk-a", {"lora_name": "sql"}).status_code == 403
    assert controller.calls == []
    # The tenant's key still generates; the admin key does not (it runs nothing).
    completion = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
    assert _post(client, "/v1/completions", "sk-a", completion).status_code == 200
    assert _post(client, "/v1/completions", ADMIN, completion).status_code == 401

    loaded = _post(client, "/v1/load_lora_adapter", ADMIN, load)
    assert loaded.status_code == 200 and "sql" in loaded.text
    controller.unload_answer = (409, "the LoRA adapter 'sql' is still in use; it stays loaded")
    busy = _post(client, "/v1/unload_lora_adapter", ADMIN, {"lora_name": "sql"})
    assert busy.status_code == 409 and busy.json()["error"]["message"].endswith("it stays loaded")
    controller.unload_answer = (404, "the LoRA adapter 'sql' is not loaded")
    assert _post(client, "/v1/unload_lora_adapter", ADMIN, {"lora_name": "sql"}).status_code == 404
    assert _post(client, "/v1/load_lora_adapter", ADMIN, {"lora_name": "x"}).status_code == 400  # no lora_path
    assert controller.calls == [("load", "sql", "/adapters/sql"), ("unload", "sql"), ("unload", "sql")]
