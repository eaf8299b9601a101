"""The OpenAI-compatible HTTP frontend against a fake backend: the routes besides the completions
(/v1/models, /health, /ready, /metrics, /openapi.json) and the access log. The `tokenizer`,
`backend` and `client` fixtures are in conftest.py."""

from __future__ import annotations

import json
import logging

import pytest

from tests.helpers.http_api import MODEL_NAME, assert_error

pytestmark = pytest.mark.timeout(60)


def test_models_health_metrics_openapi(client, backend):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL_NAME
    assert models["data"][0]["max_model_len"] == backend.max_model_len
    assert client.get(f"/v1/models/{MODEL_NAME}").json()["id"] == MODEL_NAME
    assert_error(client.get("/v1/models/other"), 404, param="model")
    assert client.get("/health").status_code == 200 and client.get("/health").json()["ok"] is True
    backend.healthy = False
    assert client.get("/health").status_code == 503
    client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2})
    metrics = client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    assert f'splitserve_generation_tokens_total{{model_name="{MODEL_NAME}"}} 2.0' in metrics.text
    schema = client.get("/openapi.json").json()
    assert {"CompletionRequest", "ChatCompletionRequest", "ErrorResponse"} <= set(schema["components"]["schemas"])
    assert "/v1/chat/completions" in schema["paths"]
    request_schemas = json.dumps(
        [schema["components"]["schemas"][n] for n in ("CompletionRequest", "ChatCompletionRequest")]
    )
    assert '"ge"' not in request_schemas and '"minimum": 1' in request_schemas  # real JSON Schema keywords
    assert schema["components"]["schemas"]["CompletionRequest"]["properties"]["model"]["enum"] == [MODEL_NAME]


def test_unhealthy_503_carries_retry_after(client, backend):
    backend.healthy = False
    resp = client.get("/health")
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"


def test_ready_is_serving_at_all_while_health_is_every_pool_at_its_floor(client, backend):
    assert client.get("/ready").status_code == 200  # no "serving" in the state: follows "ok"
    backend.healthy, backend.serving = False, True  # degraded: a pool lost a replica
    assert client.get("/health").status_code == 503
    ready = client.get("/ready")
    assert ready.status_code == 200 and ready.json()["serving"] is True
    backend.serving = False  # nothing can be served
    ready = client.get("/ready")
    assert ready.status_code == 503 and ready.headers["retry-after"] == "1"


def test_access_log_quiets_scrapes_and_names_the_path(client, caplog):
    """Prometheus scrapes and health probes log at DEBUG; every other request at INFO with
    the path the client asked for (a 404 too), its status and duration."""
    caplog.set_level(logging.DEBUG, logger="splitserve.access")
    client.get("/metrics")
    client.get("/health")
    client.get("/v1/no/such/thing")
    client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2})
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "splitserve.access"]
    assert [(level, " ".join(msg.split()[:3])) for level, msg in lines] == [
        (logging.DEBUG, "GET /metrics 200"),
        (logging.DEBUG, "GET /health 200"),
        (logging.INFO, "GET /v1/no/such/thing 404"),
        (logging.INFO, "POST /v1/completions 200"),
    ]
    assert all(msg.endswith("ms") for _, msg in lines)
