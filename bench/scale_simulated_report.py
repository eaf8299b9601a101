"""The plot and the table of bench/scale_simulated.py's rows (JSON lines).

    python -m splitserve.bench.scale_simulated_report bench/results/scale_simulated.json \\
        --png bench/results/scale_simulated.png
"""

from __future__ import annotations

import argparse
import json


def table(rows: list[dict]) -> list[str]:
    base = next((r for r in rows if "sim_tokens_per_s" in r), None)
    lines = [
        "| decode | prefill | start s | sim tok/s | per replica vs n=1 | route us p50 / p99 | CPU ms/token "
        "| polls/s (idle) | poll KB/s (load) | events/s (load) | idle CPU: all / no ingress polls "
        "| probe round ms p50 / p99 | view bytes | new replica routable s |",
        "|" + "---|" * 14,
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['decode']} | skipped: {r['skipped']} |" + " |" * 12)
            continue
        scale = (r["sim_tokens_per_s"] / r["decode"]) / (base["sim_tokens_per_s"] / base["decode"])
        lines.append(
            f"| {r['decode']} | {r['prefill']} | {r['start_s']:.0f} | {r['sim_tokens_per_s']:.0f} | {scale:.2f} "
            f"| {r['route_us_p50']:.0f} / {r['route_us_p99']:.0f} | {r['cpu_ms_per_token']:.2f} "
            f"| {r['idle_polls_per_s']:.0f} | {r['poll_bytes_per_s'] / 1e3:.1f} | {r['events_per_s']:.0f} "
            f"| {r['idle_cpu_share']:.1%} / {r['idle_cpu_share_no_ingress_poll']:.1%} "
            f"| {r['probe_round_ms_p50']:.1f} / {r['probe_round_ms_p99']:.1f} | {r['view_bytes']} "
            f"| {r['new_replica_routable_s']:.1f} |"
        )
    return lines


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "sim_tokens_per_s" in r]
    n = [r["decode"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    base = rows[0]["sim_tokens_per_s"] / rows[0]["decode"]
    axes[0].plot(n, [r["sim_tokens_per_s"] for r in rows], "o-", label="measured")
    axes[0].plot(n, [base * x for x in n], "--", label="linear from n=1")
    axes[0].set(xscale="log", yscale="log", xlabel="decode replicas", ylabel="simulated tokens/s", title="Throughput")
    axes[1].plot(n, [100 * r["idle_cpu_share"] for r in rows], "o-", label="ingress polls + controller")
    axes[1].plot(n, [100 * r["idle_cpu_share_no_ingress_poll"] for r in rows], "s-", label="controller only")
    axes[1].axhline(5, color="red", ls=":", label="goal: 5% per ingress")
    axes[1].set(xscale="log", xlabel="decode replicas", ylabel="% of one core", title="Idle control plane CPU")
    axes[2].plot(n, [r["probe_round_ms_p50"] for r in rows], "o-", label="probe round p50 (ms)")
    axes[2].plot(n, [r["route_us_p99"] / 1e3 for r in rows], "s-", label="route p99 (ms)")
    axes[2].plot(n, [r["cpu_ms_per_token"] for r in rows], "^-", label="process CPU per token (ms)")
    axes[2].set(xscale="log", yscale="log", xlabel="decode replicas", title="Per-operation cost")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
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
