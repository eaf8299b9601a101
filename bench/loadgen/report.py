"""Reports of benchmark results: results.json, markdown tables and PNG plots (plots.py).

One `splitserve bench` invocation: write_reports gives results.json, results.md and the plots.

Repeats: on a shared, noisy machine one run per configuration says little, so the committed
results run each comparison more than once (different seeds, alternating configuration order)
and pool the per-request records of equal (configuration, load point) pairs: latency percentiles
over all requests, throughput = all completion tokens / all run seconds, SLO attainment over all
requests. Each repeat's own figures are listed too, so the spread stays visible.

    python -m splitserve.bench.loadgen.report A/results.json B/results.json --baseline colocated \\
        --plot bench/results/cmp.png [--ttft-slo-ms 2000 --itl-slo-ms 100]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from splitserve.bench.loadgen import plots
from splitserve.bench.loadgen.metrics import (
    GOODPUT_ATTAINMENT,
    LatencySummary,
    RunMetrics,
    SloTarget,
    compute_goodput,
    compute_run_metrics,
)
from splitserve.bench.loadgen.number_format import format_grouped, format_number, format_percent
from splitserve.bench.loadgen.records import ConfigResult, RunResult
from splitserve.bench.loadgen.stage_report import first_token_stage_lines

# Pooled tables: (column title, how to read it from RunMetrics, True when higher is better).
METRICS = (
    ("out tok/s", lambda m: m.output_tokens_per_s, True),
    ("TTFT mean ms", lambda m: m.ttft_ms.mean, False),
    ("TTFT p50 ms", lambda m: m.ttft_ms.p50, False),
    ("TTFT p99 ms", lambda m: m.ttft_ms.p99, False),
    ("ITL p50 ms", lambda m: m.itl_ms.p50, False),
    ("ITL p99 ms", lambda m: m.itl_ms.p99, False),
    ("E2E p50 ms", lambda m: m.e2e_ms.p50, False),
    ("cached share", lambda m: m.cached_token_share, True),
    ("SLO", lambda m: m.slo_attainment, True),
)
# Median gaps are often ~0 ms (several tokens in one read), so their ratios say nothing.
RATIO_METRICS = tuple(metric for metric in METRICS if metric[0] != "ITL p50 ms")


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
        return f"{format_number(summary.p50)} / {format_number(summary.p99)}"

    for result in results:
        if result.error is not None:
            lines.append(f"| {result.name} | - | - | - | - | - | - | - | - | - | - | failed: {result.error} |")
        for run, m in zip(result.runs, result.metrics):
            lines.append(
                f"| {result.name} | {run.load.label} | {m.num_ok} | {m.num_failed} | {m.num_unfinished} "
                f"| {format_number(m.requests_per_s, 2)} | {format_number(m.output_tokens_per_s)} | {pair(m.ttft_ms)} "
                f"| {pair(m.itl_ms)} | {pair(m.e2e_ms)} | {format_percent(m.cached_token_share)} | {format_percent(m.slo_attainment)} |"
            )
    lines += ["", "## Goodput", "", "| config | goodput (req/s) |", "|---|---|"]
    for result in results:
        lines.append(f"| {result.name} | {format_number(result.goodput_rps, 2)} |")
    lines += first_token_stage_lines(results)
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
        paths.append(plots.plot_latency_cdfs(runs, out / "latency_cdf.png"))
    if slo is not None:
        goodputs = {result.name: result.goodput_rps for result in results}
        rate_series = _slo_series(results, closed_loop=False)
        level_series = {} if rate_series else _slo_series(results, closed_loop=True)
        if rate_series:
            paths.append(
                plots.plot_slo_vs_load(rate_series, out / "slo_attainment.png", slo.attainment_threshold, goodputs)
            )
        elif level_series:
            paths.append(
                plots.plot_slo_vs_load(
                    level_series,
                    out / "slo_attainment.png",
                    slo.attainment_threshold,
                    None,
                    "concurrency (requests in flight)",
                )
            )
    for result in results:
        for run, samples in zip(result.runs, result.replica_samples):
            if samples:
                name = f"replica_load_{safe_filename(result.name)}_{safe_filename(run.load.label)}.png"
                paths.append(plots.plot_replica_load(samples, out / name, title=run.label, ylabel=replica_metric))
    return paths


# ----------------------------------------------------------------------------- pooled repeats


@dataclass
class PooledPoint:
    """Every repeat of one configuration at one load point."""

    config: str
    load_label: str
    load_value: float | None
    repeats: list[RunResult] = field(default_factory=list)

    def pooled_run(self) -> RunResult:
        first = self.repeats[0]
        return RunResult(
            config_name=self.config,
            load=first.load,
            model=first.model,
            base_url="pooled",
            duration_s=sum(run.duration_s for run in self.repeats),
            records=[record for run in self.repeats for record in run.records],
            num_not_sent=sum(run.num_not_sent for run in self.repeats),
        )


def load_points(paths: Sequence[Path]) -> tuple[dict[tuple[str, str], PooledPoint], dict]:
    """(config, load label) -> PooledPoint over every results.json, and the first file's header."""
    points: dict[tuple[str, str], PooledPoint] = {}
    header: dict = {}
    for path in paths:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        header = header or {key: data.get(key) for key in ("workload", "slo")}
        for config in data["configs"]:
            for raw in config["runs"]:
                run = RunResult.from_dict(raw)
                value = run.load.rate if run.load.rate is not None else run.load.concurrency
                key = (config["name"], run.load.label)
                points.setdefault(key, PooledPoint(config["name"], run.load.label, value)).repeats.append(run)
    return points, header


