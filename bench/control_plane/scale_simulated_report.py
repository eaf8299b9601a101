"""The plot and the table of bench/control_plane/scale_simulated.py's rows (JSON lines).

    python -m splitserve.bench.control_plane.scale_simulated_report bench/results/scale_simulated.json \\
        --png bench/results/scale_simulated.png
"""

from __future__ import annotations

import argparse
import json


def _mode(r: dict) -> str:
    return r.get("mode", "poll")  # rows written before push existed polled


def table(rows: list[dict]) -> list[str]:
    """One line per size and mode; scaling is against n=1 of the same mode."""
    base = {}
    for r in rows:
        if "sim_tokens_per_s" in r:
            base.setdefault(_mode(r), r)
    lines = [
        "| decode | prefill | mode | start s | sim tok/s | per replica vs n=1 | route us p50 / p99 | CPU ms/token "
        "| state msgs/s (idle) | state KB/s (load) | events/s (load) | idle CPU: all / no ingress following "
        "| push handling CPU: idle / load | probe round ms p50 / p99 | view bytes | new replica routable s |",
        "|" + "---|" * 16,
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['decode']} | skipped: {r['skipped']} |" + " |" * 14)
            continue
        b = base[_mode(r)]
        scale = (r["sim_tokens_per_s"] / r["decode"]) / (b["sim_tokens_per_s"] / b["decode"])
        push = (
            f"{r['idle_push_cpu_share']:.2%} / {r['push_cpu_share_loaded']:.2%}"
            if _mode(r) == "push" and "push_cpu_share_loaded" in r
            else "-"
        )
        lines.append(
            f"| {r['decode']} | {r['prefill']} | {_mode(r)} | {r['start_s']:.0f} | {r['sim_tokens_per_s']:.0f} "
            f"| {scale:.2f} | {r['route_us_p50']:.0f} / {r['route_us_p99']:.0f} | {r['cpu_ms_per_token']:.2f} "
            f"| {r['idle_polls_per_s']:.0f} | {r['poll_bytes_per_s'] / 1e3:.1f} | {r['events_per_s']:.0f} "
            f"| {r['idle_cpu_share']:.1%} / {r['idle_cpu_share_no_ingress_poll']:.1%} | {push} "
            f"| {r['probe_round_ms_p50']:.1f} / {r['probe_round_ms_p99']:.1f} | {r['view_bytes']} "
            f"| {r['new_replica_routable_s']:.1f} |"
        )
    return lines


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    measured = [r for r in rows if "sim_tokens_per_s" in r]
    for mode, marker in (("poll", "o"), ("push", "s")):
        mine = [r for r in measured if _mode(r) == mode]
        if not mine:
            continue
        n = [r["decode"] for r in mine]
        base = mine[0]["sim_tokens_per_s"] / mine[0]["decode"]
        axes[0].plot(n, [r["sim_tokens_per_s"] for r in mine], f"{marker}-", label=f"{mode}: measured")
        if mode == "poll":
            axes[0].plot(n, [base * x for x in n], "--", color="gray", label="linear from n=1")
        axes[1].plot(n, [100 * r["idle_cpu_share"] for r in mine], f"{marker}-", label=f"{mode}: ingress + controller")
        axes[1].plot(
            n, [100 * r["idle_cpu_share_no_ingress_poll"] for r in mine], f"{marker}:", label=f"{mode}: controller only"
        )
        axes[2].plot(n, [r["probe_round_ms_p50"] for r in mine], f"{marker}-", label=f"{mode}: probe round p50 (ms)")
        axes[2].plot(n, [r["route_us_p99"] / 1e3 for r in mine], f"{marker}--", label=f"{mode}: route p99 (ms)")
    axes[0].set(xscale="log", yscale="log", xlabel="decode replicas", ylabel="simulated tokens/s", title="Throughput")
    axes[1].axhline(5, color="red", ls=":", label="goal: 5% per ingress")
    axes[1].set(xscale="log", xlabel="decode replicas", ylabel="% of one core", title="Idle control plane CPU")
    axes[2].set(xscale="log", yscale="log", xlabel="decode replicas", title="Per-operation wall time")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rows")
    parser.add_argument("--png", default=None)
    args = parser.parse_args(argv)
    with open(args.rows) as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    print("\n".join(table(rows)))
    if args.png:
        plot(rows, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
