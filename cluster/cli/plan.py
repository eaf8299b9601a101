"""`splitserve plan`: the fewest GPUs that hold TTFT and ITL at a percentile, offline.

Predicts each configuration with a queue model (a discrete-event simulation of the
scheduler's batching on the step-time profile: prefill queue wait, chunking, the KV link, the
decode batch's step time), then prints the cheapest one as a ServeConfig YAML snippet and the
runners-up with their predicted TTFT, ITL and goodput (the share of requests meeting both).
Colocated (prefill replicas 0) and disaggregated splits are both searched, with
max_num_batched_tokens from a small grid, and each pool at every tensor-parallel size the
profile has figures for (--tensor-parallel-sizes narrows it; a TP-t replica holds t GPUs). Lengths are fixed (512) or mean+-spread (512+-128: uniform); arrivals at --rate are
Poisson. Exit status: 0 a plan, 1 no configuration meets the SLOs, 2 bad input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from splitserve.cluster.planning.queue_model import Deployment, Prediction, Slo
from splitserve.cluster.planning.search import BATCHED_TOKENS_GRID, Plan, search
from splitserve.cluster.planning.workload import LengthDistribution, Workload
from splitserve.engine.config import ConfigError
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.simulated.simulated_kv_cache import kv_bytes_per_token
from splitserve.engine.simulated.step_time_profile import StepTimeProfile


def add_plan_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan",
        help="size prefill and decode pools for TTFT and ITL targets at the fewest GPUs (offline)",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--profile", required=True, help="step-time profile: a shipped name (llama-8b-h200, ...) or a file")
    p.add_argument("--model", help="checkpoint directory: named in the snippet, and checked against the profile")
    p.add_argument("--trace", help="a JSONL trace (timestamp ms, input_length, output_length per line)")
    p.add_argument("--trace-speedup", type=float, default=1.0, help="replay the trace this many times faster")
    p.add_argument("--rate", type=float, help="arrival rate, req/s (Poisson), instead of --trace")
    p.add_argument("--input-len", default="1024", help="prompt tokens: N or MEAN+-SPREAD (default 1024)")
    p.add_argument("--output-len", default="256", help="output tokens: N or MEAN+-SPREAD (default 256)")
    p.add_argument("--num-requests", type=int, default=1000, help="requests simulated at --rate (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrivals and lengths")
    p.add_argument("--ttft-slo", type=float, required=True, metavar="MS", help="TTFT target, milliseconds")
    p.add_argument(
        "--itl-slo", type=float, required=True, metavar="MS", help="inter-token latency target, milliseconds"
    )
    p.add_argument("--percentile", type=float, default=90.0, help="percentile both targets hold at (default 90)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs available, one per replica (default 8)")
    grid = ",".join(map(str, BATCHED_TOKENS_GRID))
    p.add_argument(
        "--max-num-batched-tokens", default=grid, help=f"the grid searched, comma-separated (default {grid})"
    )
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences per running batch (default 64)")
    p.add_argument(
        "--tensor-parallel-sizes",
        help="TP sizes searched per pool, comma-separated (default: every size the profile has figures for)",
    )
    p.add_argument("--runners-up", type=int, default=8, help="runner-up configurations listed (default 8)")
    p.add_argument("--out", help="write the YAML snippet here too")
    p.set_defaults(func=run_plan)
    return p


def run_plan(args: argparse.Namespace) -> int:
    try:
        profile, workload, slo, kv_bytes, grid = _inputs(args)
        tp_sizes = _tp_sizes(args.tensor_parallel_sizes, profile)
    except ConfigError as exc:
        print(f"splitserve plan: {exc}", file=sys.stderr)
        return 2
    target = f"TTFT p{slo.percentile:g} <= {args.ttft_slo:g} ms, ITL p{slo.percentile:g} <= {args.itl_slo:g} ms"
    print(f"# {workload.description}; profile {profile.name}; {target}; up to {args.gpus} GPUs")
    plan = search(profile, workload, slo, args.gpus, kv_bytes, grid, args.max_num_seqs, tp_sizes)
    if plan.winner is None:
        print(f"no configuration of up to {args.gpus} GPUs meets {plan.shortfall()}")
    else:
        snippet = yaml.safe_dump(serve_config_snippet(plan.winner.deployment, args.model), sort_keys=False)
        print(f"# the fewest GPUs: {plan.winner.deployment.gpus} ({plan.winner.deployment})\n{snippet}", end="")
        if args.out:
            Path(args.out).write_text(snippet)
    print(format_table(plan, args.runners_up))
    return 0 if plan.winner is not None else 1


def _inputs(args: argparse.Namespace) -> tuple[StepTimeProfile, Workload, Slo, int, tuple[int, ...]]:
    profile = StepTimeProfile.load(args.profile)
    if args.trace and args.rate is not None:
        raise ConfigError("give --trace or --rate, not both")
    if args.trace:
        workload = Workload.from_trace(args.trace, args.trace_speedup)
    elif args.rate is not None:
        lengths = (
            LengthDistribution.parse(args.input_len, "--input-len"),
            LengthDistribution.parse(args.output_len, "--output-len"),
        )
        workload = Workload.poisson(args.rate, *lengths, args.num_requests, args.seed)
    else:
        raise ConfigError("give a workload: --trace FILE, or --rate R (with --input-len, --output-len)")
    if not (args.ttft_slo > 0 and args.itl_slo > 0 and 0 < args.percentile < 100 and args.gpus >= 1):
        raise ConfigError("--ttft-slo and --itl-slo must be > 0, --percentile in (0, 100), --gpus >= 1")
    kv_bytes = profile.kv_bytes_per_token
    if args.model:
        model = ModelConfig.from_pretrained(args.model)
        own = kv_bytes_per_token(model, None)
        if kv_bytes is not None and kv_bytes != own:
            raise ConfigError(
                f"profile {profile.name} is for another model ({kv_bytes} KV bytes per token; "
                f"{args.model} has {own}): profile this model, or pass its own profile"
            )
        if workload.max_total_tokens > model.max_context_len:
            raise ConfigError(
                f"the workload's longest request ({workload.max_total_tokens} tokens) exceeds {args.model}'s context"
            )
        kv_bytes = own
    if kv_bytes is None:
        raise ConfigError(f"profile {profile.name} does not give kv_bytes_per_token: pass --model DIR")
    try:
        grid = tuple(sorted({int(v) for v in args.max_num_batched_tokens.split(",")}))
    except ValueError:
        raise ConfigError(
            f"--max-num-batched-tokens {args.max_num_batched_tokens!r}: give integers, comma-separated"
        ) from None
    if not grid or grid[0] < 16:
        raise ConfigError("--max-num-batched-tokens: each must be >= 16")
    return profile, workload, Slo(args.ttft_slo / 1000, args.itl_slo / 1000, args.percentile), kv_bytes, grid


def _tp_sizes(text: str | None, profile: StepTimeProfile) -> tuple[int, ...]:
    if text is None:
        return tuple(profile.tensor_parallel_sizes)
    try:
        sizes = tuple(sorted({int(v) for v in text.split(",")}))
    except ValueError:
        raise ConfigError(f"--tensor-parallel-sizes {text!r}: give integers, comma-separated") from None
    for size in sizes:
        profile.for_tensor_parallel(size)  # names the sizes the profile has
    return sizes


def serve_config_snippet(deployment: Deployment, model: str | None = None) -> dict[str, Any]:
    """ServeConfig fields (a --config file) for the deployment: one GPU per rank, so a pool's
    replica of TP t asks for t GPUs on one node."""

    def pool(replicas: int, tp: int) -> dict[str, Any]:
        return {
            "replicas": replicas,
            "tensor_parallel_size": tp,
            "max_num_batched_tokens": deployment.max_num_batched_tokens,
            "max_num_seqs": deployment.max_num_seqs,
            "resources": {"num_gpus": 1},
        }

    snippet: dict[str, Any] = {"model": model} if model else {}
    if deployment.colocated:
        snippet["prefill"] = {"replicas": 0}  # decode replicas prefill locally
    else:
        snippet["prefill"] = pool(deployment.prefill_replicas, deployment.prefill_tp)
    snippet["decode"] = pool(deployment.decode_replicas, deployment.decode_tp)
    return snippet


def format_table(plan: Plan, runners_up: int) -> str:
    p = f"p{plan.slo.percentile:g}"
    rows = [f"{'':2}{'GPUs':>4}  {'configuration':<44}{'TTFT ' + p:>12}{'ITL ' + p:>12}{'goodput':>9}  meets"]
    shown = ([plan.winner] if plan.winner else []) + plan.runners_up(runners_up)
    for prediction in shown:
        mark = "*" if prediction is plan.winner else ""
        rows.append(
            f"{mark:2}{prediction.deployment.gpus:>4}  {str(prediction.deployment):<44}{_cell(prediction.ttft_s):>12}"
            f"{_cell(prediction.itl_s):>12}{prediction.goodput:>9.3f}  {_meets(prediction, plan.slo)}"
        )
    return "\n".join(rows)


def _cell(seconds: float) -> str:
    return "saturated" if seconds == float("inf") else f"{seconds * 1000:.1f} ms"


def _meets(prediction: Prediction, slo: Slo) -> str:
    if prediction.saturated:
        return f"no ({prediction.saturated} saturated)"
    return "yes" if prediction.meets(slo) else "no"
