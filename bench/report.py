"""Reports of benchmark results: results.json, a markdown table and PNG plots (matplotlib Agg)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from splitserve.bench.config_result import ConfigResult, ReplicaSamples  # noqa: E402
from splitserve.bench.metrics import LatencySummary, SloTarget  # noqa: E402
from splitserve.bench.request_record import RequestRecord  # noqa: E402


def to_jsonable(value: Any) -> Any:
    """Strict JSON: inf becomes the string 'inf', nan becomes null."""
    if isinstance(value, float):
        if math.isnan(value):
            return None
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else value
    if isinstance(value, dict):
        return {str(key): to_jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(item) for item in value]
    return value


def write_json(path: str | Path, payload: Any) -> Path:
    path = Path(path)
    path.write_text(json.dumps(to_jsonable(payload), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return path


def safe_filename(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "run"


def _fmt(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return "inf" if math.isinf(value) else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100.0 * value:.1f}%"


def render_markdown(results: Sequence[ConfigResult], workload: Mapping[str, Any], slo: SloTarget | None) -> str:
    lines = ["# splitserve bench results", ""]
    lines.append("Workload: " + ", ".join(f"{key}={value}" for key, value in workload.items()))
    if slo is not None:
        lines.append(
            f"SLO: TTFT <= {slo.ttft_ms:g} ms and per-request ITL {slo.itl_statistic} <= "
            f"{slo.itl_ms:g} ms; goodput = highest rate with >= {100 * slo.attainment_threshold:g}% attaining."
        )
    lines += [
        "",
        "Latencies in ms (p50 / p99).",
        "",
        "| config | load | ok | failed | unfinished | req/s | out tok/s | TTFT | ITL | E2E | cached share | SLO |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def pair(summary: LatencySummary) -> str:
        return f"{_fmt(summary.p50)} / {_fmt(summary.p99)}"

    for result in results:
        if result.error is not None:
            lines.append(f"| {result.name} | - | - | - | - | - | - | - | - | - | - | failed: {result.error} |")
        for run, m in zip(result.runs, result.metrics):
            lines.append(
                f"| {result.name} | {run.load.label} | {m.num_ok} | {m.num_failed} | {m.num_unfinished} "
                f"| {_fmt(m.requests_per_s, 2)} | {_fmt(m.output_tokens_per_s)} | {pair(m.ttft_ms)} "
                f"| {pair(m.itl_ms)} | {pair(m.e2e_ms)} | {_pct(m.cached_token_share)} | {_pct(m.slo_attainment)} |"
            )
    lines += ["", "## Goodput", "", "| config | goodput (req/s) |", "|---|---|"]
    for result in results:
        lines.append(f"| {result.name} | {_fmt(result.goodput_rps, 2)} |")
    error_rows = [
        (result.name, run.load.label, kind, count)
        for result in results
        for run, m in zip(result.runs, result.metrics)
        for kind, count in m.errors_by_kind.items()
    ]
    if error_rows:
        lines += ["", "## Errors", "", "| config | load | kind | count |", "|---|---|---|---|"]
        lines += [f"| {name} | {label} | {kind} | {count} |" for name, label, kind, count in error_rows]
    return "\n".join(lines) + "\n"


def _plot_cdf(axis: Any, values_ms: Sequence[float], label: str) -> None:
    if len(values_ms) == 0:
        return
    ordered = np.sort(np.asarray(values_ms, dtype=float))
    axis.step(ordered, np.arange(1, len(ordered) + 1) / len(ordered), where="post", label=label)


def plot_latency_cdfs(runs: Mapping[str, Sequence[RequestRecord]], path: str | Path) -> Path:
    """TTFT, ITL and E2E CDFs, one line per run (label -> records), overlaid."""
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for label, records in runs.items():
        ok = [record for record in records if record.ok]
        _plot_cdf(axes[0], [1000.0 * record.ttft_s for record in ok], label)
        _plot_cdf(axes[1], [1000.0 * gap for record in ok for gap in record.itl_gaps_s], label)
        _plot_cdf(axes[2], [1000.0 * record.e2e_s for record in ok], label)
    for axis, title in zip(axes, ("TTFT", "Inter-token latency", "End-to-end latency")):
        axis.set_title(title)
        axis.set_xlabel("ms")
        axis.set_ylabel("fraction of requests" if title != "Inter-token latency" else "fraction of gaps")
        axis.set_ylim(0, 1.02)
        axis.grid(alpha=0.3)
        if axis.lines:
            axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return Path(path)


def plot_slo_vs_load(
    series: Mapping[str, Sequence[tuple[float, float | None, float]]],
    path: str | Path,
    threshold: float,
    goodputs: Mapping[str, float | None] | None = None,
    load_name: str = "offered rate (req/s)",
) -> Path:
    """Per config: (load, SLO attainment, achieved req/s) points -> attainment and throughput
    against load, with the goodput threshold and each config's goodput marked."""
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, points in series.items():
        ordered = sorted((load, attained, rps) for load, attained, rps in points if math.isfinite(load))
        loads = [load for load, _, _ in ordered]
        line = left.plot(loads, [np.nan if a is None else 100 * a for _, a, _ in ordered], marker="o", label=name)
        right.plot(loads, [rps for _, _, rps in ordered], marker="o", label=name)
        goodput = (goodputs or {}).get(name)
        if goodput is not None and math.isfinite(goodput):
            left.axvline(goodput, linestyle=":", color=line[0].get_color())
    left.axhline(100 * threshold, color="grey", linestyle="--", label=f"{100 * threshold:g}% target")
    left.set_ylabel("requests meeting both SLOs (%)")
    left.set_ylim(0, 102)
    right.set_ylabel("achieved requests/s")
    for axis, title in ((left, "SLO attainment"), (right, "Throughput")):
        axis.set_title(title)
        axis.set_xlabel(load_name)
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return Path(path)