def _ratio(value: float | None, base: float | None, higher_is_better: bool) -> float | None:
    if value is None or base is None:
        return None
    num, den = (value, base) if higher_is_better else (base, value)
    return num / den if den else None


def sustained_goodput(
    points: Iterable[tuple[float, float | None]], threshold: float = GOODPUT_ATTAINMENT
) -> float | None:
    """Highest rate r such that every swept rate <= r attains; None when the lowest fails.
    Unlike compute_goodput, one lucky high-rate run after failing lower rates does not count."""
    best = None
    for rate, attainment in sorted(points, key=lambda point: point[0]):
        if attainment is None or attainment < threshold:
            break
        best = rate
    return best


def _goodput_lines(points: dict[tuple[str, str], PooledPoint], pooled: dict, slo: SloTarget) -> list[str]:
    out = [
        "",
        f"Goodput (highest rate with >= {slo.attainment_threshold:.0%} attaining TTFT <= "
        f"{slo.ttft_ms:g} ms and per-request ITL {slo.itl_statistic} <= {slo.itl_ms:g} ms):",
        "",
    ]
    for config in dict.fromkeys(config for config, _ in points):
        mine = [p for (c, _), p in points.items() if c == config and p.repeats[0].load.rate is not None]
        attained = [(p.load_value, pooled[(config, p.load_label)].slo_attainment) for p in mine]
        num_repeats = max((len(p.repeats) for p in mine), default=0)
        per_repeat = [
            compute_goodput(
                (p.load_value, compute_run_metrics(p.repeats[i], slo).slo_attainment)
                for p in mine
                if i < len(p.repeats)
            )
            for i in range(num_repeats)
        ]
        out.append(
            f"- {config}: pooled {format_grouped(compute_goodput(attained), 2)} req/s (sustained "
            f"{format_grouped(sustained_goodput(attained), 2)}); per repeat "
            + ", ".join(format_grouped(g, 2) for g in per_repeat)
        )
    out += [
        "",
        "(sustained: the highest rate at which this and every lower swept rate attain; "
        "the bench's goodput only asks it of that rate)",
    ]
    return out


