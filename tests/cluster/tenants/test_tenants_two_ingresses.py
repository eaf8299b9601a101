"""Tenant limits held across two ingress replicas as Serve runs them: `splitserve serve
--address` into this session's Ray cluster with `--ingress-replicas 2`, HTTP through Ray's
HAProxy, so requests of one tenant land on both replicas, which enforce locally on capacity
leased from the one state store. The requests/min limit holds within the documented bound
(no overshoot; under-use of at most one lease chunk per other replica), the other tenant is
unaffected, and many concurrent long streams are stopped by the budget at admission (never
past it; at most one reservation idle per other replica). The usage read back from the admin
endpoint covers both replicas."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest
import ray
import yaml

from tests.helpers.cluster import wait_until
from tests.helpers.serve_process import ServeProcess

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]
INGRESS_HEADER = "x-splitserve-ingress"
ADMIN = "sk-admin"
RPM = 20
BUDGET = 700  # 3 reservations of prompt + 200 fit, 4 do not
TENANTS = {
    "admin_api_key": ADMIN,
    "tenant_sync_s": 0.2,
    "tenants": [
        # A fresh tenant for each attempt: a burst across a minute boundary spends in both windows.
        *({"name": f"rpm{i}", "api_keys": [f"sk-rpm{i}"], "requests_per_minute": RPM} for i in range(2)),
        {"name": "free", "api_keys": ["sk-free"]},
        {"name": "budget", "api_keys": ["sk-budget"], "budget_tokens": BUDGET, "budget_period": "month"},
    ],
}


@pytest.fixture(scope="module")
def server(ray_cluster, tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve-tenants")
    config = folder / "serve.yaml"
    config.write_text(yaml.safe_dump(TENANTS))
    proc = ServeProcess(
        tiny_model,
        folder / "serve.log",
        "--address",
        ray.get_runtime_context().gcs_address,
        "--config",
        str(config),
        "--ingress-replicas",
        "2",
        "--prefill-replicas",
        "1",
        "--decode-replicas",
        "1",
        "--prefill.num-kv-blocks",
        "128",
        "--decode.num-kv-blocks",
        "128",
        "--max-model-len",
        "256",
    )
    try:
        with httpx.Client(base_url=proc.base_url, timeout=60) as http:
            wait_until(lambda: len(_ingresses(http)) == 2, None, "two ingress replicas never answered")
    except BaseException:
        proc.stop()
        raise
    yield proc
    proc.stop()
    from ray import serve

    serve.shutdown()


def _ingresses(http: httpx.Client) -> set[str]:
    seen = set()
    for _ in range(8):
        res = http.get("/health")
        if res.status_code == 200 and res.json()["decode_replicas"] == 1:
            seen.add(res.headers[INGRESS_HEADER])
    return seen


def _complete(base_url: str, key: str, **body) -> httpx.Response:
    # A new connection per request, so HAProxy spreads them over both replicas.
    with httpx.Client(base_url=base_url, timeout=120) as http:
        return http.post(
            "/v1/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": "unused", "prompt": "Once upon a time", "max_tokens": 1, **body},
        )


def test_requests_per_minute_hold_across_two_ingresses(server):
    model = _model(server)
    for attempt in range(2):  # once more if a minute boundary fell inside the burst
        minute = int(time.time() // 60)
        key = f"sk-rpm{attempt}"
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            rpm = list(pool.map(lambda _, key=key: _complete(server.base_url, key, model=model), range(2 * RPM)))
            free = list(pool.map(lambda _: _complete(server.base_url, "sk-free", model=model), range(10)))
        if int(time.time() // 60) == minute:
            break
    admitted = [r for r in rpm if r.status_code == 200]
    refused = [r for r in rpm if r.status_code != 200]
    # No overshoot; under-use at most one lease chunk (10% of the limit) in the other replica.
    assert RPM - 2 <= len(admitted) <= RPM, [r.status_code for r in rpm]
    assert len({r.headers[INGRESS_HEADER] for r in rpm}) == 2  # both replicas carried and enforced
    assert all(r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded" for r in refused)
    assert all(1 <= int(r.headers["retry-after"]) <= 60 for r in refused)
    assert [r.status_code for r in free] == [200] * 10  # the other tenant is unaffected


def test_budget_stops_many_long_streams_across_two_ingresses(server):
    """8 long streams at once (ignore_eos: each generates all 200 tokens, so nothing is
    refunded) against a budget that 3 reservations fill: the reservations stop them at
    admission, whichever replica each lands on."""
    body = {"model": _model(server), "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}

    def stream(_):
        with httpx.Client(base_url=server.base_url, timeout=120) as client:
            request = {**body, "stream": True, "stream_options": {"include_usage": True}}
            headers = {"Authorization": "Bearer sk-budget"}
            with client.stream("POST", "/v1/completions", headers=headers, json=request) as response:
                if response.status_code != 200:
                    response.read()
                    return response.status_code, response.json()["error"]["code"], None
                events = [line for line in response.iter_lines() if line.startswith("data: {")]
                return 200, None, json.loads(events[-1][len("data: ") :])["usage"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(stream, range(8)))
    admitted = [usage for status, _, usage in results if status == 200]
    # Never past the budget (3 reservations fit); at most one reservation idle in the other replica.
    assert 2 <= len(admitted) <= 3, [status for status, _, _ in results]
    assert all(code == "insufficient_quota" for status, code, _ in results if status != 200)
    assert sum(u["prompt_tokens"] + u["completion_tokens"] for u in admitted) <= BUDGET

    def settled():
        reply = httpx.get(
            f"{server.base_url}/admin/usage", params={"tenant": "budget"}, headers={"Authorization": f"Bearer {ADMIN}"}
        )
        rows = reply.json()["data"]
        return rows and rows[0]["requests"] == len(admitted) and rows[0]

    row = wait_until(settled, None, "both replicas' usage not written")
    assert row["completion_tokens"] == sum(u["completion_tokens"] for u in admitted) == 200 * len(admitted)
    assert row["prompt_tokens"] == sum(u["prompt_tokens"] for u in admitted)


def _model(server) -> str:
    return httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": "Bearer sk-free"}).json()["data"][0][
        "id"
    ]
