"""`splitserve bench`: benchmark any OpenAI-compatible endpoint, or compare several.

Wiring: pyproject.toml registers `add_bench_parser` under the `splitserve.commands` entry point
group; cluster/cli/main.py finds it there (it never imports bench) and calls it with its
subparsers, and `func=run_bench` makes the main CLI's `args.func(args)` run it.
Standalone: `python -m splitserve.bench`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from splitserve.bench import MissingBenchDependency
from splitserve.bench.cli_arguments import add_bench_arguments
from splitserve.bench.cli_plan import build_plan
from splitserve.bench.loadgen.records import ServerConfig, ServerConfigError, WorkloadError

# loadgen.compare (httpx, tqdm, psutil) and loadgen.report (matplotlib) load inside run_bench, so
# wiring the parser into the main CLI keeps `splitserve --help` fast and working without the
# `bench` extra.

_DESCRIPTION = """\
Benchmark an OpenAI-compatible server (splitserve, vLLM, ...) with streamed completions and
report TTFT, inter-token latency, end-to-end latency, throughput, cached-token share, SLO
attainment and goodput. Prompts are token ids (sent as the completions `prompt` list) drawn from
--vocab-range, so keep that range inside the model's vocabulary.
"""

_EPILOG = """\
load: --rate R (Poisson arrivals, R req/s; 'inf' sends all at once; repeat or comma-list to
sweep) or --concurrency C (closed loop, C requests always in flight; sweepable the same way).
With --rate, one --concurrency caps requests in flight. Neither: concurrency 8, or the trace's
own timestamps for --workload trace.

metrics: TTFT = first streamed token - send; ITL = gaps between streamed chunks; E2E = last
byte - send. SLO attainment = share of finished requests with TTFT <= --ttft-slo-ms and their
own ITL p90 (or mean, --itl-slo-stat) <= --itl-slo-ms. Goodput = highest swept --rate with
attainment >= 90%.

examples:
  splitserve bench --url http://127.0.0.1:8000 --workload prefix-repetition --rate 1,2,4,8
  splitserve bench --workload trace --trace mooncake.jsonl --block-size 16 --max-seconds 120
  splitserve bench --workload multi-turn --concurrency 4 --out bench/results/mt \\
    --compare "ours=splitserve serve --model M --http-port {port}" \\
    --compare "vllm=vllm-venv/bin/python -m vllm.entrypoints.openai.api_server --model M --port {port}"
"""


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "bench",
        help="benchmark an OpenAI-compatible endpoint (or compare several)",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_bench_arguments(parser)
    parser.set_defaults(func=run_bench)  # cluster/cli/main.py dispatches with args.func(args)
    return parser


def run_bench(args: argparse.Namespace) -> int:
    """0 when every configuration ran and answered at least one request; 1 otherwise; 2 for bad
    arguments or a missing `bench` extra."""
    try:  # before anything runs: a missing `bench` extra must not surface after the benchmark
        from splitserve.bench.loadgen.client import PromptTextRenderer
        from splitserve.bench.loadgen.compare import run_comparison
        from splitserve.bench.loadgen.report import render_markdown, write_reports
    except MissingBenchDependency as exc:
        print(f"splitserve bench: error: {exc}", file=sys.stderr)
        return 2
    try:
        plan = build_plan(args)
        configs = [ServerConfig.parse(spec) for spec in args.compare] or [
            ServerConfig(name="target", url=args.url.rstrip("/"))
        ]
        renderer = PromptTextRenderer(args.tokenizer) if args.tokenizer else None
    except (WorkloadError, ServerConfigError, ValueError, FileNotFoundError) as exc:
        print(f"splitserve bench: error: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    results = run_comparison(configs, plan, renderer)
    workload = plan.workload.describe()
    write_reports(
        results,
        workload,
        plan.slo,
        args.out,
        include_records=not args.no_records,
        replica_metric=args.scrape_metric or "value",
        extra={
            "loads": [load.to_dict() for load in plan.loads],
            "seed": plan.seed,
            "endpoint": plan.client.endpoint,
            "prompt_format": plan.client.prompt_format,
        },
    )
    print(render_markdown(results, workload, plan.slo))
    print(f"results written to {args.out}/", file=sys.stderr)
    healthy = all(result.error is None and any(m.num_ok for m in result.metrics) for result in results)
    return 0 if healthy else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="splitserve")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(subparsers)
    return run_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
