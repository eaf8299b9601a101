"""The benchmarks' PNG figures (matplotlib on the headless Agg backend).

The one module that draws for `splitserve bench` and the pooled report (report.py computes the
numbers); kv_transfer_report and autoscale_trace draw their own figures with this module's `plt`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from splitserve.bench import require_extra
from splitserve.bench.loadgen.records import ReplicaSamples, RequestRecord

matplotlib = require_extra("matplotlib")
matplotlib.use("Agg")  # headless: never needs a display
plt = require_extra("matplotlib.pyplot")

# One panel of plot_pooled: config -> [(load, pooled value, [value of each repeat])].
PooledSeries = Mapping[str, Sequence[tuple[float, float | None, Sequence[float | None]]]]


def _save(figure: Any, path: str | Path, dpi: int = 100) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=dpi)
    plt.close(figure)
    return Path(path)


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
    return _save(figure, path)


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
    return _save(figure, path)


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
    return _save(figure, path)


def plot_pooled(panels: Mapping[str, PooledSeries], path: str | Path, load_name: str) -> Path:
    """One panel per metric title: each config's pooled value against load as a line, and each
    repeat's own value as a faint dot, so the spread between repeats stays visible."""
    figure, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for axis, (title, series) in zip(axes[0], panels.items()):
        for config, points in series.items():
            nan = float("nan")
            xs = [load for load, _, _ in points]
            (line,) = axis.plot(xs, [nan if y is None else y for _, y, _ in points], marker="o", label=config)
            for load, _, repeats in points:
                ys = [nan if y is None else y for y in repeats]
                axis.scatter([load] * len(ys), ys, color=line.get_color(), alpha=0.3, s=14)
        axis.set_xlabel(load_name)
        axis.set_title(title)
        axis.grid(alpha=0.3)
    axes[0][0].legend()
    return _save(figure, path, dpi=110)
