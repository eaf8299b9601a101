"""Issue 40's benchmark: a bursty trace shaped like dynamo #10528 (sinusoidal arrivals between
1 and 24 req/s, ~8k input and ~1k output tokens) served on the simulated engine with the
llama-8b-h200 profile, three ways, on the same requests:

  static    the cheapest deployment `splitserve plan` finds for the peak rate (TP 1);
  reactive  the reactive policies (cluster/scaling/policy.py) with their shipped settings, the
            SLOs as their latency targets, bounds 1..the static deployment's count per pool;
  sla       the live `sla` policy, same bounds, GPU budget the static deployment's GPUs.

Both autoscaled runs use the controller's own Autoscaler over the virtual-time cluster
(virtual_autoscaling.py); a new replica serves `--startup-s` after it is asked for.

  python -m splitserve.bench.control_plane.bursty_autoscaling --out bench/results

Appends (or replaces) the "Bursty trace" section of <out>/sla_planner.md and writes
<out>/sla_planner.png.
"""

from __future__ import annotations

import argparse
import math
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

from splitserve.bench import source_commit
from splitserve.bench.control_plane.bursty_autoscaling_report import PolicyRun, write_report
from splitserve.bench.control_plane.virtual_autoscaling import run_autoscaled
from splitserve.bench.control_plane.virtual_time_cluster import VirtualTimeCluster, long_context_copy
from splitserve.cluster.config import ServeConfig
from splitserve.cluster.planning.queue_model import Deployment, Slo
from splitserve.cluster.planning.search import search
from splitserve.cluster.planning.workload import LengthDistribution, PlannedRequest, Workload
from splitserve.cluster.routing.replica_pools import DECODE, PREFILL
from splitserve.engine.builtin_models.model_cache import cached_checkpoint
from splitserve.engine.builtin_models.model_spec import ModelSpec
from splitserve.engine.simulated.step_time_profile import StepTimeProfile

# One H200 (141 GB) at 90% memory use, less 16 GB of Llama-3.1-8B bf16 weights and ~5 GB of
# activations: ~106 GB of KV at 128 KiB per token, in 16-token blocks.
H200_KV_BLOCKS = 50_000


def sinusoidal_workload(
    low: float,
    high: float,
    period_s: float,
    duration_s: float,
    input_len: LengthDistribution,
    output_len: LengthDistribution,
    seed: int = 0,
) -> Workload:
    """Poisson arrivals at rate low + (high - low)(1 - cos(2 pi t / period)) / 2 (the trough at
    t = 0, the peak at period / 2), by thinning a rate-`high` process; seeded."""
    rng, t, requests = random.Random(seed), 0.0, []
    while (t := t + rng.expovariate(high)) < duration_s:
        rate = low + (high - low) * (1 - math.cos(2 * math.pi * t / period_s)) / 2
        if rng.random() < rate / high:
            requests.append(PlannedRequest(t, input_len.draw(rng), output_len.draw(rng)))
    described = (
        f"sinusoidal {low:g} <-> {high:g} req/s, period {period_s:g} s, {duration_s:g} s, "
        f"input {input_len}, output {output_len} tokens, {len(requests)} requests"
    )
    return Workload(tuple(requests), described)


def serve_config(
    policy: str | None, static: Deployment, slo: Slo, profile: str, startup_s: float, window_s: float | None = None
) -> ServeConfig:
    """policy None: the static deployment; "reactive" / "sla": pools autoscaled from 1 up to the
    static deployment's count, the SLOs as the latency targets; window_s: planner.window_s
    (None: its default)."""
    planner = {"gpu_budget": static.gpus, "startup_s": startup_s, "percentile": slo.percentile}
    if window_s is not None:
        planner["window_s"] = window_s

    def scaling(enabled: bool, maximum: int) -> dict:
        return {
            "enabled": enabled,
            "policy": policy or "reactive",
            "min_replicas": 1,
            "max_replicas": maximum,
            "interval_s": 5.0 if policy == "sla" else 1.0,  # the sla policy's plans simulate: every 5 s
        }

    prefill = scaling(policy is not None and not static.colocated, max(static.prefill_replicas, 1))
    decode = scaling(policy is not None, static.decode_replicas)
    return ServeConfig.model_validate(
        {
            "engine": "simulated",
            "engine_profile": profile,
            "prefill": {
                "replicas": static.prefill_replicas,
                "autoscaling": {**prefill, "ttft_target_ms": slo.ttft_s * 1000},
            },
            "decode": {
                "replicas": static.decode_replicas,
                "max_num_batched_tokens": static.max_num_batched_tokens,
                "max_num_seqs": static.max_num_seqs,
                "autoscaling": {**decode, "itl_target_ms": slo.itl_s * 1000},
            },
            "planner": planner,
        }
    )


