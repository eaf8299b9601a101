"""`splitserve plan` against the simulated engine: for each workload, the configurations the
planner ranks first (the winner and its runners-up) are served on simulated engines in virtual
time (virtual_time_cluster.py: the real scheduler, block pool, KV handoff) and the predicted
TTFT p90, ITL p90 and goodput are set beside the measured ones.

  python -m splitserve.bench.control_plane.plan_vs_simulated --out bench/results

Writes <out>/sla_planner.md.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

from splitserve.bench import source_commit
from splitserve.bench.control_plane.virtual_time_cluster import MeasuredRequest, long_context_copy, run_virtual_time
from splitserve.cluster.planning.queue_model import Prediction, Slo, percentile
from splitserve.cluster.planning.search import search
from splitserve.cluster.planning.workload import LengthDistribution, Workload
from splitserve.engine.builtin_models.model_cache import cached_checkpoint
from splitserve.engine.builtin_models.model_spec import ModelSpec
from splitserve.engine.simulated.step_time_profile import StepTimeProfile

# The heading from which bursty_autoscaling.py writes its section of the same write-up.
SECTION = "## Bursty trace: static, reactive and `sla` side by side"
# (name, rate req/s, input, output, SLO): the issue's ~8k-in / ~1k-out shape at a steady rate, a
# chat-like mix, and a tight ITL tail (p99) that colocated prompt chunks break
WORKLOADS = (
    ("8k-in-1k-out", 3.0, "8192+-2048", "1024+-256", Slo(1.0, 0.020, 90)),
    ("2k-in-256-out", 12.0, "2048+-1024", "256+-128", Slo(1.0, 0.020, 90)),
    ("4k-in-512-out", 4.0, "4096", "512", Slo(1.0, 0.015, 99)),
)


def measured_goodput(requests: list[MeasuredRequest], slo: Slo) -> float:
    good = 0
    for r in requests:
        gaps = r.gaps
        good += r.ttft_s <= slo.ttft_s and (not gaps or percentile(gaps, slo.percentile) <= slo.itl_s)
    return good / len(requests)


def rows_for(args, model: str, profile: StepTimeProfile, name: str, workload: Workload, slo: Slo) -> list[str]:
    plan = search(profile, workload, slo, args.gpus, profile.kv_bytes_per_token or 0)
    shown: list[Prediction] = [p for p in plan.evaluated if p.saturated is None][: args.configs]
    rows = []
    for prediction in shown:
        started = time.perf_counter()
        served = run_virtual_time(model, args.profile, workload, prediction.deployment, profile.kv_bytes_per_token or 0)
        ttft = percentile([r.ttft_s for r in served], slo.percentile)
        itl = percentile([g for r in served for g in r.gaps], slo.percentile)
        mark = "winner" if prediction is plan.winner else ""
        rows.append(
            f"| {name} | {prediction.deployment} | {prediction.deployment.gpus} {mark} | "
            f"{prediction.ttft_s * 1000:.1f} / {ttft * 1000:.1f} | {prediction.itl_s * 1000:.2f} / {itl * 1000:.2f} | "
            f"{prediction.goodput:.3f} / {measured_goodput(served, slo):.3f} | "
            f"{abs(prediction.ttft_s / ttft - 1) * 100:.1f}% / {abs(prediction.itl_s / itl - 1) * 100:.1f}% | "
            f"{time.perf_counter() - started:.1f} s |"
        )
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--profile", default="llama-8b-h200")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--configs", type=int, default=4, help="configurations served per workload (best first)")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    profile = StepTimeProfile.load(args.profile)
    tiny = cached_checkpoint(ModelSpec(preset="tiny")).path
    lines = [
        "# `splitserve plan` against the simulated engine",
        "",
        f"Profile `{args.profile}`; up to "
        f"{args.gpus} GPUs; {args.num_requests} Poisson requests per workload (seed 0). For each workload the "
        f"configurations `splitserve plan` ranks first (not saturated) are served on simulated engines in virtual time "
        f"(`bench/control_plane/virtual_time_cluster.py`: the real scheduler, block pool and KV handoff on a simulated "
        f"clock). Cells are predicted / measured.",
        "",
        f"Command: `python -m splitserve.bench.control_plane.plan_vs_simulated {shlex.join(sys.argv[1:] if argv is None else argv)}`"
        f" ({source_commit()}).",
        "",
        "| workload, SLO | configuration | GPUs | TTFT ms | ITL ms | goodput | error TTFT / ITL | served in |",
        "|---|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        model = long_context_copy(tiny, Path(tmp) / "long-context")
        for name, rate, input_len, output_len, slo in WORKLOADS:
            lengths = LengthDistribution.parse(input_len, "input"), LengthDistribution.parse(output_len, "output")
            workload = Workload.poisson(rate, *lengths, args.num_requests)
            p = f"p{slo.percentile:g}"
            target = f"TTFT {p} <= {slo.ttft_s * 1000:g} ms, ITL {p} <= {slo.itl_s * 1000:g} ms"
            lines += rows_for(args, model, profile, f"{name} @ {rate:g} req/s, {target}", workload, slo)
    lines += [
        "",
        "- The prediction error is ~0 on these steady loads because the queue model batches by the scheduler's own "
        "rules (decodes, prompt chunks, admissions under the token budget and max_num_seqs) with the same profile; "
        "what it leaves out (preemption when KV blocks run short, prefix-cache hits, the router's prefix scoring) "
        "does not arise here: the engines have blocks to spare and the prompts share no prefix.",
        "- Goodput can differ a little where many requests sit at the ITL target: the model counts a request's "
        "gaps over the target (nearest rank), the measurement interpolates its gaps' percentile.",
        "- The profile is roofline-derived (an estimate until a device run measures it): these are predictions "
        "of the simulated engine, not of an H200.",
        "- The bursty trace, with the live `sla` policy and the reactive policies side by side (issue 40's "
        "benchmark, `bursty_autoscaling.py`): the next section.",
    ]
    out = Path(args.out) / "sla_planner.md"
    # bursty_autoscaling.py writes the section from SECTION on: kept as it is.
    _, found, bursty = out.read_text().partition(SECTION) if out.is_file() else ("", "", "")
    out.write_text("\n".join(lines) + "\n" + ("\n" + found + bursty if found else ""))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
