"""What the hostile-input tests (tests/cluster/frontend/hostile/) share besides their cluster:
the deployment's key and body limit, and the checks run after each hostile request."""

from __future__ import annotations

import ray

API_KEY = "sk-hostile-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GRPC_AUTH = (("authorization", f"Bearer {API_KEY}"),)
MAX_BODY_BYTES = 256 * 1024  # room for the 10,000-rule GBNF chain (~150 KB)


def normal_request_works(http, model: str) -> None:
    # ignore_eos: a random model may sample its EOS early; the check is that the server still serves.
    resp = http.post(
        "/v1/completions",
        json={"model": model, "prompt": "Once upon a time", "max_tokens": 3, "temperature": 0, "ignore_eos": True},
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 3


def assert_openai_error(resp, status: int, *words: str) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["type"] and "Traceback" not in error["message"]
    for word in words:
        assert word.lower() in error["message"].lower(), error["message"]
    return error


def ray_get(ref):
    return ray.get(ref, timeout=30)
