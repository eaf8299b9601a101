"""`splitserve bench`: benchmark any OpenAI-compatible endpoint, or compare several.

Wiring: pyproject.toml registers `add_bench_parser` under the `splitserve.commands` entry point
group; cluster/cli/main.py finds it there (it never imports bench) and calls it with its
subparsers, and `func=run_bench` makes the main CLI's `args.func(args)` run it.
Standalone: `python -m splitserve.bench`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from splitserve.bench import MissingBenchDependency
from splitserve.bench.arrivals import build_load_points, parse_concurrencies, parse_rates
from splitserve.bench.metrics import ITL_STATISTICS, SloTarget
from splitserve.bench.quote_workload import QuoteWorkload
from splitserve.bench.records import (
    DEFAULT_BASE_URL,
    ENDPOINT_PATHS,
    PROMPT_FORMATS,
    ClientOptions,
    LoadPoint,
    ServerConfig,
    ServerConfigError,
    WorkloadError,
)
from splitserve.bench.trace_workload import TraceWorkload, load_mooncake_trace
from splitserve.bench.workloads import (
    WORKLOAD_KINDS,
    MixedLengthWorkload,
    MultiTurnWorkload,
    PrefixRepetitionWorkload,
    VocabRange,
    Workload,
)

if TYPE_CHECKING:
    from splitserve.bench.compare import BenchPlan

# bench.compare (httpx, tqdm, psutil) and bench.report (matplotlib) load inside run_bench, so
# wiring the parser into the main CLI keeps `splitserve --help` fast and working without the
# `bench` extra.

DEFAULT_CONCURRENCY = 8
DEFAULT_MIXED_REQUESTS = 100
DEFAULT_QUOTE_REQUESTS = 16

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


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("target")
    target.add_argument("--url", metavar="URL", default=DEFAULT_BASE_URL, help="server base URL (default %(default)s)")
    target.add_argument(
        "--model", metavar="NAME", help="model name to send (default: the first id GET /v1/models lists)"
    )
    target.add_argument("--api-key", metavar="KEY", help="sent as 'Authorization: Bearer KEY'")
    target.add_argument(
        "--endpoint",
        choices=sorted(ENDPOINT_PATHS),
        default="completions",
        help="/v1/completions or /v1/chat/completions (chat sends text) (default %(default)s)",
    )
    target.add_argument(
        "--prompt-format",
        choices=PROMPT_FORMATS,
        default="token-ids",
        help="completions prompt as a token-id list or as text (default %(default)s)",
    )
    target.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="tokenizer.json (or its directory) to turn ids into text; "
        "without it text prompts use one pseudo-word per token id",
    )
    target.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="NAME=COMMAND_OR_URL",
        help="a configuration to benchmark side by side (repeatable): a URL, or a shell "
        "command containing {port} that starts a server; replaces --url",
    )
    target.add_argument(
        "--startup-timeout",
        metavar="SEC",
        type=_positive_float,
        default=600.0,
        help="seconds a --compare command gets to answer /health or /v1/models (default %(default)s)",
    )
    target.add_argument(
        "--stop-timeout",
        metavar="SEC",
        type=_positive_float,
        default=30.0,
        help="seconds after SIGINT (then SIGTERM) before escalating (default %(default)s)",
    )

    shape = parser.add_argument_group("workload")
    shape.add_argument(
        "--workload",
        choices=WORKLOAD_KINDS,
        default="prefix-repetition",
        help="request generator (default %(default)s)",
    )
    shape.add_argument(
        "--seed", metavar="N", type=int, default=0, help="workload and arrival seed (default %(default)s)"
    )
    shape.add_argument(
        "--vocab-range",
        default="1000:30000",
        metavar="LOW:HIGH",
        help="token ids are drawn from [LOW, HIGH) (default %(default)s)",
    )
    shape.add_argument(
        "--max-tokens",
        metavar="N",
        type=_positive_int,
        default=128,
        help="output tokens per request for synthetic workloads (default %(default)s)",
    )
    shape.add_argument(
        "--num-prefixes", metavar="N", type=_positive_int, default=4, help="prefix-repetition: shared prefixes"
    )
    shape.add_argument(
        "--prefix-len", metavar="N", type=_positive_int, default=512, help="prefix-repetition: prefix tokens"
    )
    shape.add_argument(
        "--suffixes-per-prefix",
        metavar="N",
        type=_positive_int,
        default=8,
        help="prefix-repetition: requests per prefix",
    )
    shape.add_argument(
        "--suffix-len", metavar="N", type=_positive_int, default=64, help="prefix-repetition: unique suffix tokens"
    )
    shape.add_argument(
        "--num-conversations", metavar="N", type=_positive_int, default=8, help="multi-turn: conversations"
    )
    shape.add_argument(
        "--num-turns", metavar="N", type=_positive_int, default=4, help="multi-turn: turns per conversation"
    )
    shape.add_argument(
        "--first-turn-len", metavar="N", type=_positive_int, default=256, help="multi-turn: first prompt tokens"
    )
    shape.add_argument(
        "--user-turn-len",
        metavar="N",
        type=_positive_int,
        default=64,
        help="multi-turn: new user tokens per later turn (after a --max-tokens answer stand-in)",
    )
    shape.add_argument("--short-len", metavar="N", type=_positive_int, default=128, help="mixed: short prompt tokens")
    shape.add_argument("--long-len", metavar="N", type=_positive_int, default=4096, help="mixed: long prompt tokens")
    shape.add_argument("--long-fraction", metavar="X", type=float, default=0.05, help="mixed: share of long prompts")
    shape.add_argument(
        "--length-jitter", metavar="X", type=float, default=0.25, help="mixed: +- fraction around each length"
    )
    shape.add_argument(
        "--trace",
        metavar="FILE",
        type=Path,
        help="trace: Mooncake-style JSONL (timestamp ms, input_length, output_length, hash_ids)",
    )
    shape.add_argument(
        "--block-size",
        metavar="N",
        type=_positive_int,
        default=512,
        help="trace: tokens generated per hash id; lengths scale by block-size/trace-block-size",
    )
    shape.add_argument(
        "--trace-block-size",
        metavar="N",
        type=_positive_int,
        default=512,
        help="trace: tokens per hash id in the trace",
    )
    shape.add_argument(
        "--trace-speedup", metavar="X", type=_positive_float, default=1.0, help="trace: divide timestamps by this"
    )
    shape.add_argument("--max-prompt-tokens", metavar="N", type=_positive_int, help="trace: cap prompt length")
    shape.add_argument("--max-output-tokens", metavar="N", type=_positive_int, help="trace: cap output length")
    shape.add_argument(
        "--reuse-prompts",
        action="store_true",
        help="same prompts at every load point (default: fresh prompts per load point so "
        "one point's prefix cache does not help the next)",
    )

    load = parser.add_argument_group("load and bounds")
    load.add_argument(
        "--rate",
        action="append",
        default=[],
        metavar="R[,R...]",
        help="open-loop Poisson rate(s) in req/s; repeat or comma-list to sweep; 'inf' allowed",
    )
    load.add_argument(
        "--concurrency",
        action="append",
        default=[],
        metavar="C[,C...]",
        help="closed-loop concurrency level(s); with --rate, the in-flight cap",
    )
    load.add_argument(
        "--num-requests",
        metavar="N",
        type=_positive_int,
        help=f"max requests per run (mixed: also how many to generate, default {DEFAULT_MIXED_REQUESTS})",
    )
    load.add_argument(
        "--max-seconds",
        metavar="SEC",
        type=_positive_float,
        help="wall-time bound per run; in-flight requests are then cancelled and reported as unfinished",
    )
    load.add_argument(
        "--request-timeout",
        metavar="SEC",
        type=_positive_float,
        default=600.0,
        help="seconds one request may take (default %(default)s)",
    )
    load.add_argument(
        "--warmup",
        type=int,
        default=1,
        metavar="N",
        help="untimed short requests sent before each run to warm connections (default %(default)s)",
    )
    load.add_argument(
        "--temperature", metavar="X", type=float, default=0.0, help="sampling temperature (default %(default)s)"
    )
    load.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos=true (vLLM extension) so every request generates exactly max_tokens",
    )
    load.add_argument("--extra-body", default="{}", metavar="JSON", help="JSON object merged into every request body")

    slo = parser.add_argument_group("SLO")
    slo.add_argument(
        "--ttft-slo-ms", metavar="MS", type=_positive_float, default=1000.0, help="TTFT target (default %(default)s)"
    )
    slo.add_argument(
        "--itl-slo-ms", metavar="MS", type=_positive_float, default=100.0, help="ITL target (default %(default)s)"
    )
    slo.add_argument(
        "--itl-slo-stat",
        choices=ITL_STATISTICS,
        default="p90",
        help="per-request ITL figure judged against --itl-slo-ms (default %(default)s)",
    )

    output = parser.add_argument_group("output")
    output.add_argument(
        "--out",
        metavar="DIR",
        type=Path,
        default=Path("bench/results"),
        help="directory for results.json, results.md, *.png, server logs (default %(default)s)",
    )
    output.add_argument("--no-records", action="store_true", help="leave per-request records out of results.json")
    output.add_argument("--no-progress", action="store_true", help="no progress bar")
    output.add_argument(
        "--scrape-metric",
        metavar="METRIC",
        help="Prometheus metric on the server's /metrics to sample per "
        "replica during runs (plotted as replica_load_*.png)",
    )
    output.add_argument(
        "--replica-label", metavar="LABEL", default="replica", help="label naming the replica (default %(default)s)"
    )
    output.add_argument(
        "--scrape-interval", metavar="SEC", type=_positive_float, default=1.0, help="seconds between scrapes"
    )


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


def build_workload(args: argparse.Namespace) -> Workload:
    vocab = VocabRange.parse(args.vocab_range)
    if args.workload == "prefix-repetition":
        return PrefixRepetitionWorkload(
            args.num_prefixes, args.prefix_len, args.suffixes_per_prefix, args.suffix_len, args.max_tokens, vocab
        )
    if args.workload == "multi-turn":
        return MultiTurnWorkload(
            args.num_conversations, args.num_turns, args.first_turn_len, args.user_turn_len, args.max_tokens, vocab
        )
    if args.workload == "mixed":
        return MixedLengthWorkload(
            args.num_requests or DEFAULT_MIXED_REQUESTS,
            args.short_len,
            args.long_len,
            args.long_fraction,
            args.length_jitter,
            args.max_tokens,
            vocab,
        )
    if args.workload == "quote":
        if not args.tokenizer:
            raise WorkloadError(
                "--workload quote needs --tokenizer (the served model's tokenizer.json or its directory)"
            )
        return QuoteWorkload(args.tokenizer, args.num_requests or DEFAULT_QUOTE_REQUESTS, max_tokens=args.max_tokens)
    if args.trace is None:
        raise WorkloadError("--workload trace needs --trace FILE")
    return TraceWorkload(
        tuple(load_mooncake_trace(args.trace)),
        args.block_size,
        args.trace_block_size,
        args.trace_speedup,
        args.max_prompt_tokens,
        args.max_output_tokens,
        vocab,
    )


def build_plan(args: argparse.Namespace) -> BenchPlan:
    from splitserve.bench.compare import BenchPlan

    workload = build_workload(args)
    default = LoadPoint() if args.workload == "trace" else LoadPoint(concurrency=DEFAULT_CONCURRENCY)
    loads = build_load_points(parse_rates(args.rate), parse_concurrencies(args.concurrency), default)
    try:
        extra_body = json.loads(args.extra_body)
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"--extra-body is not JSON: {exc}") from exc
    if not isinstance(extra_body, dict):
        raise WorkloadError("--extra-body must be a JSON object")
    client = ClientOptions(
        base_url=args.url,
        model=args.model,
        endpoint=args.endpoint,
        prompt_format=args.prompt_format,
        api_key=args.api_key,
        request_timeout_s=args.request_timeout,
        max_requests=args.num_requests,
        max_seconds=args.max_seconds,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        extra_body=extra_body,
        show_progress=not args.no_progress,
        num_warmup_requests=args.warmup,
    )
    return BenchPlan(
        workload=workload,
        loads=tuple(loads),
        client=client,
        seed=args.seed,
        fresh_prompts_per_load=not args.reuse_prompts,
        slo=SloTarget(args.ttft_slo_ms, args.itl_slo_ms, args.itl_slo_stat),
        scrape_metric=args.scrape_metric,
        replica_label=args.replica_label,
        scrape_interval_s=args.scrape_interval,
        startup_timeout_s=args.startup_timeout,
        stop_timeout_s=args.stop_timeout,
        log_dir=args.out,
    )


def run_bench(args: argparse.Namespace) -> int:
    """0 when every configuration ran and answered at least one request; 1 otherwise; 2 for bad
    arguments or a missing `bench` extra."""
    try:  # before anything runs: a missing `bench` extra must not surface after the benchmark
        from splitserve.bench.client import PromptTextRenderer
        from splitserve.bench.compare import run_comparison
        from splitserve.bench.report import render_markdown, write_reports
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
