"""splitserve.bench.loadgen.report's pooled report: repeats of one (config, load) pool their records and seconds."""

from __future__ import annotations

import json

import pytest

from splitserve.bench.loadgen.metrics import SloTarget, compute_run_metrics
from splitserve.bench.loadgen.records import LoadPoint, RequestRecord, RunResult
from splitserve.bench.loadgen.report import load_points, main, render_pooled, sustained_goodput


def _record(i: int, ttft_s: float, gap_s: float, tokens: int = 4) -> RequestRecord:
    chunks = [ttft_s + k * gap_s for k in range(tokens)]
    return RequestRecord(
        request_id=f"r{i}",
        num_prompt_tokens_sent=10,
        max_tokens=tokens,
        scheduled_time_s=0.0,
        send_time_s=0.0,
        first_token_time_s=ttft_s,
        chunk_times_s=chunks,
        end_time_s=chunks[-1],
        prompt_tokens=10,
        completion_tokens=tokens,
        cached_tokens=5,
        status=200,
    )


def _write(path, runs_by_config: dict[str, list[RunResult]]) -> None:
    payload = {
        "workload": {"kind": "test"},
        "slo": SloTarget(100.0, 30.0).to_dict(),
        "configs": [
            {"name": name, "runs": [{**run.to_dict(), "metrics": {}} for run in runs]}
            for name, runs in runs_by_config.items()
        ],
    }
    path.write_text(json.dumps(payload))


def _run(config: str, rate: float, ttft_s: float, gap_s: float, duration_s: float) -> RunResult:
    return RunResult(
        config_name=config,
        load=LoadPoint(rate=rate),
        model="m",
        base_url="u",
        duration_s=duration_s,
        records=[_record(i, ttft_s, gap_s) for i in range(3)],
    )


def test_repeats_pool_records_and_seconds(tmp_path):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    _write(first, {"fast": [_run("fast", 1.0, 0.05, 0.01, 2.0)], "slow": [_run("slow", 1.0, 0.2, 0.05, 2.0)]})
    _write(second, {"fast": [_run("fast", 1.0, 0.15, 0.01, 6.0)], "slow": [_run("slow", 1.0, 0.2, 0.05, 2.0)]})
    points, header = load_points([first, second])
    assert header["workload"] == {"kind": "test"}
    fast = points[("fast", "rate=1")]
    assert len(fast.repeats) == 2
    pooled = compute_run_metrics(fast.pooled_run())
    assert pooled.num_ok == 6
    assert pooled.output_tokens_per_s == pytest.approx(24 / 8.0)  # all tokens / all seconds
    assert pooled.ttft_ms.mean == pytest.approx(100.0)
    text = render_pooled(points, SloTarget(100.0, 30.0), baseline="slow")
    # Ratio row vs slow: out tok/s 3.0 / 6.0, then TTFT mean 200 ms / 100 ms.
    assert "| fast | rate=1 | 0.50x | 2.00x |" in text
    # Half of fast's pooled requests meet the 100 ms TTFT, only the first repeat's all do.
    assert "- fast: pooled - req/s (sustained -); per repeat 1.00, -" in text


def test_main_writes_plot(tmp_path, capsys):
    results = tmp_path / "r.json"
    _write(
        results,
        {
            "a": [_run("a", 1.0, 0.05, 0.01, 2.0), _run("a", 2.0, 0.05, 0.01, 1.0)],
            "b": [_run("b", 1.0, 0.1, 0.01, 2.0), _run("b", 2.0, 0.3, 0.01, 1.0)],
        },
    )
    png = tmp_path / "p.png"
    assert main([str(results), "--baseline", "b", "--plot", str(png)]) == 0
    assert png.stat().st_size > 1000
    out = capsys.readouterr().out
    assert "- a: pooled 2.00 req/s (sustained 2.00)" in out and "- b: pooled 1.00 req/s (sustained 1.00)" in out


def test_sustained_goodput_stops_at_the_first_failing_rate():
    assert sustained_goodput([(3.0, 0.95), (1.0, 0.95), (2.0, 0.5)]) == 1.0
    assert sustained_goodput([(1.0, 0.5), (2.0, 0.99)]) is None
    assert sustained_goodput([(1.0, 0.9), (2.0, None)]) == 1.0


def test_pooled_plot_gets_pooled_and_per_repeat_values_in_table_order(tmp_path, monkeypatch):
    from splitserve.bench.loadgen import plots, report

    first, second = tmp_path / "a.json", tmp_path / "b.json"
    # "slow" appears first in the files but only at the higher rate: it still comes first.
    _write(first, {"slow": [_run("slow", 2.0, 0.2, 0.05, 2.0)], "fast": [_run("fast", 1.0, 0.05, 0.01, 2.0)]})
    _write(second, {"fast": [_run("fast", 1.0, 0.15, 0.01, 6.0)]})
    points, _ = load_points([first, second])
    drawn = {}
    monkeypatch.setattr(plots, "plot_pooled", lambda panels, path, load_name: drawn.update(panels, x=load_name))
    report.plot_pooled(points, None, tmp_path / "p.png", ["out tok/s", "TTFT mean ms"])
    assert drawn["x"] == "offered rate (req/s)"
    assert list(drawn["TTFT mean ms"]) == ["slow", "fast"]
    ((load, pooled, repeats),) = drawn["TTFT mean ms"]["fast"]
    assert load == 1.0 and pooled == pytest.approx(100.0) and repeats == pytest.approx([50.0, 150.0])
    assert drawn["out tok/s"]["fast"][0][1] == pytest.approx(24 / 8.0)
