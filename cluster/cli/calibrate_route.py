"""`splitserve calibrate-route`: a cascade's threshold for a target share of large-model calls.

Runs a reference prompt set (a file, one prompt per line, or the built-in easy/hard set)
through the small model with the colocated engine, and through the large one for quality;
prints each target share's threshold, the share the small model keeps and the quality it
keeps (the large model's log-likelihood of the answers the cascade would give, against its
own answers'), and writes the cascade route as a ServeConfig YAML snippet.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path


def add_calibrate_route_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "calibrate-route",
        help="pick a cascade route's threshold for a target share of large-model calls",
        description=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--small", required=True, help="the small model's checkpoint directory")
    p.add_argument("--large", help="the large model's checkpoint directory (for quality; optional)")
    p.add_argument("--small-name", help="the small model's served name (default: its directory name)")
    p.add_argument("--large-name", help="the large model's served name (default: its directory name)")
    p.add_argument("--route-name", default="auto", help="the virtual model's name (default: auto)")
    p.add_argument(
        "--large-share",
        type=float,
        action="append",
        help="target share of requests the large model answers, in [0, 1] (repeatable; default 0.3)",
    )
    p.add_argument("--prompts", help="a file of reference prompts, one per line (default: the built-in set)")
    p.add_argument("--num-prompts", type=int, default=24, help="built-in set: prompts of each kind (easy, hard)")
    p.add_argument("--window-tokens", type=int, default=8, help="tokens the confidence is measured over")
    p.add_argument("--max-tokens", type=int, default=16, help="answer length for the quality estimate")
    p.add_argument("--out", help="write the YAML snippet here (default: stdout)")
    p.set_defaults(func=run_calibrate_route)
    return p


def run_calibrate_route(args: argparse.Namespace) -> int:
    from splitserve.cluster.frontend.model_router.route_calibration import (
        measure,
        pick_threshold,
        reference_prompts,
        route_snippet,
    )
    from splitserve.engine.llm_engine import LLMEngine

    shares = args.large_share or [0.3]
    if any(not 0 <= s <= 1 for s in shares):
        print(f"splitserve calibrate-route: --large-share must be in [0, 1], got {shares}", file=sys.stderr)
        return 2
    if args.window_tokens < 1 or args.max_tokens < args.window_tokens:
        print("splitserve calibrate-route: need 1 <= --window-tokens <= --max-tokens", file=sys.stderr)
        return 2
    if args.prompts:
        lines = [line.strip() for line in Path(args.prompts).read_text().splitlines()]
        prompts = [("given", line) for line in lines if line]
    else:
        prompts = reference_prompts(args.num_prompts, args.num_prompts)
    if not prompts:
        print(f"splitserve calibrate-route: no prompts in {args.prompts}", file=sys.stderr)
        return 2
    small = LLMEngine.from_model_dir(args.small)
    large = LLMEngine.from_model_dir(args.large) if args.large else None
    measures = measure(small, large, prompts, args.window_tokens, args.max_tokens)
    thresholds = {share: pick_threshold([m.confidence for m in measures], share) for share in shares}
    for share, threshold in thresholds.items():
        kept = [m for m in measures if m.confidence >= threshold]
        line = f"large share {share:.0%}: threshold {threshold:.6f}, small model answers {len(kept)}/{len(measures)}"
        if large is not None:
            cascade = [m.small_quality if m.confidence >= threshold else m.large_quality for m in measures]
            always_large = [m.large_quality for m in measures]
            ratio = math.exp(_mean(cascade) - _mean(always_large))  # type: ignore[arg-type]
            line += f", quality {ratio:.1%} of always-large (per-token likelihood)"
        print(line, file=sys.stderr)
    snippet = route_snippet(
        args.route_name,
        args.small_name or Path(args.small).name,
        args.large_name or Path(args.large or "large").name,
        args.window_tokens,
        thresholds,
    )
    if args.out:
        Path(args.out).write_text(snippet)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(snippet)
    return 0


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)
