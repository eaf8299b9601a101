"""Schemathesis-generated requests from /openapi.json against the real HTTP app over a real
tiny 1P+1D cluster (the package's conftest): no 5xx, no crash, and in positive mode no
schema-valid request refused except where the refusal depends on state or on what JSON Schema
cannot state (POSITIVE_REFUSALS). At the end a normal request works and the block pools are
back to baseline.

schemathesis drives the operations through Hypothesis directly (fixed seed, no example
database) so the case count is exact."""

from __future__ import annotations

import os

import hypothesis
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase

from splitserve.cluster.frontend.http.api import build_http_app
from tests.helpers.cluster import wait_for_baseline
from tests.helpers.hostile_cases import POSITIVE_REFUSALS
from tests.helpers.hostile_server import AUTH, normal_request_works

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]
# Cases per (operation, generation mode): chat bodies cost 3x more to generate than
# completion bodies; operations without parameters stop after one.
FUZZ_EXAMPLES = {
    ("POST", "/v1/completions"): {"positive": 330, "negative": 260},
    ("POST", "/v1/chat/completions"): {"positive": 150, "negative": 120},
    ("GET", "/v1/models/{model_id}"): {"positive": 60, "negative": 60},
}
MIN_FUZZ_CASES = 1000
FUZZ_SEED = int(os.environ.get("SPLITSERVE_FUZZ_SEED", "20240611"))


def test_generated_requests_never_get_a_5xx(loop, backend, server, http):
    schema = schemathesis.openapi.from_dict(build_http_app(backend).openapi())
    session = requests.Session()
    counts: dict[str, int] = {}
    statuses: dict[int, int] = {}

    def check(case) -> None:
        case.headers = {**(case.headers or {}), **AUTH}  # reach past the key check (tested below)
        resp = case.call(base_url=server.url, session=session, timeout=60)
        statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
        where = f"{case.method} {case.path} body={str(case.body)[:300]!r}"
        assert resp.status_code < 500, f"{where} -> {resp.status_code} {resp.text[:300]}"
        content_type = resp.headers.get("content-type") or [""]  # schemathesis: name -> values
        if content_type[0].startswith("text/event-stream"):
            # schemathesis stops reading a stream after 20 events (prompts x n choices make more)
            if not resp.stream_cut_short:
                assert resp.text.rstrip().endswith("data: [DONE]"), where
            assert '"server_error"' not in resp.text, f"{where} -> {resp.text[-300:]}"
        return resp

    def check_positive(case) -> None:
        # A request /openapi.json calls valid is served, unless its refusal depends on state
        # or on what JSON Schema cannot state (see POSITIVE_REFUSALS).
        resp = check(case)
        if resp.status_code == 400:  # a 404 for a model id that is not served is no refusal
            message = resp.json()["error"]["message"]
            assert any(reason in message for reason in POSITIVE_REFUSALS), (
                f"schema-valid {case.method} {case.path} body={str(case.body)[:300]!r} -> {resp.status_code} {message}"
            )

    for result in schema.get_all_operations():
        operation = result.ok()
        key = (operation.method.upper(), operation.path)
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            num = FUZZ_EXAMPLES.get(key, {}).get(mode.value, 20)
            checker = check_positive if mode == schemathesis.GenerationMode.POSITIVE else check
            counts[f"{key[0]} {key[1]} {mode.value}"] = fuzz_operation(operation, mode, num, checker)
    total = sum(counts.values())
    print(f"schemathesis: {total} cases, by operation {counts}, by status {dict(sorted(statuses.items()))}")
    assert total >= MIN_FUZZ_CASES, counts
    assert statuses.get(200, 0) >= 100, statuses  # real generations ran, not only refusals
    normal_request_works(http, backend.model_name)
    wait_for_baseline(loop, backend.cluster)


def fuzz_operation(operation, mode, max_examples: int, check) -> int:
    """Run `check` on up to max_examples schemathesis cases of one operation; returns how many."""
    num_cases = 0

    @hypothesis.seed(FUZZ_SEED)
    @hypothesis.settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        print_blob=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case) -> None:
        nonlocal num_cases
        num_cases += 1
        check(case)

    try:
        fuzz()
    except hypothesis.errors.Unsatisfiable:  # no invalid input exists (an operation without parameters)
        assert mode == schemathesis.GenerationMode.NEGATIVE
    return num_cases
