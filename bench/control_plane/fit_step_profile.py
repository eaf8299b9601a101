"""Fit a simulated engine's step-time profile (engine/simulated/step_time_profile.py) to the
real engine on this machine, and write it.

    python -m splitserve.bench.control_plane.fit_step_profile --out engine/simulated/profiles/cpu-fitted.yaml

It runs LLMEngine (prefix caching off, so every prompt token is computed) over prefills of
several lengths and decode batches of several sizes and contexts, times each step's
ModelRunner.execute -- exactly the part SimulatedRunner replaces: scheduling, detokenizing
and the rest run for real in both engines -- and fits

    seconds = step_overhead_s + new_tokens * token_compute_s + context_tokens * context_token_s

by non-negative least squares (weight_read_s = 0: on CPU a step computes, it does not wait
on memory). The KV link is given (--kv-link-gbps, default: the layer-wise KV rate measured by
bench/results/kv_transfer.md on this machine, gloo over loopback).
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np

from splitserve.engine.simulated.step_time_profile import KVLinkProfile, StepTimeProfile

PREFILL_LENGTHS = (16, 64, 128, 256, 512, 1024)
DECODE_BATCHES = ((1, 64), (4, 64), (8, 256), (16, 128), (16, 512), (32, 256))
KV_LINK_GBPS = 0.71  # bench/results/kv_transfer.md: median layer-wise KV-path rate here


def measure(model: str, reps: int, seed: int = 0) -> list[tuple[int, int, float]]:
    """(new tokens, context tokens, seconds of ModelRunner.execute) of every step run."""
    import torch

    from splitserve.engine.llm_engine import LLMEngine
    from splitserve.proto.messages.sampling_params import SamplingParams

    torch.set_num_threads(1)
    engine = LLMEngine.from_model_dir(model, enable_prefix_caching=False, max_num_batched_tokens=2048, seed=seed)
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
        for _ in range(reps):
            for length in PREFILL_LENGTHS:
                engine.generate(prompts(1, length), SamplingParams(max_tokens=1))
            for batch, context in DECODE_BATCHES:
                engine.generate(prompts(batch, context), SamplingParams(max_tokens=12, ignore_eos=True))
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the `small` preset)")
    parser.add_argument("--out", required=True, help="profile file to write (YAML)")
    parser.add_argument("--reps", type=int, default=2, help="passes over the prefill and decode shapes")
    parser.add_argument("--kv-link-gbps", type=float, default=KV_LINK_GBPS, help="KV link GB/s (1e9 bytes/s)")
    args = parser.parse_args(argv)
    from splitserve.cluster.default_model import resolve_model

    model = resolve_model(args.model)
    samples = measure(model, args.reps)
    overhead, per_token, per_context, error = fit(samples)
    profile = StepTimeProfile(
        name="cpu-fitted",
        description=(
            f"Fitted by bench/control_plane/fit_step_profile.py to {len(samples)} steps of the real LLMEngine "
            f"(ModelRunner.execute, 1 torch thread, CPU) on model {model.rsplit('/', 1)[-1]}; median "
            f"relative error of the fit {error:.1%}. Formula: step = overhead + new_tokens x token_compute "
            f"+ context_tokens x context_token. KV link: {args.kv_link_gbps} GB/s, the layer-wise KV rate "
            "of bench/results/kv_transfer.md (gloo, loopback, this machine)."
        ),
        step_overhead_s=round(overhead, 7),
        weight_read_s=0.0,
        token_compute_s=round(per_token, 9),
        context_token_s=round(per_context, 10),
        kv_link=KVLinkProfile(bytes_per_s=args.kv_link_gbps * 1e9, latency_s=0.0005),
    )
    profile.dump(args.out)
    print(f"wrote {args.out}: {len(samples)} steps, median fit error {error:.1%}")
    print(profile.model_dump_json(indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
