"""Autoscaling trace: a closed-loop load that rises, holds, falls and stops, run in-process
against a DisaggCluster on local Ray with both pools autoscaled. Samples replica counts per
pool, queue depth, TTFT and ITL over time and writes a plot and a Markdown summary.

  python -m splitserve.bench.control_plane.autoscale_trace                                   # tiny model, ~2.5 min
  python -m splitserve.bench.control_plane.autoscale_trace --preset small --peak-concurrency 24 --out bench/results

Outputs: <out>/autoscale_trace.png and <out>/autoscale_trace.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from splitserve.bench import require_extra, source_commit
from splitserve.bench.control_plane.autoscale_load import ClosedLoopLoad
from splitserve.cluster.config import ServeConfig
from splitserve.cluster.routing.replica_pools import DECODE, PREFILL
from splitserve.cluster.scaling.autoscaler import Autoscaler, ScalingEvent
from splitserve.proto.messages.sampling_params import SamplingParams


@dataclass
class Sample:
    t: float
    concurrency: int
    replicas: dict[str, int]  # serving (not draining) replicas per pool
    draining: dict[str, int]
    waiting: dict[str, int]  # requests queued in each pool's engines
    awaiting_first_token: int  # client view: sent, no token yet
    queued_prefill_tokens: int
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    itl_p50_ms: float | None
    itl_p90_ms: float | None


def concurrency_at(t: float, peak: int, rise_s: float, hold_s: float, fall_s: float) -> int:
    """0 -> peak linearly over rise_s, peak for hold_s, peak -> 0 over fall_s, then 0."""
    if t < rise_s:
        return round(peak * t / rise_s)
    if t < rise_s + hold_s:
        return peak
    if t < rise_s + hold_s + fall_s:
        return round(peak * (1 - (t - rise_s - hold_s) / fall_s))
    return 0


def build_config(args, model: str) -> ServeConfig:
    timing = {
        "enabled": True,
        "min_replicas": 1,
        "max_replicas": args.max_replicas,
        "step": 1,
        "upscale_delay_s": args.upscale_delay_s,
        "downscale_delay_s": args.downscale_delay_s,
        "interval_s": 0.25,
        "metrics_stale_s": 5.0,
    }
    pool = {"replicas": 1, "num_kv_blocks": 256, "resources": {"num_cpus": 1}, "torch_threads": 1}
    return ServeConfig.model_validate(
        {
            "model": model,
            "router": {"local_prefill_threshold": 0},
            "prefill": {
                **pool,
                "max_num_batched_tokens": 256,
                "autoscaling": {
                    **timing,
                    "target_queued_tokens_per_replica": args.target_queued_tokens,
                    "ttft_target_ms": args.ttft_target_ms,
                },
            },
            "decode": {
                **pool,
                "autoscaling": {
                    **timing,
                    "target_running_per_replica": args.target_running,
                    "target_kv_usage": 0.8,
                    "itl_target_ms": args.itl_target_ms,
                },
            },
        }
    )


async def run_trace(args, cfg: ServeConfig) -> tuple[list[Sample], list[ScalingEvent], ClosedLoopLoad]:
    from splitserve.cluster.control.disagg_cluster import DisaggCluster

    cluster = DisaggCluster(cfg, cfg.model, poll_interval_s=0.1)
    await cluster.start()
    prompt_len = args.prompt_len

    def make_prompt(i: int) -> list[int]:
        return [(31 * i + 7 * k) % 400 + 20 for k in range(prompt_len)]

    load = ClosedLoopLoad(
        cluster,
        make_prompt,
        SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True),
        max_concurrency=args.peak_concurrency,
        latency_window_s=2.0,
    )
    autoscaler = Autoscaler(cluster, cfg, latency_source=load.latency_ms, drain_timeout_s=120)
    samples: list[Sample] = []
    total_s = args.rise_s + args.hold_s + args.fall_s + args.tail_s
    router = cluster.router
    try:
        autoscaler.start()
        load.start()
        start = time.monotonic()
        while (t := time.monotonic() - start) < total_s:
            load.concurrency = concurrency_at(t, args.peak_concurrency, args.rise_s, args.hold_s, args.fall_s)
            replicas, draining, waiting, queued = {}, {}, {}, 0
            for pool in (PREFILL, DECODE):
                ids = router.replica_ids(pool)
                serving = router.replica_ids(pool, include_draining=False)
                replicas[pool], draining[pool] = len(serving), len(ids) - len(serving)
                loads = [router.load(pool, rid) for rid in ids]
                waiting[pool] = sum(l.report.num_waiting for l in loads)
                if pool == PREFILL:
                    queued = sum(l.report.queued_prefill_tokens for l in loads)
            samples.append(
                Sample(
                    t,
                    load.concurrency,
                    replicas,
                    draining,
                    waiting,
                    load.num_awaiting_first_token,
                    queued,
                    load.ttft_window.percentile_ms(50),
                    load.ttft_window.percentile_ms(90),
                    load.itl_window.percentile_ms(50),
                    load.itl_window.percentile_ms(90),
                )
            )
            await asyncio.sleep(args.sample_interval_s)
    finally:
        await load.stop(120)
        await autoscaler.stop()
        await cluster.shutdown()
    events = [
        dataclasses.replace(
            e,
            at=e.at - start,  # trace-relative times
            finished_at=None if e.finished_at is None else e.finished_at - start,
        )
        for e in autoscaler.events
    ]
    return samples, events, load


def plot(samples: list[Sample], events: list[ScalingEvent], out: Path, title: str) -> None:
    from splitserve.bench.loadgen.plots import plt

    t = [s.t for s in samples]
    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    ax = axes[0]
    for pool, color in ((PREFILL, "tab:blue"), (DECODE, "tab:orange")):
        ax.step(t, [s.replicas[pool] for s in samples], where="post", color=color, label=f"{pool} replicas")
        ax.step(
            t,
            [s.replicas[pool] + s.draining[pool] for s in samples],
            where="post",
            color=color,
            linestyle=":",
            label=f"{pool} incl. draining",
        )
    ax.set_ylabel("replicas")
    ax.legend(loc="upper left", fontsize=8)
    twin = ax.twinx()
    twin.plot(t, [s.concurrency for s in samples], color="grey", alpha=0.5, label="offered concurrency")
    twin.set_ylabel("concurrency")
    twin.legend(loc="upper right", fontsize=8)
    ax = axes[1]
    ax.plot(
        t, [s.awaiting_first_token for s in samples], color="black", label="requests awaiting first token (client view)"
    )
    ax.plot(t, [s.waiting[PREFILL] for s in samples], color="tab:blue", label="prefill engine waiting")
    ax.plot(t, [s.waiting[DECODE] for s in samples], color="tab:orange", label="decode engine waiting")
    ax.set_ylabel("queue depth (requests)")
    ax.legend(loc="upper left", fontsize=8)
    twin = ax.twinx()
    twin.plot(
        t,
        [s.queued_prefill_tokens for s in samples],
        color="tab:green",
        alpha=0.5,
        linewidth=0.8,
        linestyle=":",
        label="queued prefill tokens",
    )
    twin.set_ylabel("tokens")
    twin.legend(loc="upper right", fontsize=8)
    for ax, name, p50, p90 in (
        (axes[2], "TTFT", "ttft_p50_ms", "ttft_p90_ms"),
        (axes[3], "ITL", "itl_p50_ms", "itl_p90_ms"),
    ):
        for attr, style in ((p50, "-"), (p90, "--")):
            ax.plot(
                t,
                [getattr(s, attr) if getattr(s, attr) is not None else float("nan") for s in samples],
                linestyle=style,
                color="black",
                label=f"{name} {attr.split('_')[1]} (2 s window)",
            )
        ax.set_ylabel(f"{name} (ms)")
        ax.legend(loc="upper left", fontsize=8)
    for event in events:
        color = "tab:blue" if event.pool == PREFILL else "tab:orange"
        for ax in axes:
            ax.axvline(event.at, color=color, alpha=0.3, linestyle="-" if event.action == "up" else "--")
    axes[-1].set_xlabel("seconds since the trace started (vertical lines: scale up —, down --)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def write_report(
    args, samples: list[Sample], events: list[ScalingEvent], load: ClosedLoopLoad, out: Path, command: str
) -> None:
    def peak(pool):
        return max(s.replicas[pool] for s in samples)

    def fmt(v):
        return "-" if v is None else f"{v:.0f}"

    def fmt_s(v):
        return "-" if v is None else f"{v:.1f}"

    lines = [
        "# Autoscaling trace",
        "",
        "Command (from the repo root, on the 2-core shared CPU dev box, no GPU):",
        "",
        "```",
        command,
        "```",
        "",
        source_commit(),
        "",
        f"Model preset `{args.preset}`; closed-loop load: concurrency 0 -> {args.peak_concurrency} over "
        f"{args.rise_s:.0f} s, held {args.hold_s:.0f} s, down to 0 over {args.fall_s:.0f} s, then idle "
        f"{args.tail_s:.0f} s. Prompts of {args.prompt_len} tokens, {args.max_tokens} output tokens.",
        "",
        f"Policies (min 1, max {args.max_replicas}, step 1, upscale after {args.upscale_delay_s:.1f} s, downscale after {args.downscale_delay_s:.1f} s): prefill "
        f"targets {args.target_queued_tokens} queued tokens/replica and TTFT p90 {args.ttft_target_ms:.0f} ms; decode targets {args.target_running} running/replica, "
        f"KV usage 0.8 and ITL p90 {args.itl_target_ms:.0f} ms.",
        "",
        f"Requests: {load.num_ok} completed, **{load.num_failed} failed**. Peak replicas: prefill "
        f"{peak(PREFILL)}, decode {peak(DECODE)}; at the end: prefill {samples[-1].replicas[PREFILL]}, "
        f"decode {samples[-1].replicas[DECODE]}.",
        "",
        "All replicas share the same 2 CPU cores here, so added replicas add no compute: the trace "
        "shows the control loop (when each pool scales and that draining loses nothing), not a "
        "latency win. On GPUs each replica brings its own device.",
        "",
        "![replicas, queue depth, TTFT and ITL over time](autoscale_trace.png)",
        "",
        "Scaling actions (decided at t; done when the new replica was loaded, indexed and routed to, "
        "or the drained one removed):",
        "",
        "| t (s) | done (s) | pool | action | replicas | reason |",
        "|---|---|---|---|---|---|",
    ]
    for e in events:
        lines.append(
            f"| {e.at:.1f} | {fmt_s(e.finished_at)} | {e.pool} | {e.action} | "
            f"{e.from_replicas} -> {e.to_replicas} | {e.reason} |"
        )
    lines += [
        "",
        f"Sampled every {args.sample_interval_s:.1f} s (every {max(len(samples) // 20, 1)}th sample shown):",
        "",
        "| t (s) | concurrency | prefill | decode | awaiting first token | TTFT p90 ms | ITL p90 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    step = max(len(samples) // 20, 1)
    for s in samples[::step]:
        lines.append(
            f"| {s.t:.0f} | {s.concurrency} | {s.replicas[PREFILL]} | {s.replicas[DECODE]} | "
            f"{s.awaiting_first_token} | {fmt(s.ttft_p90_ms)} | {fmt(s.itl_p90_ms)} |"
        )
    out.write_text("\n".join(lines) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (default: a random one of --preset)")
    parser.add_argument("--preset", default="tiny", choices=("tiny", "small", "bench"))
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--peak-concurrency", type=int, default=16)
    parser.add_argument("--rise-s", type=float, default=30.0)
    parser.add_argument("--hold-s", type=float, default=20.0)
    parser.add_argument("--fall-s", type=float, default=25.0)
    parser.add_argument("--tail-s", type=float, default=30.0)
    parser.add_argument("--prompt-len", type=int, default=192)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-replicas", type=int, default=3)
    parser.add_argument("--upscale-delay-s", type=float, default=1.0)
    parser.add_argument("--downscale-delay-s", type=float, default=5.0)
    parser.add_argument("--target-queued-tokens", type=int, default=256)
    parser.add_argument("--ttft-target-ms", type=float, default=400.0)
    parser.add_argument("--target-running", type=int, default=4)
    parser.add_argument("--itl-target-ms", type=float, default=60.0)
    parser.add_argument("--sample-interval-s", type=float, default=0.5)
    parser.add_argument("--num-cpus", type=int, default=8, help="CPUs Ray advertises (one per replica)")
    args = parser.parse_args(argv)
    if args.peak_concurrency < 1 or args.max_replicas < 1:
        parser.error("--peak-concurrency and --max-replicas must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    require_extra("matplotlib")  # fail now, not after the trace has run
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    from splitserve.engine.builtin_models.make_model import write_random_checkpoint

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = "python -m splitserve.bench.control_plane.autoscale_trace " + " ".join(
        shlex.quote(a) for a in (argv or sys.argv[1:])
    )
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(write_random_checkpoint(Path(tmp) / args.preset, preset=args.preset, seed=0))
        cfg = build_config(args, model)
        ray.init(
            num_cpus=args.num_cpus,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            logging_level="ERROR",
            log_to_driver=False,
        )
        try:
            samples, events, load = asyncio.run(run_trace(args, cfg))
        finally:
            ray.shutdown()
    title = f"splitserve autoscaling trace ({args.preset} model, CPU): {load.num_ok} requests, {load.num_failed} failed"
    plot(samples, events, out_dir / "autoscale_trace.png", title)
    write_report(args, samples, events, load, out_dir / "autoscale_trace.md", command.strip())
    print(
        f"wrote {out_dir / 'autoscale_trace.png'} and {out_dir / 'autoscale_trace.md'}; "
        f"{load.num_ok} ok, {load.num_failed} failed, {len(events)} scaling actions"
    )
    return 1 if load.num_failed else 0


if __name__ == "__main__":
    sys.exit(main())
