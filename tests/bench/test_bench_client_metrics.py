"""Tests of `splitserve bench`'s measurements: the metrics computed from synthetic timings, and the
streaming client against tests/helpers/bench_fake_server.py (uvicorn in a thread; the
`fake_server` fixture is in conftest.py)."""

from __future__ import annotations

import math

import pytest

from splitserve.bench.loadgen.client import BenchClient
from splitserve.bench.loadgen.metrics import (
    LatencySummary,
    SloTarget,
    compute_goodput,
    compute_run_metrics,
    meets_slo,
    request_itl_ms,
    slo_attainment,
)
from splitserve.bench.loadgen.metrics_scraper import parse_replica_values
from splitserve.bench.loadgen.records import (
    DEADLINE_ERROR,
    BenchRequest,
    ClientOptions,
    LoadPoint,
    RequestRecord,
    RunResult,
)
from splitserve.bench.loadgen.workloads import (
    MultiTurnWorkload,
    PrefixRepetitionWorkload,
    VocabRange,
)
from tests.helpers.bench_fake_server import FakeServerState, FakeServerThread

VOCAB = VocabRange(100, 5000)


def _record(request_id: str, send: float, chunks: list[float], **kwargs) -> RequestRecord:
    return RequestRecord(
        request_id=request_id,
        num_prompt_tokens_sent=10,
        max_tokens=len(chunks) or 1,
        scheduled_time_s=send,
        send_time_s=send,
        first_token_time_s=chunks[0] if chunks else None,
        chunk_times_s=chunks,
        end_time_s=chunks[-1] if chunks else send + 0.01,
        status=kwargs.pop("status", 200),
        **kwargs,
    )


def test_latency_summary_known_percentiles():
    summary = LatencySummary.of(list(range(1, 101)))
    assert (summary.count, summary.mean, summary.p50) == (100, 50.5, 50.5)
    assert summary.p90 == pytest.approx(90.1) and summary.p99 == pytest.approx(99.01)
    assert LatencySummary.of([]) == LatencySummary(0, None, None, None, None)


def test_run_metrics_from_synthetic_timings():
    records = [
        _record("a", 0.0, [0.1, 0.2, 0.3], prompt_tokens=10, completion_tokens=3, cached_tokens=5),
        _record("b", 0.5, [0.7, 0.75], prompt_tokens=10, completion_tokens=2, cached_tokens=0),
        _record("c", 0.6, [], status=500, error="http_500: boom"),
        _record("d", 0.8, [0.9], error=DEADLINE_ERROR),
    ]
    run = RunResult("cfg", LoadPoint(rate=2.0), "m", "http://x", duration_s=2.0, records=records, num_not_sent=1)
    slo = SloTarget(ttft_ms=150.0, itl_ms=80.0)
    m = compute_run_metrics(run, slo)
    assert (m.num_ok, m.num_failed, m.num_unfinished, m.num_not_sent) == (2, 1, 1, 1)
    assert m.errors_by_kind == {"deadline": 1, "http_500": 1}
    assert m.ttft_ms.count == 2 and m.ttft_ms.mean == pytest.approx(150.0)  # 100 and 200 ms
    assert m.itl_ms.count == 3 and m.itl_ms.p50 == pytest.approx(100.0)  # gaps 100, 100, 50 ms
    assert m.e2e_ms.mean == pytest.approx(275.0)  # 300 and 250 ms
    assert m.tpot_ms.mean == pytest.approx((100.0 + 50.0) / 2)
    assert m.requests_per_s == pytest.approx(1.0) and m.output_tokens_per_s == pytest.approx(2.5)
    assert m.total_cached_tokens == 5 and m.cached_token_share == pytest.approx(0.25)
    # a: TTFT 100 ok, ITL 100 > 80 fails; b: TTFT 200 > 150 fails; c failed; d unfinished (left out)
    assert m.slo_attainment == 0.0
    assert slo_attainment(records, SloTarget(ttft_ms=250.0, itl_ms=120.0)) == pytest.approx(2 / 3)
    no_cache = RunResult("cfg", LoadPoint(rate=1.0), "m", "u", 1.0, [_record("e", 0.0, [0.1])])
    assert compute_run_metrics(no_cache).cached_token_share is None


