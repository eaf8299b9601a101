"""Model routing: always-large, always-small, a rules route and the cascade at three calibrated
thresholds, on a mixed workload of easy prompts (corpus passages: the small model's training
text) and hard ones (corpus words shuffled: out of it).

Small model: the `draft` preset (1 layer, 128 wide) trained --small-steps steps; large: the
`small` preset (4 layers, 256 wide) trained 300 steps (the default model). Both from the model
cache. Every prompt runs through both models with the colocated engine (greedy); the policies
are then applied to those measured answers with the routes' own decision code
(`confidence_of`, `rules_route.matches`), the cascade's thresholds calibrated by
`pick_threshold` on a separate calibration set (other passage offsets, other shuffles), as
`splitserve calibrate-route` does.

Per policy: quality = exp(mean over requests of the large model's mean per-token
log-likelihood of the answer), i.e. the large model's geometric-mean probability of the
answer's tokens, as a share of always-large's; the share answered by the small model; compute
per request = tokens x parameters (prompt + answer tokens of each model run, the cascade's
aborted small window included); TTFT = the time to the first token the client sees (under the
cascade: the small model's whole window, plus the large model's TTFT when it escalates),
measured per prompt on the colocated engine, one request at a time.

With --cluster, the cascade at the first threshold also runs end to end through two real
in-process clusters (bench/models/model_routing_cluster.py).

  python -m splitserve.bench.models.model_routing --cluster --out /tmp/model_routing.md
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from splitserve.bench import source_commit
from splitserve.cluster.default_model import DEFAULT_SPEC
from splitserve.cluster.frontend.model_router.request_features import RequestFeatures
from splitserve.cluster.frontend.model_router.route_calibration import (
    PromptMeasure,
    measure,
    pick_threshold,
    reference_prompts,
)
from splitserve.cluster.frontend.model_router.rules_route import matches
from splitserve.cluster.model_route_config import RouteRule
from splitserve.engine.builtin_models.model_cache import cached_checkpoint
from splitserve.engine.builtin_models.model_spec import ModelSpec
from splitserve.engine.llm_engine import LLMEngine
from splitserve.proto.messages.sampling_params import SamplingParams

ACCEPT_NATS = 0.5  # per token: an answer within this of the large model's own is acceptable


def parameters(engine: LLMEngine) -> int:
    return sum(p.numel() for p in engine.model.parameters())


def seconds_to(engine: LLMEngine, text: str, tokens: int, repeats: int) -> float:
    """Median seconds for the engine to produce `tokens` tokens of one request alone."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.generate([text], params)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def evaluate(name, measures, small_answers, large_cost, small_cost, ttft, baseline_quality=None):
    scores = [m.small_quality if s else m.large_quality for m, s in zip(measures, small_answers)]
    quality = statistics.fmean(scores)
    row = {
        "policy": name,
        "loglik": quality,
        # The large model as judge: it finds the answer about as likely as its own greedy one.
        "accepted": statistics.fmean(q >= m.large_quality - ACCEPT_NATS for q, m in zip(scores, measures)),
        "small_share": sum(small_answers) / len(measures),
        "compute": statistics.fmean(large_cost(m, s) + small_cost(m, s) for m, s in zip(measures, small_answers)),
        "ttft_ms": 1000 * statistics.fmean(ttft(m, s) for m, s in zip(measures, small_answers)),
    }
    row["quality"] = 1.0 if baseline_quality is None else math.exp(quality - baseline_quality)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small-steps", type=int, default=1000, help="training steps of the small (draft) model")
    parser.add_argument("--easy", type=int, default=36, help="easy prompts in the evaluation set")
    parser.add_argument("--hard", type=int, default=24, help="hard prompts in the evaluation set")
    parser.add_argument("--window-tokens", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--large-shares", default="0.3,0.4,0.5", help="calibration targets (share of large calls)")
    parser.add_argument("--timing-repeats", type=int, default=3)
    parser.add_argument(
        "--cluster", action="store_true", help="also run the cascade through two real in-process clusters"
    )
    parser.add_argument("--out", help="write the markdown table here (default: stdout)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    small_dir = cached_checkpoint(ModelSpec("draft", "llama", seed=0, train_steps=args.small_steps)).path
    large_dir = cached_checkpoint(DEFAULT_SPEC).path
    small, large = LLMEngine.from_model_dir(str(small_dir)), LLMEngine.from_model_dir(str(large_dir))
    p_small, p_large = parameters(small), parameters(large)
    window, answer = args.window_tokens, args.max_tokens
    calibration = measure(small, large, reference_prompts(args.easy, args.hard, 1, 18), window, answer)
    evaluation = measure(small, large, reference_prompts(args.easy, args.hard, 0, 0), window, answer)
    shares = [float(s) for s in args.large_shares.split(",")]
    thresholds = {s: pick_threshold([m.confidence for m in calibration], s) for s in shares}
    lengths = {m.prompt: len(small.tokenizer.encode(m.prompt)) for m in calibration + evaluation}
    rule = RouteRule(target="small", max_prompt_tokens=int(statistics.median(lengths[m.prompt] for m in calibration)))

    timing: dict[str, tuple[float, float, float]] = {}
    for m in evaluation:  # side by side, one request at a time
        timing[m.prompt] = (
            seconds_to(small, m.prompt, 1, args.timing_repeats),
            seconds_to(small, m.prompt, window, args.timing_repeats),
            seconds_to(large, m.prompt, 1, args.timing_repeats),
        )

    def tokens(m: PromptMeasure, answer_ids) -> int:
        return lengths[m.prompt] + len(answer_ids)

    rows = []
    base = evaluate(
        "always-large",
        evaluation,
        [False] * len(evaluation),
        lambda m, s: tokens(m, m.large_answer) * p_large,
        lambda m, s: 0,
        lambda m, s: timing[m.prompt][2],
    )
    rows.append(base)
    fixed_cost = (
        lambda m, s: 0 if s else tokens(m, m.large_answer) * p_large,
        lambda m, s: tokens(m, m.small_answer) * p_small if s else 0,
        lambda m, s: timing[m.prompt][0] if s else timing[m.prompt][2],
    )
    rows.append(evaluate("always-small", evaluation, [True] * len(evaluation), *fixed_cost, base["loglik"]))
    rules = [matches(rule, RequestFeatures(small.tokenizer.encode(m.prompt), SamplingParams())) for m in evaluation]
    rows.append(
        evaluate(
            f"rules (prompt <= {rule.max_prompt_tokens} tokens: small)", evaluation, rules, *fixed_cost, base["loglik"]
        )
    )
    split = []
    for share, threshold in thresholds.items():
        kept = [m.confidence >= threshold for m in evaluation]
        easy_kept = statistics.fmean(k for k, m in zip(kept, evaluation) if m.kind == "easy")
        hard_up = statistics.fmean(not k for k, m in zip(kept, evaluation) if m.kind == "hard")
        split.append(
            f"threshold {threshold:.3f}: {easy_kept:.0%} of easy prompts kept small, {hard_up:.0%} of hard ones escalated"
        )
        rows.append(
            evaluate(
                f"cascade, threshold {threshold:.3f} ({share:.0%} large on calibration)",
                evaluation,
                kept,
                lambda m, s: 0 if s else tokens(m, m.large_answer) * p_large,
                lambda m, s: tokens(m, m.small_answer) * p_small if s else (lengths[m.prompt] + window) * p_small,
                lambda m, s: timing[m.prompt][1] + (0 if s else timing[m.prompt][2]),
                base["loglik"],
            )
        )
    easy = [m for m in evaluation if m.kind == "easy"]
    hard = [m for m in evaluation if m.kind == "hard"]
    lines = [
        f"Commit: {source_commit().removeprefix('Commit: ')}",
        "",
        f"Small: draft preset trained {args.small_steps} steps, {p_small:,} parameters; large: {DEFAULT_SPEC.name}, "
        f"{p_large:,} parameters. {len(easy)} easy + {len(hard)} hard prompts (evaluation), the same mix for calibration; "
        f"window {window} tokens, answers {answer} tokens, greedy.",
        "",
        f"Small model's confidence (geometric-mean probability of its first {window} tokens): easy median "
        f"{statistics.median(m.confidence for m in easy):.3f}, hard median {statistics.median(m.confidence for m in hard):.3f}.",
        "",
        "| policy | quality: log-lik (vs always-large) | large-model log-lik / token | accepted by the large-model judge | served by small | compute / request (tokens x params) | mean TTFT (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['policy']} | {r['quality']:.1%} | {r['loglik']:.3f} | {r['accepted']:.0%} | {r['small_share']:.0%} | "
            f"{r['compute'] / 1e6:.1f} M ({r['compute'] / base['compute']:.0%}) | {r['ttft_ms']:.1f} |"
        )
    lines += ["", "Cascade by kind: " + "; ".join(split) + "."]
    if args.cluster:
        from splitserve.bench.models.model_routing_cluster import through_cluster

        first_threshold = next(iter(thresholds.values()))
        lines += ["", *through_cluster(small_dir, large_dir, evaluation, first_threshold, window, answer)]
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
