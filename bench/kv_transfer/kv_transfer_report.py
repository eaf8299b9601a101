"""Summaries, markdown and plot for splitserve.bench.kv_transfer.kv_transfer (pure functions over the run's records)."""

from __future__ import annotations

import statistics
from collections import defaultdict

TARGET_RATIO = 0.9  # KV bandwidth / raw gloo bandwidth
TARGET_EXPOSED_FRACTION = 0.05  # exposed transfer / prefill, at 2048 tokens with layer-wise sending


def _median(values) -> float:
    return statistics.median(values)


def summarize_pair(preset: str, records: list[dict], reference_raw: dict[int, dict]) -> list[dict]:
    """One row per (tokens, layerwise, layout) of the two-process harness, against the raw
    send/recv timed in the same rounds (and splitserve.bench.kv_transfer.raw_bandwidth's separate run)."""
    groups = defaultdict(list)
    for rec in records:
        if rec["timed"]:
            groups[(rec["kind"], rec["num_tokens"], rec["layerwise"], rec["layout"])].append(rec)
    rows = []
    for (kind, num_tokens, layerwise, layout), recs in sorted(groups.items()):
        if kind != "kv":
            continue
        raw = groups[("raw", num_tokens, False, "-")]
        num_bytes = recs[0]["num_bytes"]
        seconds = _median(r["seconds"] for r in recs)
        raw_seconds = _median(r["seconds"] for r in raw)
        reference = reference_raw.get(num_bytes)
        rows.append(
            {
                "preset": preset,
                "num_tokens": num_tokens,
                "layerwise": layerwise,
                "layout": layout,
                "num_bytes": num_bytes,
                "num_trials": len(recs),
                "seconds": seconds,
                "min_seconds": min(r["seconds"] for r in recs),
                "posted_seconds": _median(r["posted_seconds"] for r in recs),
                "bytes_per_s": num_bytes / seconds,
                "raw_seconds": raw_seconds,
                "raw_bytes_per_s": num_bytes / raw_seconds,
                "ratio": raw_seconds / seconds,
                "reference_raw_bytes_per_s": reference["bytes_per_s"] if reference else None,
                "reference_ratio": (num_bytes / seconds) / reference["bytes_per_s"] if reference else None,
            }
        )
    return rows


def summarize_actors(preset: str, records: list[dict]) -> list[dict]:
    """One row per (tokens, layerwise) of the real actor path."""
    groups = defaultdict(list)
    for rec in records:
        if rec["timed"]:
            groups[(rec["num_tokens"], rec["layerwise"])].append(rec)
    rows = []
    for (num_tokens, layerwise), recs in sorted(groups.items()):
        prefill = _median(r["prefill_seconds"] for r in recs)
        exposed = _median(r["exposed_seconds"] for r in recs)
        rows.append(
            {
                "preset": preset,
                "num_tokens": num_tokens,
                "layerwise": layerwise,
                "num_bytes": recs[0]["num_bytes"],
                "num_requests": len(recs),
                "prefill_seconds": prefill,
                "exposed_seconds": exposed,
                "exposed_fraction": _median(r["exposed_seconds"] / r["prefill_seconds"] for r in recs),
                "ttft_seconds": _median(r["ttft_seconds"] for r in recs),
                "sender_seconds": _median(r["sender_seconds"] for r in recs),
                "num_send_in_place": sum(bool(r["send_in_place"]) for r in recs),
                "num_recv_in_place": sum(bool(r["recv_in_place"]) for r in recs),
            }
        )
    return rows


def _mb(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):.0f} MiB"