def test_first_token_stages_per_stage_and_outside():
    local = {"routing": 0.002, "prefill_compute": 0.040}
    remote = {"routing": 0.004, "prefill_compute": 0.030, "handoff": 0.010}
    records = [
        _record("a", 0.0, [0.050, 0.06], first_token_stages=local),  # TTFT 50 ms: 8 ms outside
        _record("b", 0.0, [0.060, 0.07], first_token_stages=remote),  # TTFT 60 ms: 16 ms outside
        _record("c", 0.0, [0.1]),  # reported none (another server): left out
        _record("d", 0.0, [], status=500, error="http_500: boom", first_token_stages=local),  # failed
    ]
    m = compute_run_metrics(RunResult("cfg", LoadPoint(concurrency=2), "m", "u", 1.0, records))
    stages = m.first_token_stages_ms
    assert list(stages) == ["routing", "prefill_compute", "handoff", "outside"]
    assert stages["routing"].count == 2 and stages["routing"].mean == pytest.approx(3.0)
    assert stages["handoff"].count == 1 and stages["handoff"].p50 == pytest.approx(10.0)  # remote only
    assert stages["outside"].count == 2 and stages["outside"].mean == pytest.approx(12.0)
    none = RunResult("cfg", LoadPoint(concurrency=1), "m", "u", 1.0, [_record("e", 0.0, [0.1])])
    assert compute_run_metrics(none).first_token_stages_ms == {}


def test_slo_itl_statistic_p90_versus_mean():
    chunks = [0.05]
    for gap in [0.010] * 19 + [1.0]:
        chunks.append(chunks[-1] + gap)
    record = _record("r", 0.0, chunks)
    assert request_itl_ms(record, "p90") == pytest.approx(10.0)
    assert request_itl_ms(record, "mean") == pytest.approx(59.5)
    assert meets_slo(record, SloTarget(ttft_ms=100.0, itl_ms=50.0, itl_statistic="p90"))
    assert not meets_slo(record, SloTarget(ttft_ms=100.0, itl_ms=50.0, itl_statistic="mean"))
    assert not meets_slo(record, SloTarget(ttft_ms=40.0, itl_ms=50.0))  # TTFT 50 ms > 40
    assert meets_slo(_record("one", 0.0, [0.01]), SloTarget(ttft_ms=20.0, itl_ms=1.0))  # no gaps


def test_goodput_over_a_synthetic_sweep():
    sweep = [(1.0, 1.0), (2.0, 0.97), (4.0, 0.9), (8.0, 0.6), (16.0, None)]
    assert compute_goodput(sweep) == 4.0
    assert compute_goodput(sweep, threshold=0.95) == 2.0
    assert compute_goodput([(1.0, 0.5), (2.0, 0.2)]) is None
    # attainment computed from records feeds straight in
    slo = SloTarget(ttft_ms=100.0, itl_ms=50.0)
    runs = {
        rate: [_record(f"{rate}-{i}", 0.0, [ttft, ttft + 0.01]) for i, ttft in enumerate(ttfts)]
        for rate, ttfts in {1.0: [0.05] * 10, 2.0: [0.05] * 9 + [0.5], 4.0: [0.05] * 8 + [0.5] * 2}.items()
    }
    assert compute_goodput((rate, slo_attainment(records, slo)) for rate, records in runs.items()) == 2.0


def test_client_streams_records_and_errors(fake_server):
    requests = [
        BenchRequest("ok1", tuple(range(200, 240)), max_tokens=5),
        BenchRequest("ok2", tuple(range(200, 240)), max_tokens=3),
        BenchRequest("oov", (100_000, 5), max_tokens=3),
    ]
    options = ClientOptions(base_url=fake_server.url, show_progress=False)
    run = BenchClient(options).run(requests, LoadPoint(concurrency=1), "fake")
    assert run.model == "fake-model" and run.num_not_sent == 0
    by_id = {r.request_id: r for r in run.records}
    ok1, ok2, oov = by_id["ok1"], by_id["ok2"], by_id["oov"]
    assert ok1.ok and ok2.ok and not oov.ok
    assert len(ok1.chunk_times_s) == 5 and ok1.completion_tokens == 5 and ok1.prompt_tokens == 40
    assert ok1.ttft_s >= 0.02 and len(ok1.itl_gaps_s) == 4
    # the server sleeps 20 ms, then 3 ms before each later token (reads may merge chunks, so no
    # single gap has a lower bound, but the last token cannot come sooner)
    assert ok1.chunk_times_s[-1] - ok1.send_time_s >= 0.02 + 4 * 0.003
    assert ok1.cached_tokens == 0 and ok2.cached_tokens == 32  # two full 16-token blocks seen before
    assert oov.status == 400 and oov.error_key == "http_400" and "vocabulary" in oov.error
    chat = BenchClient(ClientOptions(base_url=fake_server.url, endpoint="chat", show_progress=False))
    chat_run = chat.run(requests[:1], LoadPoint(rate=math.inf), "chat")
    assert chat_run.records[0].ok and len(chat_run.records[0].chunk_times_s) == 5  # role chunk skipped
    assert chat.build_payload("m", requests[0])["messages"][0]["content"].count(" ") == 39


