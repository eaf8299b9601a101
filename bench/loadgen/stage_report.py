"""The first-token stage table of results.md: per config and load, each stage a splitserve server
reported per request (`splitserve bench --first-token-stages`; metrics.first_token_stage_summaries)."""

from __future__ import annotations

from collections.abc import Sequence

from splitserve.bench.loadgen.number_format import format_number
from splitserve.bench.loadgen.records import ConfigResult


def first_token_stage_lines(results: Sequence[ConfigResult]) -> list[str]:
    """Per config and load, each first-token stage's mean / p50 / p99 (ms), where the requests
    reported them (--first-token-stages against a splitserve server)."""
    rows = [
        (result.name, run.load.label, m.first_token_stages_ms)
        for result in results
        for run, m in zip(result.runs, result.metrics)
        if m.first_token_stages_ms
    ]
    if not rows:
        return []
    stages = list(dict.fromkeys(stage for _, _, summaries in rows for stage in summaries))
    lines = [
        "",
        "## First-token stages",
        "",
        "Per request, as the server measured them (ms, mean / p50 / p99); `outside` is the client's TTFT "
        "less their sum.",
        "",
        "| config | load | requests | " + " | ".join(stages) + " |",
        "|---|---|---|" + "---|" * len(stages),
    ]
    for name, label, summaries in rows:
        count = max(summary.count for summary in summaries.values())
        cells = [
            f"{format_number(summaries[stage].mean)} / {format_number(summaries[stage].p50)} / {format_number(summaries[stage].p99)}"
            if stage in summaries
            else "-"
            for stage in stages
        ]
        lines.append(f"| {name} | {label} | {count} | " + " | ".join(cells) + " |")
    return lines