def _gbps(bytes_per_s: float | None) -> str:
    return "-" if bytes_per_s is None else f"{bytes_per_s / 1e9:.2f}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def pair_table(rows: list[dict]) -> list[str]:
    lines = [
        "| preset | tokens | bytes | send | block ids | trials | KV ms (median) | KV ms (min) | KV GB/s | "
        "raw ms | raw GB/s | ratio | ratio vs raw_bandwidth |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ref_ratio = "-" if r["reference_ratio"] is None else f"{r['reference_ratio']:.2f}"
        lines.append(
            f"| {r['preset']} | {r['num_tokens']} | {_mb(r['num_bytes'])} | "
            f"{'layer-wise' if r['layerwise'] else 'packed'} | {r['layout']} | {r['num_trials']} | "
            f"{_ms(r['seconds'])} | {_ms(r['min_seconds'])} | {_gbps(r['bytes_per_s'])} | {_ms(r['raw_seconds'])} | "
            f"{_gbps(r['raw_bytes_per_s'])} | **{r['ratio']:.2f}** | {ref_ratio} |"
        )
    return lines


def actor_table(rows: list[dict]) -> list[str]:
    lines = [
        "| preset | tokens | bytes | send | requests | prefill ms | exposed transfer ms | exposed / prefill | "
        "packed GB/s | decode TTFT ms | sender busy ms | sent in place | received in place |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['preset']} | {r['num_tokens']} | {_mb(r['num_bytes'])} | "
            f"{'layer-wise' if r['layerwise'] else 'packed, after prefill'} | {r['num_requests']} | "
            f"{_ms(r['prefill_seconds'])} | {_ms(r['exposed_seconds'])} | **{100 * r['exposed_fraction']:.2f}%** | "
            f"{'-' if r['layerwise'] else _gbps(r['num_bytes'] / r['exposed_seconds'])} | "
            f"{_ms(r['ttft_seconds'])} | {_ms(r['sender_seconds'])} | "
            f"{r['num_send_in_place']}/{r['num_requests']} | {r['num_recv_in_place']}/{r['num_requests']} |"
        )
    return lines


def copy_table(rows: list[dict]) -> list[str]:
    lines = [
        "| preset | tokens | bytes | gather (pack) ms | scatter (unpack) ms | plain copy ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['preset']} | {r['num_tokens']} | {_mb(r['num_bytes'])} | {_ms(r['gather_seconds'])} | "
            f"{_ms(r['scatter_seconds'])} | {_ms(r['copy_seconds'])} |"
        )
    return lines


def verdicts(pair_rows: list[dict], actor_rows: list[dict]) -> list[str]:
    lines = []
    for layout in ("contiguous", "reversed", "scattered"):
        rows = [r for r in pair_rows if r["layout"] == layout]
        if rows:
            met = sum(r["ratio"] >= TARGET_RATIO for r in rows)
            worst = min(rows, key=lambda r: r["ratio"])
            lines.append(
                f"- Bandwidth >= {TARGET_RATIO}x raw, {layout} block ids: {met}/{len(rows)} rows "
                f"(lowest {worst['ratio']:.2f}: {worst['preset']} {worst['num_tokens']} tokens, "
                f"{'layer-wise' if worst['layerwise'] else 'packed'})."
            )
    for r in actor_rows:
        if r["num_tokens"] == 2048 and r["layerwise"]:
            ok = "met" if r["exposed_fraction"] <= TARGET_EXPOSED_FRACTION else "NOT met"
            lines.append(
                f"- Exposed transfer <= {TARGET_EXPOSED_FRACTION:.0%} of prefill at 2048 tokens, "
                f"{r['preset']}, layer-wise: {100 * r['exposed_fraction']:.2f}% ({ok})."
            )
    by_key = {(r["preset"], r["num_tokens"], r["layerwise"]): r for r in actor_rows}
    pairs = [(r, by_key[(p, n, False)]) for (p, n, lw), r in by_key.items() if lw and (p, n, False) in by_key]
    if pairs:
        better = sum(r["exposed_seconds"] < packed["exposed_seconds"] for r, packed in pairs)
        lines.append(
            f"- Layer-wise sending left less transfer exposed than one packed send after prefill "
            f"in {better}/{len(pairs)} configurations (same bytes, so the same CPU work, moved "
            f"under compute). Per configuration (decode TTFT medians mostly follow prefill-time "
            f"noise here):"
        )
    for (preset, num_tokens, layerwise), r in sorted(by_key.items()):
        packed = by_key.get((preset, num_tokens, False))
        if layerwise and packed:
            lines.append(
                f"  - {preset} {num_tokens} tokens: exposed "
                f"{_ms(r['exposed_seconds'])} vs {_ms(packed['exposed_seconds'])} ms, decode TTFT "
                f"{_ms(r['ttft_seconds'])} vs {_ms(packed['ttft_seconds'])} ms (medians)."
            )
    return lines


def plot(pair_rows: list[dict], actor_rows: list[dict], path: str) -> None:
    from splitserve.bench.loadgen.plots import plt

    fig, (left, right) = plt.subplots(
        1, 2, figsize=(13, 0.28 * len(pair_rows) + 2.5), gridspec_kw={"width_ratios": [3, 2]}
    )
    colors = {"contiguous": "tab:green", "reversed": "tab:orange", "scattered": "tab:red"}
    labels = [
        f"{r['preset']} {r['num_tokens']} {'layer-wise' if r['layerwise'] else 'packed'} {r['layout']}"
        for r in pair_rows
    ]
    ys = list(range(len(pair_rows)))[::-1]
    left.barh(ys, [r["ratio"] for r in pair_rows], color=[colors.get(r["layout"], "gray") for r in pair_rows])
    left.axvline(TARGET_RATIO, color="black", linestyle="--", label=f"{TARGET_RATIO}x target")
    left.set_yticks(ys, labels, fontsize=8)
    left.set_xlabel("KV bandwidth / raw gloo bandwidth (medians, same rounds)")
    left.set_title("KV path vs raw send/recv of the same bytes")
    left.legend(loc="lower right")
    labels = [f"{r['preset']}\n{r['num_tokens']}\n{'lw' if r['layerwise'] else 'pk'}" for r in actor_rows]
    right.bar(range(len(actor_rows)), [100 * r["exposed_fraction"] for r in actor_rows])
    right.axhline(100 * TARGET_EXPOSED_FRACTION, color="red", linestyle="--", label="5% target")
    right.set_xticks(range(len(actor_rows)), labels, fontsize=8)
    right.set_ylabel("exposed transfer / prefill (%)")
    right.set_title("Real actors: transfer left after prefill")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