def test_client_reads_text_with_unicode_line_breaks_as_one_chunk():
    """U+0085, U+2028 and U+2029 end a line for str.splitlines (and httpx's aiter_lines) but
    not for SSE; JSON sends them raw. A chunk whose text holds them is still one chunk."""
    server = FakeServerThread(FakeServerState(token_text=" t{i}\x85\u2028\u2029\x1c")).start()
    try:
        options = ClientOptions(base_url=server.url, show_progress=False)
        run = BenchClient(options).run([BenchRequest("odd", (5, 6, 7), max_tokens=4)], LoadPoint(concurrency=1))
    finally:
        server.stop()
    (record,) = run.records
    assert record.ok, record.error
    assert len(record.chunk_times_s) == 4 and record.completion_tokens == 4


def test_client_cached_share_and_dependencies(fake_server):
    workload = MultiTurnWorkload(
        num_conversations=2, num_turns=3, first_turn_len=32, user_turn_len=16, max_tokens=16, vocab=VOCAB
    )
    options = ClientOptions(base_url=fake_server.url, show_progress=False)
    run = BenchClient(options).run(workload.generate(seed=99), LoadPoint(concurrency=4), "mt")
    by_id = {r.request_id: r for r in run.records}
    assert all(record.ok for record in run.records) and len(run.records) == 6
    for c in range(2):
        turns = [by_id[f"conv{c}-turn{t}"] for t in range(3)]
        for earlier, later in zip(turns, turns[1:]):
            assert later.send_time_s >= earlier.end_time_s  # next turn waits for the previous one
        assert [t.cached_tokens for t in turns] == [0, 32, 64]
    prefix = PrefixRepetitionWorkload(
        num_prefixes=2, prefix_len=32, suffixes_per_prefix=4, suffix_len=8, max_tokens=2, vocab=VOCAB
    )
    run = BenchClient(options).run(prefix.generate(seed=123), LoadPoint(concurrency=1), "prefix")
    # per group the first request caches nothing, the other 3 hit the 32-token prefix
    assert compute_run_metrics(run).cached_token_share == pytest.approx(2 * 3 * 32 / (8 * 40))


def test_client_wall_time_bound_cancels_in_flight():
    server = FakeServerThread(FakeServerState(ttft_s=0.01, itl_s=0.2)).start()
    try:
        requests = [BenchRequest(f"r{i}", (300, 301, 302), max_tokens=50, arrival_offset_s=0.1 * i) for i in range(10)]
        options = ClientOptions(base_url=server.url, max_seconds=0.5, max_requests=8, show_progress=False)
        run = BenchClient(options).run(requests, LoadPoint(), "slow")
    finally:
        server.stop()
    # Each request streams for 10 s (50 tokens, 0.2 s apart): every one sent was cancelled at the
    # bound, unfinished; none due after 0.5 s was sent (a busy machine may send fewer).
    assert all(record.unfinished for record in run.records)
    assert 1 <= len(run.records) <= 6 and run.num_not_sent == 8 - len(run.records)
    metrics = compute_run_metrics(run, SloTarget(100.0, 100.0))
    assert metrics.num_unfinished == len(run.records) and metrics.slo_attainment is None


def test_parse_replica_values():
    text = 'load{replica="a"} 2\nload{replica="b"} 5\nload{replica="a",pool="x"} 1\nother 9\n'
    assert parse_replica_values(text, "load", "replica") == {"a": 3.0, "b": 5.0}
