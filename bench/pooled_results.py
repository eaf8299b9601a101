"""Pool repeated `splitserve bench` runs (several results.json) into one comparison.

On a shared, noisy machine one run per configuration says little, so the committed results
run each comparison more than once (different seeds, alternating configuration order) and
pool the per-request records of equal (configuration, load point) pairs: latency percentiles
over all requests, throughput = all completion tokens / all run seconds, SLO attainment over
all requests. Each repeat's own figures are listed too, so the spread stays visible.

    python -m splitserve.bench.pooled_results A/results.json B/results.json --baseline colocated \
        --plot bench/results/cmp.png [--ttft-slo-ms 2000 --itl-slo-ms 100]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from splitserve.bench.metrics import GOODPUT_ATTAINMENT, SloTarget, compute_goodput, compute_run_metrics  # noqa: E402
from splitserve.bench.run_result import RunResult  # noqa: E402

# (column title, how to read it from RunMetrics, True when higher is better)
METRICS = (
    ("out tok/s", lambda m: m.output_tokens_per_s, True),
    ("TTFT mean ms", lambda m: m.ttft_ms.mean, False),
    ("TTFT p99 ms", lambda m: m.ttft_ms.p99, False),
    ("ITL p50 ms", lambda m: m.itl_ms.p50, False),
    ("ITL p99 ms", lambda m: m.itl_ms.p99, False),
    ("E2E p50 ms", lambda m: m.e2e_ms.p50, False),
    ("cached share", lambda m: m.cached_token_share, True),
    ("SLO", lambda m: m.slo_attainment, True),
)

# Median gaps are often ~0 ms (several tokens in one read), so their ratios say nothing.
RATIO_METRICS = tuple(metric for metric in METRICS if metric[0] != "ITL p50 ms")


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
    """(config, load label) -> PooledPoint over every file, and the first file's header."""
    points: dict[tuple[str, str], PooledPoint] = {}
    header: dict = {}
    for path in paths:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        header = header or {key: data.get(key) for key in ("workload", "slo")}
        for config in data["configs"]:
            for raw in config["runs"]:
                run = RunResult.from_dict(raw)
                load = run.load
                value = load.rate if load.rate is not None else load.concurrency
                key = (config["name"], load.label)
                points.setdefault(key, PooledPoint(config["name"], load.label, value)).repeats.append(run)
    return points, header


