"""bench/hostile_input.py's request mix against the real HTTP app (fake backend, real uvicorn
with the header-timeout protocol): every case gets the answer the server promises."""

from __future__ import annotations

import tempfile

import pytest

from splitserve.bench.hostile_input import rss_by_role
from splitserve.bench.hostile_workload import HOSTILE_EXTRAS, Workload
from splitserve.cluster.config import ServeConfig
from splitserve.cluster.frontend.http.api import build_http_app
from splitserve.cluster.frontend.http.header_timeout import with_timeout
from tests.helpers.http_api import MODEL_NAME, FakeBackend, ServerThread, tiny_tokenizer

TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def workload():
    backend = FakeBackend(tiny_tokenizer(tempfile.mkdtemp()), ServeConfig(http_request_timeout_s=TIMEOUT_S))
    with ServerThread(build_http_app(backend), http=with_timeout(TIMEOUT_S)) as server:
        load = Workload(server.url, MODEL_NAME, seed=1, timeout_s=30)
        yield load
        load.close()


def test_every_case_gets_its_promised_answer(workload):
    assert workload.normal() == 200
    assert workload.distinct_schema() == 200
    assert workload.cancelled_stream() == 200
    assert workload.tool_ref_cycle() == 400
    assert workload.bad_body() == 400
    assert workload.half_request() == 408  # closed by the body timeout
    for extra in HOSTILE_EXTRAS:
        if extra.get("guided_regex") == "[^\\s\\S]":
            continue  # an empty language: refused by the compile check, which the fake backend lacks
        assert workload._complete(**extra) == 400, extra
    for _ in range(20):
        workload.one()
    assert sum(sum(by_status.values()) for by_status in workload.counts.values()) == 20


def test_rss_by_role_names_every_role():
    import os

    assert set(rss_by_role(os.getpid())) == {"decode", "prefill", "ingress", "grammar workers"}
