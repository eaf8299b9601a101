"""`splitserve profile`: fit a step-time profile (engine/simulated/step_time_profile.py) to the
real engine on the hardware at hand, and write the file `splitserve plan`, the `sla` autoscaling
policy and the simulated engine read.

    splitserve profile --model DIR --out my-model.yaml [--tensor-parallel-sizes 1,2] [--reps 2]
    python -m splitserve.bench.control_plane.fit_step_profile --out engine/simulated/profiles/cpu-fitted.yaml

It runs LLMEngine (prefix caching off, so every prompt token is computed) over prefills of
several lengths and decode batches of several sizes and contexts, times each step's
ModelRunner.execute -- exactly the part SimulatedRunner replaces: scheduling, detokenizing
and the rest run for real in both engines -- and fits

    seconds = step_overhead_s + new_tokens * token_compute_s + context_tokens * context_token_s

by non-negative least squares (weight_read_s = 0: on CPU a step computes, it does not wait
on memory). Each tensor-parallel size asked for is measured the same way on an engine of that
many ranks (its collectives inside the step) and written as that size's figures. The KV link is
given (--kv-link-gbps, default: the layer-wise KV rate measured by bench/results/kv_transfer.md
on this machine, gloo over loopback); the model's KV bytes per token are written with it.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np

from splitserve.engine.simulated.step_time_profile import KVLinkProfile, StepFigures, StepTimeProfile

PREFILL_LENGTHS = (16, 64, 128, 256, 512, 1024)
DECODE_BATCHES = ((1, 64), (4, 64), (8, 256), (16, 128), (16, 512), (32, 256))
KV_LINK_GBPS = 0.71  # bench/results/kv_transfer.md: median layer-wise KV-path rate here


def measure(model: str, reps: int, seed: int = 0, tensor_parallel_size: int = 1) -> list[tuple[int, int, float]]:
    """(new tokens, context tokens, seconds of ModelRunner.execute) of every step run."""
    import torch

    from splitserve.engine.llm_engine import LLMEngine
    from splitserve.proto.messages.sampling_params import SamplingParams

    torch.set_num_threads(1)
    engine = LLMEngine.from_model_dir(
        model,
        enable_prefix_caching=False,
        max_num_batched_tokens=2048,
        seed=seed,
        tensor_parallel_size=tensor_parallel_size,
    )
    samples: list[tuple[int, int, float]] = []
    execute = engine.runner.execute

    def timed(batch, on_layer_done=None):
        start = time.perf_counter()
        out = execute(batch, on_layer_done)
        context = sum(s.num_computed_tokens + n for s, n in zip(batch.seqs, batch.num_new_tokens))
        samples.append((sum(batch.num_new_tokens), context, time.perf_counter() - start))
        return out

    engine.runner.execute = timed
    rng = random.Random(seed)
    vocab = min(engine.model_config.vocab_size, 1000)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]

    engine.generate(prompts(2, 32), SamplingParams(max_tokens=4))  # warm up
    samples.clear()
    with torch.inference_mode():
        longest = engine.model_config.max_context_len - 16  # room for the decode steps' tokens
        for _ in range(reps):
            for length in sorted({min(length, longest) for length in PREFILL_LENGTHS}):
                engine.generate(prompts(1, length), SamplingParams(max_tokens=1))
            for batch, context in DECODE_BATCHES:
                engine.generate(prompts(batch, min(context, longest)), SamplingParams(max_tokens=12, ignore_eos=True))
    engine.close()
    return samples


def fit(samples: list[tuple[int, int, float]]) -> tuple[float, float, float, float]:
    """(overhead, per new token, per context token, median relative error), non-negative."""
    x = np.array([[1.0, n, c] for n, c, _ in samples])
    y = np.array([t for _, _, t in samples])
    active = [0, 1, 2]
    while True:  # least squares, dropping a negative coefficient until none is (tiny NNLS)
        coef, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (coef >= 0).all():
            break
        active.pop(int(np.argmin(coef)))
    full = np.zeros(3)
    full[active] = coef
    predicted = x @ full
    error = float(np.median(np.abs(predicted - y) / y))
    return float(full[0]), float(full[1]), float(full[2]), error


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the `small` preset)")
    parser.add_argument("--out", required=True, help="profile file to write (YAML)")
    parser.add_argument("--name", default=None, help="the profile's name (default: the --out file's stem)")
    parser.add_argument("--reps", type=int, default=2, help="passes over the prefill and decode shapes")
    parser.add_argument("--kv-link-gbps", type=float, default=KV_LINK_GBPS, help="KV link GB/s (1e9 bytes/s)")
    parser.add_argument(
        "--tensor-parallel-sizes",
        default="1",
        help="TP sizes to measure, comma-separated; the first is the profile's own",
    )


def add_profile_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`splitserve profile` (registered under the splitserve.commands entry points)."""
    parser = subparsers.add_parser(
        "profile",
        help="measure this model's step times here and write the profile plan and the simulated engine read",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_profile_arguments(parser)
    parser.set_defaults(func=run_profile)
    return parser


def figures(model: str, reps: int, tensor_parallel_size: int) -> tuple[StepFigures, int, float]:
    """One TP size's fitted figures, the steps they were fitted to, and the fit's median error."""
    samples = measure(model, reps, tensor_parallel_size=tensor_parallel_size)
    overhead, per_token, per_context, error = fit(samples)
    fitted = StepFigures(
        step_overhead_s=round(overhead, 7),
        weight_read_s=0.0,
        token_compute_s=round(per_token, 9),
        context_token_s=round(per_context, 10),
    )
    return fitted, len(samples), error


def run_profile(args: argparse.Namespace) -> int:
    from splitserve.cluster.default_model import resolve_model
    from splitserve.engine.config import ConfigError
    from splitserve.engine.model_config import ModelConfig
    from splitserve.engine.simulated.simulated_kv_cache import kv_bytes_per_token

    try:
        sizes = [int(v) for v in args.tensor_parallel_sizes.split(",")]
        if not sizes or min(sizes) < 1 or args.reps < 1:
            raise ValueError
    except ValueError:
        print(
            f"splitserve profile: --tensor-parallel-sizes {args.tensor_parallel_sizes!r} and --reps: integers >= 1",
            file=sys.stderr,
        )
        return 2
    try:
        model = resolve_model(args.model)
        kv_bytes = kv_bytes_per_token(ModelConfig.from_pretrained(model), None)
        measured = {size: figures(model, args.reps, size) for size in dict.fromkeys(sizes)}
    except ConfigError as exc:  # a TP size the model cannot take, a bad checkpoint: one line
        print(f"splitserve profile: {exc}", file=sys.stderr)
        return 2
    own, (own_figures, steps, _) = sizes[0], measured[sizes[0]]
    errors = ", ".join(f"TP {size} {e:.1%}" for size, (_, _, e) in measured.items())
    profile = StepTimeProfile(
        name=args.name or Path(args.out).stem,
        description=(
            f"Fitted by `splitserve profile` to the real LLMEngine (ModelRunner.execute, 1 torch thread per rank) "
            f"on model {model.rsplit('/', 1)[-1]}, {steps} steps per TP size; median relative error of the fit: "
            f"{errors}. Formula: step = overhead + new_tokens x token_compute + context_tokens x context_token. "
            f"KV link: {args.kv_link_gbps} GB/s, given."
        ),
        **own_figures.model_dump(),
        kv_link=KVLinkProfile(bytes_per_s=args.kv_link_gbps * 1e9, latency_s=0.0005),
        kv_bytes_per_token=kv_bytes,
        tensor_parallel_size=own,
        tensor_parallel={size: f for size, (f, _, _) in measured.items() if size != own},
    )
    profile.dump(args.out)
    print(f"wrote {args.out}: TP {', '.join(map(str, measured))}; median fit error {errors}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_profile_arguments(parser)
    return run_profile(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