def _fmt(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if 0 < abs(value) <= 1 and digits == 3:
        return f"{value:.3f}"
    return f"{value:,.{digits}f}"


def _digits(title: str) -> int:
    return 3 if title in ("cached share", "SLO") else 1


def render(points: dict[tuple[str, str], PooledPoint], slo: SloTarget | None, baseline: str | None) -> str:
    configs = list(dict.fromkeys(config for config, _ in points))
    labels = sorted({(p.load_value or 0.0, p.load_label) for p in points.values()})
    pooled = {key: compute_run_metrics(p.pooled_run(), slo) for key, p in points.items()}
    lines = [
        "| config | load | repeats | ok | failed | " + " | ".join(t for t, _, _ in METRICS) + " |",
        "|---" * (5 + len(METRICS)) + "|",
    ]
    for _, label in labels:
        for config in configs:
            key = (config, label)
            if key not in pooled:
                continue
            m = pooled[key]
            cells = [_fmt(get(m), _digits(title)) for title, get, _ in METRICS]
            lines.append(
                f"| {config} | {label} | {len(points[key].repeats)} | {m.num_ok} | "
                f"{m.num_failed + m.num_unfinished} | " + " | ".join(cells) + " |"
            )
    out = [
        "Pooled over repeats (latency percentiles over all requests; throughput = all completion "
        "tokens / all run seconds).",
        "",
        *lines,
    ]
    if baseline is not None and baseline in configs:
        out += [
            "",
            f"Ratios vs `{baseline}` (> 1 = better than {baseline}: higher-is-better metrics "
            "as other/baseline, latencies as baseline/other):",
            "",
            "| config | load | " + " | ".join(t for t, _, _ in RATIO_METRICS) + " |",
            "|---" * (2 + len(RATIO_METRICS)) + "|",
        ]
        for _, label in labels:
            base = pooled.get((baseline, label))
            for config in configs:
                m = pooled.get((config, label))
                if config == baseline or m is None or base is None:
                    continue
                cells = [_fmt(_ratio(get(m), get(base), higher), 2) + "x" for _, get, higher in RATIO_METRICS]
                out.append(f"| {config} | {label} | " + " | ".join(cells) + " |")
    out += ["", "Per repeat (in file order): out tok/s; TTFT mean ms; ITL p99 ms; SLO attainment", ""]
    for _, label in labels:
        for config in configs:
            point = points.get((config, label))
            if point is None:
                continue
            each = [compute_run_metrics(run, slo) for run in point.repeats]
            out.append(
                f"- {config} @ {label}: "
                + "; ".join(
                    f"{_fmt(m.output_tokens_per_s)} / {_fmt(m.ttft_ms.mean)} / {_fmt(m.itl_ms.p99)} / "
                    f"{_fmt(m.slo_attainment, 3)}"
                    for m in each
                )
            )
    if slo is not None and any(p.repeats[0].load.rate is not None for p in points.values()):
        out += [
            "",
            f"Goodput (highest rate with >= {slo.attainment_threshold:.0%} attaining TTFT <= "
            f"{slo.ttft_ms:g} ms and per-request ITL {slo.itl_statistic} <= {slo.itl_ms:g} ms):",
            "",
        ]
        for config in configs:
            mine = [p for (c, _), p in points.items() if c == config and p.repeats[0].load.rate is not None]
            pooled_goodput = compute_goodput(
                (p.load_value, pooled[(config, p.load_label)].slo_attainment) for p in mine
            )
            num_repeats = max((len(p.repeats) for p in mine), default=0)
            per_repeat = [
                compute_goodput(
                    (p.load_value, compute_run_metrics(p.repeats[i], slo).slo_attainment)
                    for p in mine
                    if i < len(p.repeats)
                )
                for i in range(num_repeats)
            ]
            sustained = sustained_goodput((p.load_value, pooled[(config, p.load_label)].slo_attainment) for p in mine)
            out.append(
                f"- {config}: pooled {_fmt(pooled_goodput, 2)} req/s (sustained "
                f"{_fmt(sustained, 2)}); per repeat " + ", ".join(_fmt(g, 2) for g in per_repeat)
            )
        out += [
            "",
            "(sustained: the highest rate at which this and every lower swept rate attain; "
            "the bench's goodput only asks it of that rate)",
        ]
    return "\n".join(out)


def sustained_goodput(points, threshold: float = GOODPUT_ATTAINMENT) -> float | None:
    """Highest rate r such that every swept rate <= r attains; None when the lowest fails.
    Unlike compute_goodput, one lucky high-rate run after failing lower rates does not count."""
    best = None
    for rate, attainment in sorted(points, key=lambda point: point[0]):
        if attainment is None or attainment < threshold:
            break
        best = rate
    return best


def _ratio(value: float | None, base: float | None, higher_is_better: bool) -> float | None:
    if value is None or base is None:
        return None
    num, den = (value, base) if higher_is_better else (base, value)
    return num / den if den else None


def plot(points: dict[tuple[str, str], PooledPoint], slo: SloTarget | None, path: Path, titles: Sequence[str]) -> Path:
    configs = list(dict.fromkeys(config for config, _ in points))
    getters = {title: get for title, get, _ in METRICS}
    fig, axes = plt.subplots(1, len(titles), figsize=(4.2 * len(titles), 3.6), squeeze=False)
    for ax, title in zip(axes[0], titles):
        for config in configs:
            mine = sorted((p for (c, _), p in points.items() if c == config), key=lambda p: p.load_value or 0)
            xs = [p.load_value for p in mine]
            ys = [getters[title](compute_run_metrics(p.pooled_run(), slo)) for p in mine]
            (line,) = ax.plot(xs, ys, marker="o", label=config)
            for p in mine:  # each repeat as a faint dot
                ax.scatter(
                    [p.load_value] * len(p.repeats),
                    [getters[title](compute_run_metrics(run, slo)) for run in p.repeats],
                    color=line.get_color(),
                    alpha=0.3,
                    s=14,
                )
        first = next(iter(points.values())).repeats[0].load
        ax.set_xlabel("offered rate (req/s)" if first.rate is not None else "concurrency")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    print(render(points, slo, args.baseline))
    if args.plot:
        plot(points, slo, args.plot, args.plot_metric or ["ITL p99 ms", "TTFT mean ms", "SLO"])
        print(f"\nplot: {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