def plot_replica_load(
    samples: ReplicaSamples, path: str | Path, title: str = "Per-replica load", ylabel: str = "value"
) -> Path:
    """One line per replica: replica name -> [(seconds, value)]."""
    figure, axis = plt.subplots(figsize=(8, 4.5))
    for replica, points in sorted(samples.items()):
        ordered = sorted(points)
        axis.plot([t for t, _ in ordered], [v for _, v in ordered], marker=".", label=replica)
    axis.set_title(title)
    axis.set_xlabel("seconds since scraping began (just before the run)")
    axis.set_ylabel(ylabel)
    axis.grid(alpha=0.3)
    if axis.lines:
        axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return Path(path)


def _slo_series(
    results: Sequence[ConfigResult], closed_loop: bool
) -> dict[str, list[tuple[float, float | None, float]]]:
    series = {}
    for result in results:
        points = [
            (float(run.load.concurrency) if closed_loop else run.load.rate, m.slo_attainment, m.requests_per_s)
            for run, m in zip(result.runs, result.metrics)
            if (run.load.mode == "closed-loop") == closed_loop and run.load.mode != "trace-timing"
        ]
        if any(math.isfinite(load) for load, _, _ in points):
            series[result.name] = points
    return series


def write_reports(
    results: Sequence[ConfigResult],
    workload: Mapping[str, Any],
    slo: SloTarget | None,
    out_dir: str | Path,
    include_records: bool = True,
    replica_metric: str = "value",
    extra: Mapping[str, Any] | None = None,
) -> list[Path]:
    """results.json, results.md, latency_cdf.png, slo_attainment.png (rate sweeps; concurrency
    sweeps when there is no rate) and replica_load_<config>_<load>.png per scraped run."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "workload": dict(workload),
        "slo": None if slo is None else slo.to_dict(),
        **dict(extra or {}),
        "configs": [result.to_dict(include_records=include_records) for result in results],
    }
    paths = [write_json(out / "results.json", payload)]
    markdown = out / "results.md"
    markdown.write_text(render_markdown(results, workload, slo), encoding="utf-8")
    paths.append(markdown)
    runs = {run.label: run.records for result in results for run in result.runs}
    if runs:
        paths.append(plot_latency_cdfs(runs, out / "latency_cdf.png"))
    if slo is not None:
        goodputs = {result.name: result.goodput_rps for result in results}
        rate_series = _slo_series(results, closed_loop=False)
        if rate_series:
            paths.append(plot_slo_vs_load(rate_series, out / "slo_attainment.png", slo.attainment_threshold, goodputs))
        else:
            level_series = _slo_series(results, closed_loop=True)
            if level_series:
                paths.append(
                    plot_slo_vs_load(
                        level_series,
                        out / "slo_attainment.png",
                        slo.attainment_threshold,
                        None,
                        load_name="concurrency (requests in flight)",
                    )
                )
    for result in results:
        for run, samples in zip(result.runs, result.replica_samples):
            if samples:
                name = f"replica_load_{safe_filename(result.name)}_{safe_filename(run.load.label)}.png"
                paths.append(plot_replica_load(samples, out / name, title=run.label, ylabel=replica_metric))
    return paths
