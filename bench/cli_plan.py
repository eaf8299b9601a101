"""Parsed `splitserve bench` flags -> the Workload and the BenchPlan (loads, client options, SLO,
servers' timeouts) that bench/loadgen/compare.py runs."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from splitserve.bench.cli_arguments import DEFAULT_CONCURRENCY, DEFAULT_MIXED_REQUESTS, DEFAULT_QUOTE_REQUESTS
from splitserve.bench.loadgen.arrivals import build_load_points, parse_concurrencies, parse_rates
from splitserve.bench.loadgen.metrics import SloTarget
from splitserve.bench.loadgen.quote_workload import QuoteWorkload
from splitserve.bench.loadgen.records import ClientOptions, LoadPoint, WorkloadError
from splitserve.bench.loadgen.trace_workload import TraceWorkload, load_mooncake_trace
from splitserve.bench.loadgen.workloads import (
    MixedLengthWorkload,
    MultiTurnWorkload,
    PrefixRepetitionWorkload,
    VocabRange,
    Workload,
)

if TYPE_CHECKING:
    from splitserve.bench.loadgen.compare import BenchPlan

# loadgen.compare (httpx, tqdm, psutil) loads inside build_plan: see bench/cli.py.


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
    from splitserve.bench.loadgen.compare import BenchPlan

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
        first_token_stages=args.first_token_stages,
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
