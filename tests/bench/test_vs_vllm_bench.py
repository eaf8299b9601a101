"""bench/serving/vs_vllm_bench and vs_vllm_report: the stage totals read from a real Prometheus
exposition, each core's idle share, and the tables and figure rendered from records in the form
the driver writes them."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from splitserve.bench.serving.process_cpu_profile import psutil
from splitserve.bench.serving.vs_vllm_bench import (
    ENGINE_ROLES,
    RELAY_ROLES,
    STAGE_METRIC,
    BenchPoint,
    cpu_by_process,
    cpu_by_role,
    idle_shares,
    parse_stage_totals,
    stage_means_ms,
)
from splitserve.bench.serving.vs_vllm_report import grouped, load_records, plot, render


def _exposition(observations: list[tuple[str, str, float]]) -> str:
    registry = CollectorRegistry()
    histogram = Histogram(STAGE_METRIC, "stages", ["stage", "replica"], registry=registry)
    for stage, replica, seconds in observations:
        histogram.labels(stage=stage, replica=replica).observe(seconds)
    return generate_latest(registry).decode()


def test_stage_totals_sum_over_replicas_and_means_are_per_request_deltas():
    before = parse_stage_totals(_exposition([("prefill_compute", "a", 0.010)]))
    after = parse_stage_totals(
        _exposition(
            [
                ("prefill_compute", "a", 0.010),
                ("prefill_compute", "a", 0.020),
                ("prefill_compute", "b", 0.030),
                ("relay", "b", 0.001),
            ]
        )
    )
    assert abs(after["prefill_compute"][0] - 0.060) < 1e-12 and after["prefill_compute"][1] == 3.0
    means = stage_means_ms(before, after)
    assert abs(means["prefill_compute"] - 25.0) < 1e-9  # (60 - 10) ms over 2 new requests
    assert abs(means["relay"] - 1.0) < 1e-9
    assert parse_stage_totals("# no such metric\n") == {}


def test_idle_share_is_the_idle_part_of_each_cores_elapsed_time():
    shares = idle_shares({"cpu0": (100, 50), "cpu1": (10, 0)}, {"cpu0": (130, 60), "cpu1": (10, 40)})
    assert shares == {"cpu0": 0.25, "cpu1": 1.0}


def test_cpu_by_role_counts_a_servers_descendants_by_their_command_line():
    burn = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\ntime.sleep(60)\n"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}, 'vllm.entrypoints'])",
        ]
    )
    try:
        before = cpu_by_process(parent.pid)
        deadline = time.monotonic() + 120  # a safety net only: the child burns 0.3 CPU-s
        while time.monotonic() < deadline:
            used = cpu_by_role(before, cpu_by_process(parent.pid))
            if used.get("vLLM API server", 0.0) >= 0.25:
                break
            time.sleep(0.05)
        assert used.get("vLLM API server", 0.0) >= 0.25, used
    finally:
        for child in psutil.Process(parent.pid).children(recursive=True):
            child.kill()
        parent.kill()
        parent.wait(timeout=30)


def _record(server: str, client: str, point: BenchPoint, repeat: int, tok_s: float, ttft_ms: float) -> dict:
    if client == "vllm-bench":
        result = {
            "output_throughput": tok_s,
            "median_ttft_ms": ttft_ms,
            "p99_ttft_ms": 2 * ttft_ms,
            "median_itl_ms": 3.0,
            "total_output_tokens": 1000,
        }
    else:
        summary = {"p50": ttft_ms, "p99": 2 * ttft_ms}
        result = {"output_tokens_per_s": tok_s, "ttft_ms": summary, "itl_ms": {"p50": 3.0, "p99": 9.0}}
        result["total_completion_tokens"] = 1000
    stages = {} if server.startswith("vllm") else {"prefill_compute": ttft_ms / 2, "relay": 1.0}
    relay_role = "vLLM API server" if server.startswith("vllm") else RELAY_ROLES[0]
    relay_s = 0.2 if server.startswith("vllm") else 0.1  # per 1000 tokens: 0.2 and 0.1 ms a token
    cpu = {relay_role: relay_s, ENGINE_ROLES[0]: 1.0, "ray daemons (gcs, raylet, agents)": 0.5}
    return {
        "server": server,
        "repeat": repeat,
        "point": {"input_len": point.input_len, "concurrency": point.concurrency, "num_prompts": point.num_prompts},
        "client": client,
        "wall_s": 1.0,
        "core_idle_share": {"cpu0": 0.1, "cpu1": 0.4},
        "first_token_stage_ms": stages,
        "server_cpu_s_by_role": cpu,
        "result": result,
    }


def test_tables_give_medians_over_repeats_and_ratios_to_vllm_with_the_same_client(tmp_path):
    point = BenchPoint(200, 1, 8)
    rows = [
        ("vllm-2t", 0, 100.0, 20.0), ("vllm-2t", 1, 300.0, 40.0),  # medians 200 tok/s, 30 ms
        ("splitserve-colocated", 0, 240.0, 15.0), ("splitserve-colocated", 1, 260.0, 15.0),
    ]  # fmt: skip
    for client in ("vllm-bench", "splitserve-bench"):
        for server, repeat, tok_s, ttft in rows:
            folder = tmp_path / f"rep{repeat}-{server}"
            folder.mkdir(exist_ok=True)
            record = _record(server, client, point, repeat, tok_s, ttft)
            (folder / f"in200-c1-{client}.record.json").write_text(json.dumps(record))
    text = render(tmp_path)
    assert text.count("| 200 | 1 | splitserve-colocated | 2 | 250 (1.25x) | 15.0 (0.50x) | 30.0 (0.50x) |") == 2
    assert "| 200 | 1 | vllm-2t | 2 | 200 | 30.0 | 60.0 | 3.0 |" in text
    assert "| 200 | splitserve-colocated | - | - | - | 7.5 | - | - | 1.0 | 8.5 |" in text
    assert "| 200 | 1 | splitserve-colocated | 10% | 40% |" in text
    assert "| 200 | 1 | splitserve-colocated | 1.000 | 0.100 | 0.50x | 1.600 |" in text
    assert "| 200 | 1 | vllm-2t | 1.000 | 0.200 | - | 1.700 |" in text
    png = plot(grouped(load_records(tmp_path)), tmp_path / "summary.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_variants_rows_follow_the_built_in_servers_with_their_ratios_to_vllm(tmp_path):
    point = BenchPoint(200, 1, 8)
    for server, tok_s in (("splitserve-colocated-1t", 300.0), ("vllm-2t", 200.0), ("splitserve-colocated", 250.0)):
        folder = tmp_path / f"rep0-{server}"
        folder.mkdir()
        record = _record(server, "vllm-bench", point, 0, tok_s, 20.0)
        (folder / "in200-c1-vllm-bench.record.json").write_text(json.dumps(record))
    text = render(tmp_path)
    rows = [line for line in text.splitlines() if line.startswith("| 200 | 1 |") and "tok" not in line]
    assert [row.split(" | ")[2] for row in rows][:3] == ["vllm-2t", "splitserve-colocated", "splitserve-colocated-1t"]
    assert "| 200 | 1 | splitserve-colocated-1t | 1 | 300 (1.50x) |" in text
    assert "| 200 | splitserve-colocated-1t |" in text  # its first-token stages
