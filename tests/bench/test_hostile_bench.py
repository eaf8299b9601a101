"""bench/serving/hostile_input.py's request mix against the real HTTP app (fake backend, real uvicorn
with the header-timeout protocol): every case gets the answer the server promises."""

from __future__ import annotations

import json
import tempfile

import pytest

from splitserve.bench.serving.hostile_input import main, plot_rss, rss_by_role, rss_summary
from splitserve.bench.serving.hostile_workload import HOSTILE_EXTRAS, HOSTILE_GRPC_EXTRAS, Workload
from splitserve.cluster.config import ServeConfig
from splitserve.cluster.frontend.http.api import build_http_app
from splitserve.cluster.frontend.http.header_timeout import with_timeout
from splitserve.cluster.grpc_connection_config import GrpcConnectionConfig
from tests.helpers import grpc_client
from tests.helpers.http_api import MODEL_NAME, FakeBackend, ServerThread, tiny_tokenizer

TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def workload():
    tokenizer = tiny_tokenizer(tempfile.mkdtemp())
    cfg = ServeConfig(http_request_timeout_s=TIMEOUT_S, grpc=GrpcConnectionConfig(request_timeout_s=TIMEOUT_S))
    grpc_server = grpc_client.FrontendThread(grpc_client.FakeBackend(tokenizer, cfg))
    grpc_server.start()
    try:
        with ServerThread(build_http_app(FakeBackend(tokenizer, cfg)), http=with_timeout(TIMEOUT_S)) as server:
            load = Workload(server.url, MODEL_NAME, seed=1, timeout_s=30, grpc_target=grpc_server.target)
            yield load
            load.close()
    finally:
        grpc_server.close()


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
    # gRPC: status codes by number (OK 0, CANCELLED 1, INVALID_ARGUMENT 3, DEADLINE_EXCEEDED 4)
    assert workload.grpc_normal() == 0
    assert workload.grpc_cancelled_stream() in (0, 1)  # cancelled, unless the whole stream was already in
    assert workload.grpc_request_never_sent() == 4  # the server's grpc.request_timeout_s
    for extra in HOSTILE_GRPC_EXTRAS:
        assert workload._generate(**extra) == 3, extra
    for _ in range(20):
        workload.one()
    assert sum(sum(by_status.values()) for by_status in workload.counts.values()) == 20


def test_rss_by_role_names_every_role():
    import os

    assert set(rss_by_role(os.getpid())) == {"decode", "prefill", "ingress", "grammar workers"}


def test_rss_summary_measures_growth_from_the_end_of_warm_up(tmp_path):
    samples = [
        (0.0, {"decode": 400.0}),
        (60.0, {"decode": 450.0}),
        (120.0, {"decode": 460.0}),
        (180.0, {"decode": 455.0}),
    ]
    summary = rss_summary(samples, warmup_s=60.0)["decode"]
    assert summary == {
        "start": 400.0,
        "after_warmup": 450.0,
        "max_after_warmup": 460.0,
        "end": 455.0,
        "growth_after_warmup": 10.0,
    }
    plot_rss(samples, str(tmp_path / "rss.png"), warmup_s=60.0, bound_mib=32.0)
    assert (tmp_path / "rss.png").read_bytes().startswith(b"\x89PNG")
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"rss_samples": samples}))
    assert main(["--from-results", str(results), "--warmup-s", "60", "--plot", str(tmp_path / "again.png")]) == 0
    assert (tmp_path / "again.png").is_file()