def run_policy(args, model: str, name: str, static: Deployment, slo: Slo, workload: Workload) -> PolicyRun:
    policy = None if name == "static" else name
    cfg = serve_config(policy, static, slo, args.profile, args.startup_s, args.window_s)
    cluster = VirtualTimeCluster(
        model,
        args.profile,
        static.colocated,
        static.max_num_seqs,
        static.max_num_batched_tokens,
        workload.max_total_tokens,
        args.kv_bytes_per_token,
        num_kv_blocks=H200_KV_BLOCKS,
    )
    if policy is None:
        initial = {PREFILL: static.prefill_replicas, DECODE: static.decode_replicas}
    else:
        initial = {PREFILL: 0 if static.colocated else 1, DECODE: 1}
    started = time.perf_counter()
    run = run_autoscaled(cfg, cluster, workload, initial, args.startup_s)
    print(f"{name}: served in {time.perf_counter() - started:.0f} s", flush=True)
    return PolicyRun(name, cfg, run, time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--profile", default="llama-8b-h200")
    parser.add_argument("--low", type=float, default=1.0, help="trough arrival rate, req/s")
    parser.add_argument("--high", type=float, default=24.0, help="peak arrival rate, req/s")
    parser.add_argument("--period-s", type=float, default=300.0, help="dynamo #10528 used 900 s")
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--input-len", default="8000+-1000")
    parser.add_argument("--output-len", default="1000+-200")
    parser.add_argument("--ttft-ms", type=float, default=3000.0)
    parser.add_argument("--itl-ms", type=float, default=35.0)
    parser.add_argument("--startup-s", type=float, default=30.0, help="seconds a new replica takes to serve")
    parser.add_argument("--window-s", type=float, default=None, help="planner.window_s (default: its default)")
    parser.add_argument("--max-gpus", type=int, default=24, help="most GPUs the static search tries")
    parser.add_argument("--policies", default="static,reactive,sla")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    commit = source_commit()  # the code that runs, whatever is committed meanwhile
    profile = StepTimeProfile.load(args.profile)
    args.kv_bytes_per_token = profile.kv_bytes_per_token or 0
    lengths = LengthDistribution.parse(args.input_len, "input"), LengthDistribution.parse(args.output_len, "output")
    slo = Slo(args.ttft_ms / 1000, args.itl_ms / 1000, 90)
    workload = sinusoidal_workload(args.low, args.high, args.period_s, args.duration_s, *lengths, seed=args.seed)
    peak = Workload.poisson(args.high, *lengths, 400, seed=args.seed)
    plan = search(profile, peak, slo, args.max_gpus, args.kv_bytes_per_token, tp_sizes=(1,))
    if plan.winner is None:
        print(f"no configuration meets {plan.shortfall()}", file=sys.stderr)
        return 1
    print(f"{workload.description}; static for the peak: {plan.winner.deployment}", flush=True)
    tiny = cached_checkpoint(ModelSpec(preset="tiny")).path
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        model = long_context_copy(tiny, Path(tmp) / "long-context")
        for name in args.policies.split(","):
            runs.append(run_policy(args, model, name, plan.winner.deployment, slo, workload))
    command = "python -m splitserve.bench.control_plane.bursty_autoscaling " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )
    write_report(Path(args.out), args, command, commit, workload, plan.winner, slo, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
