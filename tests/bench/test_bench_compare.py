"""Tests of `splitserve bench` end to end (run_bench) against one target and side by side (--compare):
server configurations, and server commands started and stopped by process group. Servers are
tests/helpers/bench_fake_server.py, in a thread (conftest.py's `fake_server`) or as a subprocess for
the command configuration of --compare."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import psutil
import pytest

from splitserve.bench.cli import add_bench_parser, run_bench
from splitserve.bench.loadgen.managed_server import ManagedServer, ServerStartError, _group_has_live_members
from splitserve.bench.loadgen.records import (
    ServerConfig,
    ServerConfigError,
)
from tests.helpers.bench_fake_server import FakeServerState, FakeServerThread

FAKE_SERVER_SCRIPT = Path(__file__).parents[1] / "helpers" / "bench_fake_server.py"


def _pid_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


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
