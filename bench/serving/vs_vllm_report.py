"""The tables and the figure of a vs_vllm_bench run: per server, client, prompt length and
concurrency, the median over repeats of output tok/s, TTFT p50 / p99 and ITL p50, each with its
ratio to vLLM measured by the same client; each core's idle share; splitserve's first-token
stages. Reads the *.record.json files a run left in its --out folder.

    python -m splitserve.bench.serving.vs_vllm_report bench/results/vs_vllm_bench
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from splitserve.bench.loadgen.plots import plt
from splitserve.bench.serving.vs_vllm_bench import ENGINE_ROLES, RELAY_ROLES

SERVER_ORDER = ("vllm-2t", "splitserve-colocated", "splitserve-1p1d", "splitserve-1p1d-prefill2t")


def servers_in(groups: dict[tuple, list[dict[str, Any]]]) -> list[str]:
    """The servers the records hold: SERVER_ORDER's first, then any variant (vs_vllm_bench's
    --variant) by name."""
    names = {key[3] for key in groups}
    return [s for s in SERVER_ORDER if s in names] + sorted(names - set(SERVER_ORDER))


CLIENTS = {"vllm-bench": "vLLM's `vllm bench serve`", "splitserve-bench": "splitserve's BenchClient"}
# (column, vLLM result key, BenchClient metrics path); higher is better only for tok/s.
MEASURES = (
    ("out tok/s", "output_throughput", ("output_tokens_per_s",)),
    ("TTFT p50 ms", "median_ttft_ms", ("ttft_ms", "p50")),
    ("TTFT p99 ms", "p99_ttft_ms", ("ttft_ms", "p99")),
    ("ITL p50 ms", "median_itl_ms", ("itl_ms", "p50")),
)
STAGES = ("ingress", "routing", "prefill_queue", "prefill_compute", "handoff", "decode_admission", "relay")


def load_records(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for path in sorted(folder.glob("rep*/*.record.json"))]


def measure_of(record: dict[str, Any], vllm_key: str, own_path: tuple[str, ...]) -> float | None:
    result = record["result"]
    if record["client"] == "vllm-bench":
        return result.get(vllm_key)
    value: Any = result
    for key in own_path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def grouped(records: list[dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        point = record["point"]
        groups[(record["client"], point["input_len"], point["concurrency"], record["server"])].append(record)
    return groups


def _cell(value: float | None, ratio: float | None, digits: int) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}" + ("" if ratio is None else f" ({ratio:.2f}x)")


def measure_table(groups: dict[tuple, list[dict[str, Any]]], client: str) -> list[str]:
    """One row per prompt length, concurrency and server; each cell the median over repeats,
    and after it the ratio to vLLM's median at the same point with the same client."""
    header = "| prompt | conc. | server | repeats | " + " | ".join(name for name, _, _ in MEASURES) + " |"
    lines = [header, "|" + "---|" * (4 + len(MEASURES))]
    points = sorted({(key[1], key[2]) for key in groups if key[0] == client})
    for input_len, concurrency in points:
        baseline = groups.get((client, input_len, concurrency, "vllm-2t"), [])
        for server in servers_in(groups):
            records = groups.get((client, input_len, concurrency, server))
            if not records:
                continue
            cells = []
            for name, vllm_key, own_path in MEASURES:
                value = median([measure_of(r, vllm_key, own_path) for r in records])
                base = median([measure_of(r, vllm_key, own_path) for r in baseline])
                ratio = None if server == "vllm-2t" or not value or not base else value / base
                cells.append(_cell(value, ratio, 0 if name == "out tok/s" else 1))
            lines.append(f"| {input_len} | {concurrency} | {server} | {len(records)} | " + " | ".join(cells) + " |")
    return lines


def idle_table(groups: dict[tuple, list[dict[str, Any]]]) -> list[str]:
    """Each core's idle share during the vLLM client's runs, median over repeats."""
    lines = ["| prompt | conc. | server | cpu0 idle | cpu1 idle |", "|---|---|---|---|---|"]
    for (client, input_len, concurrency, server), records in sorted(groups.items()):
        if client != "vllm-bench":
            continue
        shares = [median([r["core_idle_share"].get(core) for r in records]) for core in ("cpu0", "cpu1")]
        lines.append(f"| {input_len} | {concurrency} | {server} | " + " | ".join(f"{s:.0%}" for s in shares) + " |")
    return lines


def output_tokens(record: dict[str, Any]) -> int:
    result = record["result"]
    return result["total_output_tokens"] if record["client"] == "vllm-bench" else result["total_completion_tokens"]


def cpu_ms_per_token(record: dict[str, Any], roles: tuple[str, ...] | None) -> float | None:
    """The server's CPU ms per output token in these roles (None: all of its processes)."""
    by_role = record.get("server_cpu_s_by_role") or {}
    seconds = sum(v for role, v in by_role.items() if roles is None or role in roles)
    tokens = output_tokens(record)
    return 1000.0 * seconds / tokens if by_role and tokens else None


