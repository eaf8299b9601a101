"""The flags of `splitserve bench`, in their help groups: target, workload, load and bounds, SLO,
output. bench/cli.py puts them on its sub-command parser; bench/cli_plan.py turns the parsed
flags into a BenchPlan."""

from __future__ import annotations

import argparse
from pathlib import Path

from splitserve.bench.loadgen.metrics import ITL_STATISTICS
from splitserve.bench.loadgen.records import DEFAULT_BASE_URL, ENDPOINT_PATHS, PROMPT_FORMATS
from splitserve.bench.loadgen.workloads import WORKLOAD_KINDS

# Defaults the flags cannot carry themselves: they depend on --workload (cli_plan.py applies them).
DEFAULT_CONCURRENCY = 8
DEFAULT_MIXED_REQUESTS = 100
DEFAULT_QUOTE_REQUESTS = 16


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
    load.add_argument(
        "--first-token-stages",
        action="store_true",
        help="ask a splitserve server for each request's first-token stages (return_first_token_stages) "
        "and summarise them per stage in the report",
    )

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