def render_pooled(points: dict[tuple[str, str], PooledPoint], slo: SloTarget | None, baseline: str | None) -> str:
    """The pooled table, ratios against `baseline`, each repeat's figures and goodput."""
    configs = list(dict.fromkeys(config for config, _ in points))
    labels = sorted({(p.load_value or 0.0, p.load_label) for p in points.values()})
    keys = [(config, label) for _, label in labels for config in configs if (config, label) in points]
    pooled: dict[tuple[str, str], RunMetrics] = {
        key: compute_run_metrics(points[key].pooled_run(), slo) for key in keys
    }
    out = [
        "Pooled over repeats (latency percentiles over all requests; throughput = all completion "
        "tokens / all run seconds).",
        "",
        "| config | load | repeats | ok | failed | " + " | ".join(t for t, _, _ in METRICS) + " |",
        "|---" * (5 + len(METRICS)) + "|",
    ]
    for config, label in keys:
        m = pooled[(config, label)]
        cells = [format_grouped(get(m), 3 if title in ("cached share", "SLO") else 1) for title, get, _ in METRICS]
        repeats = len(points[(config, label)].repeats)
        out.append(
            f"| {config} | {label} | {repeats} | {m.num_ok} | {m.num_failed + m.num_unfinished} | "
            + " | ".join(cells)
            + " |"
        )
    if baseline is not None and baseline in configs:
        out += [
            "",
            f"Ratios vs `{baseline}` (> 1 = better than {baseline}: higher-is-better metrics "
            "as other/baseline, latencies as baseline/other):",
            "",
            "| config | load | " + " | ".join(t for t, _, _ in RATIO_METRICS) + " |",
            "|---" * (2 + len(RATIO_METRICS)) + "|",
        ]
        for config, label in keys:
            base = pooled.get((baseline, label))
            if config == baseline or base is None:
                continue
            m = pooled[(config, label)]
            cells = [format_grouped(_ratio(get(m), get(base), higher), 2) + "x" for _, get, higher in RATIO_METRICS]
            out.append(f"| {config} | {label} | " + " | ".join(cells) + " |")
    out += ["", "Per repeat (in file order): out tok/s; TTFT mean ms; ITL p99 ms; SLO attainment", ""]
    for config, label in keys:
        each = [compute_run_metrics(run, slo) for run in points[(config, label)].repeats]
        figures = [
            " / ".join(
                (format_grouped(m.output_tokens_per_s), format_grouped(m.ttft_ms.mean), format_grouped(m.itl_ms.p99))
                + (format_grouped(m.slo_attainment, 3),)
            )
            for m in each
        ]
        out.append(f"- {config} @ {label}: " + "; ".join(figures))
    if slo is not None and any(p.repeats[0].load.rate is not None for p in points.values()):
        out += _goodput_lines(points, pooled, slo)
    return "\n".join(out)


def plot_pooled(
    points: dict[tuple[str, str], PooledPoint], slo: SloTarget | None, path: Path, titles: Sequence[str]
) -> Path:
    """plots.plot_pooled of the `titles` columns of METRICS: pooled lines, one dot per repeat."""
    getters = {title: get for title, get, _ in METRICS}
    panels = {}
    for title in titles:
        get = getters[title]
        series: dict[str, list] = {config: [] for config, _ in points}  # first-seen order, as in the tables
        for (config, _), point in sorted(points.items(), key=lambda item: item[1].load_value or 0):
            pooled = get(compute_run_metrics(point.pooled_run(), slo))
            repeats = [get(compute_run_metrics(run, slo)) for run in point.repeats]
            series.setdefault(config, []).append((point.load_value, pooled, repeats))
        panels[title] = series
    first = next(iter(points.values())).repeats[0].load
    return plots.plot_pooled(panels, path, "offered rate (req/s)" if first.rate is not None else "concurrency")


def main(argv: Sequence[str] | None = None) -> int:
    """Pool several results.json of `splitserve bench` into one comparison (see the module doc)."""
    parser = argparse.ArgumentParser(
        prog="python -m splitserve.bench.loadgen.report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("results", nargs="+", type=Path, help="results.json files of `splitserve bench`")
    parser.add_argument("--baseline", help="configuration the ratios are taken against")
    parser.add_argument("--ttft-slo-ms", type=float, help="SLO to judge (default: the first file's)")
    parser.add_argument("--itl-slo-ms", type=float)
    parser.add_argument("--itl-slo-stat", default=None)
    parser.add_argument("--plot", type=Path, help="PNG with one panel per --plot-metric")
    parser.add_argument("--plot-metric", action="append", default=[], choices=[title for title, _, _ in METRICS])
    args = parser.parse_args(argv)
    points, header = load_points(args.results)
    saved = header.get("slo") or {}
    slo = None
    if saved or args.ttft_slo_ms:
        slo = SloTarget(
            args.ttft_slo_ms or saved["ttft_ms"],
            args.itl_slo_ms or saved["itl_ms"],
            args.itl_slo_stat or saved.get("itl_statistic", "p90"),
        )
    print(render_pooled(points, slo, args.baseline))
    if args.plot:
        plot_pooled(points, slo, args.plot, args.plot_metric or ["ITL p99 ms", "TTFT mean ms", "SLO"])
        print(f"\nplot: {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