def cpu_table(groups: dict[tuple, list[dict[str, Any]]]) -> list[str]:
    """Server CPU per output token during the vLLM client's runs: the engine processes, the
    relay (every process between the engine and the client socket), and all of the server's."""
    lines = ["| prompt | conc. | server | engine ms/token | relay ms/token | relay vs vLLM | all ms/token |"]
    lines.append("|---|---|---|---|---|---|---|")
    for (client, input_len, concurrency, server), records in sorted(groups.items()):
        if client != "vllm-bench":
            continue
        engine, relay, total = (
            median([cpu_ms_per_token(r, roles) for r in records]) for roles in (ENGINE_ROLES, RELAY_ROLES, None)
        )
        base = median(
            [cpu_ms_per_token(r, RELAY_ROLES) for r in groups.get((client, input_len, concurrency, "vllm-2t"), [])]
        )
        ratio = "-" if server == "vllm-2t" or not relay or not base else f"{relay / base:.2f}x"
        cells = ["-" if v is None else f"{v:.3f}" for v in (engine, relay)] + [
            ratio,
            "-" if total is None else f"{total:.3f}",
        ]
        lines.append(f"| {input_len} | {concurrency} | {server} | " + " | ".join(cells) + " |")
    return lines


def stage_table(groups: dict[tuple, list[dict[str, Any]]]) -> list[str]:
    """splitserve's mean first-token stages (ms) at concurrency 1, over both clients' runs."""
    lines = ["| prompt | server | " + " | ".join(STAGES) + " | sum |", "|" + "---|" * (3 + len(STAGES))]
    for (client, input_len, concurrency, server), records in sorted(groups.items()):
        if concurrency != 1 or client != "vllm-bench" or server == "vllm-2t":
            continue
        means = [median([r["first_token_stage_ms"].get(stage) for r in records]) for stage in STAGES]
        total = sum(m for m in means if m is not None)
        cells = ["-" if m is None else f"{m:.1f}" for m in means]
        lines.append(f"| {input_len} | {server} | " + " | ".join(cells) + f" | {total:.1f} |")
    return lines


def plot(groups: dict[tuple, list[dict[str, Any]]], path: Path) -> Path:
    """Output tok/s and TTFT p50 against concurrency (vLLM's client), one column per prompt
    length; splitserve's first-token stages at concurrency 1 as stacked bars."""
    lengths = sorted({key[1] for key in groups})
    figure, axes = plt.subplots(3, len(lengths), figsize=(5.5 * len(lengths), 11), squeeze=False)
    for column, input_len in enumerate(lengths):
        for row, (name, vllm_key, own_path) in enumerate(MEASURES[:2]):
            axis = axes[row][column]
            for server in servers_in(groups):
                points = sorted(
                    (c, median([measure_of(r, vllm_key, own_path) for r in records]))
                    for (client, n, c, s), records in groups.items()
                    if client == "vllm-bench" and n == input_len and s == server
                )
                if points:
                    axis.plot([c for c, _ in points], [v for _, v in points], marker="o", label=server)
            axis.set_xscale("log", base=2)
            axis.set_xlabel("concurrency")
            axis.set_title(f"{name}, {input_len}-token prompts (vllm bench serve)")
            axis.legend(fontsize=8)
        axis = axes[2][column]
        servers = [s for s in servers_in(groups) if s != "vllm-2t"]
        bottoms = [0.0] * len(servers)
        for stage in STAGES:
            heights = []
            for server in servers:
                records = groups.get(("vllm-bench", input_len, 1, server), [])
                heights.append(median([r["first_token_stage_ms"].get(stage) for r in records]) or 0.0)
            axis.bar(servers, heights, bottom=bottoms, label=stage)
            bottoms = [b + h for b, h in zip(bottoms, heights)]
        axis.set_ylabel("ms")
        axis.set_title(f"first-token stages at c1, {input_len}-token prompts")
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)
    return path


def render(folder: Path) -> str:
    groups = grouped(load_records(folder))
    parts = []
    for client, title in CLIENTS.items():
        if any(key[0] == client for key in groups):
            parts += [f"### Client: {title}", "", *measure_table(groups, client), ""]
    parts += ["### Each core's idle share (during the vLLM client's runs)", "", *idle_table(groups), ""]
    parts += ["### The server's CPU per output token (during the vLLM client's runs)", "", *cpu_table(groups), ""]
    parts += ["### splitserve's first-token stages at concurrency 1 (mean ms)", "", *stage_table(groups), ""]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m splitserve.bench.serving.vs_vllm_report RUN_FOLDER")
    folder = Path(argv[0])
    print(render(folder))
    print(f"figure: {plot(grouped(load_records(folder)), folder / 'summary.png')}", file=sys.stderr)


if __name__ == "__main__":
    main()
