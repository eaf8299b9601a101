"""Tests of `splitserve bench`: workloads, metrics, the streaming client, reports, comparisons.

The client runs against tests/helpers/bench_fake_server.py (uvicorn in a thread, or as a subprocess for
the command configuration of --compare).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from splitserve.bench.arrivals import (  # noqa: E402
    apply_load,
    build_load_points,
    parse_concurrencies,
    parse_rates,
    poisson_arrival_offsets,
)
from splitserve.bench.cli import add_bench_parser, run_bench  # noqa: E402
from splitserve.bench.client import BenchClient, PromptTextRenderer, token_id_to_word  # noqa: E402
from splitserve.bench.managed_server import ManagedServer, ServerStartError, _group_has_live_members  # noqa: E402
from splitserve.bench.metrics import (  # noqa: E402
    LatencySummary,
    SloTarget,
    compute_goodput,
    compute_run_metrics,
    meets_slo,
    request_itl_ms,
    slo_attainment,
)
from splitserve.bench.metrics_scraper import parse_replica_values  # noqa: E402
from splitserve.bench.records import (  # noqa: E402
    DEADLINE_ERROR,
    BenchRequest,
    ClientOptions,
    LoadPoint,
    RequestRecord,
    RunResult,
    ServerConfig,
    ServerConfigError,
    WorkloadError,
)
from splitserve.bench.trace_workload import TraceWorkload, load_mooncake_trace  # noqa: E402
from splitserve.bench.workloads import (  # noqa: E402
    MixedLengthWorkload,
    MultiTurnWorkload,
    PrefixRepetitionWorkload,
    VocabRange,
)
from tests.helpers.bench_fake_server import FakeServerState, FakeServerThread  # noqa: E402

FAKE_SERVER_SCRIPT = Path(__file__).parents[1] / "helpers" / "bench_fake_server.py"
VOCAB = VocabRange(100, 5000)


@pytest.fixture(scope="module")
def fake_server():
    server = FakeServerThread(FakeServerState(ttft_s=0.02, itl_s=0.003)).start()
    yield server
    server.stop()


def _common_prefix_len(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _pid_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ----------------------------------------------------------------------------- workloads


def test_prefix_repetition_groups_share_exactly_the_prefix():
    workload = PrefixRepetitionWorkload(
        num_prefixes=3, prefix_len=20, suffixes_per_prefix=5, suffix_len=7, max_tokens=4, vocab=VOCAB
    )
    requests = workload.generate(seed=11)
    assert requests == workload.generate(seed=11)
    assert requests != workload.generate(seed=12)
    assert len(requests) == 15 and len({r.request_id for r in requests}) == 15
    groups: dict[str, list[BenchRequest]] = {}
    for request in requests:
        assert request.num_prompt_tokens == 27 and request.max_tokens == 4
        assert all(VOCAB.low <= t < VOCAB.high for t in request.prompt_token_ids)
        groups.setdefault(request.group_id, []).append(request)
    assert sorted(len(members) for members in groups.values()) == [5, 5, 5]
    for members in groups.values():
        for i, a in enumerate(members):
            for b in members[i + 1 :]:
                assert _common_prefix_len(a.prompt_token_ids, b.prompt_token_ids) == 20
    firsts = [members[0].prompt_token_ids[0] for members in groups.values()]
    assert len(set(firsts)) == 3  # different groups diverge at the first token
    # shuffled: not grouped in generation order
    assert [r.group_id for r in requests] != sorted(r.group_id for r in requests)


def test_multi_turn_history_grows_and_chains():
    workload = MultiTurnWorkload(
        num_conversations=3, num_turns=4, first_turn_len=10, user_turn_len=5, max_tokens=6, vocab=VOCAB
    )
    requests = workload.generate(seed=3)
    assert requests == workload.generate(seed=3)
    assert [r.turn_index for r in requests] == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
    by_id = {r.request_id: r for r in requests}
    for request in requests:
        assert request.num_prompt_tokens == 10 + request.turn_index * (6 + 5)
        if request.turn_index == 0:
            assert request.depends_on is None
        else:
            previous = by_id[request.depends_on]
            assert previous.conversation_id == request.conversation_id
            assert previous.turn_index == request.turn_index - 1
            assert request.prompt_token_ids[: previous.num_prompt_tokens] == previous.prompt_token_ids


def test_mixed_lengths_follow_the_stated_distribution():
    workload = MixedLengthWorkload(
        num_requests=40, short_len=20, long_len=400, long_fraction=0.1, length_jitter=0.25, max_tokens=3, vocab=VOCAB
    )
    requests = workload.generate(seed=5)
    assert requests == workload.generate(seed=5)
    longs = [r for r in requests if r.group_id == "long"]
    shorts = [r for r in requests if r.group_id == "short"]
    assert len(longs) == 4 and len(shorts) == 36
    assert all(300 <= r.num_prompt_tokens <= 500 for r in longs)
    assert all(15 <= r.num_prompt_tokens <= 25 for r in shorts)
    assert len({r.num_prompt_tokens for r in shorts}) > 3  # lengths are drawn, not constant
    assert MixedLengthWorkload(num_requests=10, long_fraction=0.01).num_long == 1
    with pytest.raises(WorkloadError):
        MixedLengthWorkload(long_fraction=1.5)


def test_trace_hash_ids_give_shared_prefixes(tmp_path: Path):
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 1000, "input_length": 1536, "output_length": 9, "hash_ids": [1, 2, 3]},
        {"timestamp": 1500, "input_length": 1536, "output_length": 4, "hash_ids": [1, 2, 4]},
        {"timestamp": 3000, "input_length": 700, "output_length": 2, "hash_ids": [5]},
    ]
    trace.write_text("\n".join(json.dumps(row) for row in rows) + "\n\n")
    records = load_mooncake_trace(trace)
    workload = TraceWorkload(tuple(records), block_size=4, trace_block_size=512, speedup=2.0, vocab=VOCAB)
    first, second, third = workload.generate(seed=0)
    assert first.prompt_token_ids == workload.generate(seed=0)[0].prompt_token_ids
    assert first.num_prompt_tokens == second.num_prompt_tokens == 12  # 1536 * 4 / 512
    assert _common_prefix_len(first.prompt_token_ids, second.prompt_token_ids) >= 8
    assert first.prompt_token_ids[8:] != second.prompt_token_ids[8:]
    assert first.prompt_token_ids[:4] == tuple(workload.block_tokens(0, 1))
    assert third.num_prompt_tokens == 6  # ceil(700 * 4 / 512): one block + 2 padding tokens
    assert third.prompt_token_ids[:4] == tuple(workload.block_tokens(0, 5))
    assert [r.arrival_offset_s for r in (first, second, third)] == [0.0, 0.25, 1.0]
    assert [r.max_tokens for r in (first, second, third)] == [9, 4, 2]
    capped = TraceWorkload(
        tuple(records), block_size=4, max_prompt_tokens=5, max_output_tokens=3, vocab=VOCAB
    ).generate(seed=0)
    assert [r.num_prompt_tokens for r in capped] == [5, 5, 5]
    assert [r.max_tokens for r in capped] == [3, 3, 2]
    (tmp_path / "bad.jsonl").write_text('{"timestamp": 0, "output_length": 3}\n')
    with pytest.raises(WorkloadError, match="bad.jsonl:1"):
        load_mooncake_trace(tmp_path / "bad.jsonl")


def test_arrivals_and_load_points():
    offsets = poisson_arrival_offsets(4000, rate=50.0, seed=1)
    assert offsets == poisson_arrival_offsets(4000, rate=50.0, seed=1)
    assert offsets[0] == 0.0 and all(b >= a for a, b in zip(offsets, offsets[1:]))
    assert np.mean(np.diff(offsets)) == pytest.approx(1 / 50.0, rel=0.1)
    assert poisson_arrival_offsets(3, math.inf, seed=0) == [0.0, 0.0, 0.0]
    assert parse_rates(["4,1", "inf", "1"]) == [1.0, 4.0, math.inf]
    assert parse_concurrencies(["8", "2,4"]) == [2, 4, 8]
    with pytest.raises(WorkloadError):
        parse_rates(["0"])
    loads = build_load_points([1.0, 2.0], [3], LoadPoint(concurrency=8))
    assert loads == [LoadPoint(rate=1.0, concurrency=3), LoadPoint(rate=2.0, concurrency=3)]
    assert build_load_points([], [], LoadPoint()) == [LoadPoint()]
    requests = PrefixRepetitionWorkload(2, 4, 2, 2, 2, VOCAB).generate(0)
    assert [r.arrival_offset_s for r in apply_load(requests, LoadPoint(concurrency=2), 0)] == [0.0] * 4
    assert apply_load(requests, LoadPoint(rate=5.0), 0)[-1].arrival_offset_s > 0


def test_text_rendering_keeps_prefixes(tmp_path: Path):
    renderer = PromptTextRenderer()
    assert token_id_to_word(0) != token_id_to_word(70)
    assert renderer.render([5, 6, 7]).startswith(renderer.render([5, 6]))
    assert len(renderer.render([5, 6, 7]).split()) == 3
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    assert PromptTextRenderer(tmp_path).render([1, 2, 1]) == "hello world hello"
    with pytest.raises(FileNotFoundError):
        PromptTextRenderer(tmp_path / "missing")


# ----------------------------------------------------------------------------- metrics


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


# ----------------------------------------------------------------------------- client


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
        started = time.monotonic()
        run = BenchClient(options).run(requests, LoadPoint(), "slow")
        assert time.monotonic() - started < 3.0
    finally:
        server.stop()
    assert all(record.unfinished for record in run.records)
    assert 3 <= len(run.records) <= 6 and run.num_not_sent == 8 - len(run.records)
    metrics = compute_run_metrics(run, SloTarget(100.0, 100.0))
    assert metrics.num_unfinished == len(run.records) and metrics.slo_attainment is None


def test_parse_replica_values():
    text = 'load{replica="a"} 2\nload{replica="b"} 5\nload{replica="a",pool="x"} 1\nother 9\n'
    assert parse_replica_values(text, "load", "replica") == {"a": 3.0, "b": 5.0}


# ----------------------------------------------------------------------------- compare / servers


def test_server_config_parse():
    assert ServerConfig.parse("ours=http://127.0.0.1:9/").url == "http://127.0.0.1:9"
    config = ServerConfig.parse("vllm=python -m x --port {port}")
    assert config.command == "python -m x --port {port}" and config.url is None
    for bad in ("noequals", "=http://x", "x=python serve.py", "bad name=http://x"):
        with pytest.raises(ServerConfigError):
            ServerConfig.parse(bad)


def test_managed_server_failures_and_escalation(tmp_path: Path):
    failing = ManagedServer("exit 3 # {port}", startup_timeout_s=10, log_path=tmp_path / "fail.log")
    with pytest.raises(ServerStartError, match="exited with code 3"):
        failing.start()
    pid_file = tmp_path / "stubborn.pid"
    stubborn = ManagedServer(
        f"{sys.executable} {FAKE_SERVER_SCRIPT} --stubborn --port {{port}} --pid-file {pid_file}",
        startup_timeout_s=20,
        stop_timeout_s=0.5,
    )
    stubborn.start()
    server_pid = int(pid_file.read_text())
    started = time.monotonic()
    stubborn.stop()
    # SIGINT and SIGTERM are ignored, so only SIGKILL (after 2 x 0.5 s) ends it
    assert time.monotonic() - started >= 1.0
    assert not _pid_alive(server_pid) and not _group_has_live_members(stubborn.pid)


def _bench_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="splitserve")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


SMALL_WORKLOAD = [
    "--num-prefixes",
    "2",
    "--prefix-len",
    "32",
    "--suffixes-per-prefix",
    "3",
    "--suffix-len",
    "8",
    "--max-tokens",
    "6",
    "--vocab-range",
    "100:5000",
    "--no-progress",
]


def test_run_bench_end_to_end(fake_server, tmp_path: Path):
    out = tmp_path / "out"
    args = _bench_args(
        [
            "--url",
            fake_server.url,
            *SMALL_WORKLOAD,
            "--rate",
            "20",
            "--rate",
            "40,inf",
            "--ttft-slo-ms",
            "1000",
            "--itl-slo-ms",
            "200",
            "--out",
            str(out),
            "--scrape-metric",
            "fake_requests_in_flight",
            "--scrape-interval",
            "0.05",
        ]
    )
    assert run_bench(args) == 0
    results = json.loads((out / "results.json").read_text())
    (config,) = results["configs"]
    assert config["name"] == "target" and config["error"] is None
    assert [run["load"]["rate"] for run in config["runs"]] == [20.0, 40.0, "inf"]
    assert config["goodput_rps"] == "inf"  # the fake server meets the SLO at every rate
    for run in config["runs"]:
        assert run["metrics"]["num_ok"] == 6 and run["metrics"]["slo_attainment"] == 1.0
        assert len(run["records"]) == 6 and len(run["records"][0]["chunk_times_s"]) == 6
        assert set(run["replica_samples"]) == {"r0", "r1"}
    markdown = (out / "results.md").read_text()
    assert "| target | rate=20 | 6 | 0 | 0 |" in markdown and "## Goodput" in markdown
    for name in ("latency_cdf.png", "slo_attainment.png", "replica_load_target_rate_20.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert run_bench(_bench_args(["--workload", "trace", "--out", str(out)])) == 2  # no --trace


def test_run_bench_compare_urls_and_command(fake_server, tmp_path: Path):
    slow = FakeServerThread(FakeServerState(ttft_s=1.0, itl_s=0.003)).start()
    pid_file = tmp_path / "server.pid"
    command = f"{sys.executable} {FAKE_SERVER_SCRIPT} --port {{port}} --ttft-ms 5 --pid-file {pid_file}"
    out = tmp_path / "cmp"
    try:
        args = _bench_args(
            [
                *SMALL_WORKLOAD,
                "--workload",
                "multi-turn",
                "--num-conversations",
                "2",
                "--num-turns",
                "2",
                "--first-turn-len",
                "16",
                "--user-turn-len",
                "4",
                "--concurrency",
                "2",
                "--ttft-slo-ms",
                "600",
                "--itl-slo-ms",
                "300",
                "--out",
                str(out),
                "--prompt-format",
                "text",
                "--compare",
                f"fast={fake_server.url}",
                "--compare",
                f"slow={slow.url}",
                "--compare",
                f"spawned={command}",
                "--stop-timeout",
                "5",
            ]
        )
        assert run_bench(args) == 0
    finally:
        slow.stop()
    server_pid = int(pid_file.read_text())
    assert not _pid_alive(server_pid)  # stopped through its process group
    results = json.loads((out / "results.json").read_text())
    by_name = {config["name"]: config for config in results["configs"]}
    assert list(by_name) == ["fast", "slow", "spawned"]
    attainment = {name: config["runs"][0]["metrics"]["slo_attainment"] for name, config in by_name.items()}
    assert attainment == {"fast": 1.0, "slow": 0.0, "spawned": 1.0}
    assert all(config["runs"][0]["metrics"]["num_ok"] == 4 for config in by_name.values())
    assert (out / "spawned.server.log").exists()
    assert (out / "slo_attainment.png").exists() and (out / "latency_cdf.png").exists()
    markdown = (out / "results.md").read_text()
    assert "| fast | concurrency=2 |" in markdown and "| spawned | concurrency=2 |" in markdown
    assert os.path.getsize(out / "latency_cdf.png") > 1000
