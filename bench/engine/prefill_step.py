"""Prefill step time of the colocated engine: many fresh prompts arriving at once.

Each repeat admits --batch fresh random prompts of --prompt-len tokens and runs the engine's
steps until every one has its first token (max_tokens=1): the chunked-prefill forward under
the default token budget (max_num_batched_tokens 2048, so 32 x 200 tokens take 4 steps), with
synchronous steps so that each step's time is its own (async scheduling would overlap a step's
host work with the next forward). It reports CPU and wall ms per prefill step (model forward
only) and for the whole prefill, and, under torch.profiler after the timed repeats, the top ops
of one more prefill.

Greedy output is fingerprinted too: --check-tokens greedy tokens of fixed prompts (the same
every run, on any code), first as one batch of the timed shape, then as a mixed batch of
other lengths with prefix-cache hits; the sha256 of the ids shows whether a code change kept
greedy output bitwise the same.

  python -m splitserve.bench.engine.prefill_step            # bench preset, 32 x 200, 1 thread
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import tempfile
import time
from pathlib import Path

from splitserve.bench.engine.engine_throughput import make_prompts


def _engine(model: str, batch: int, prompt_len: int, num_threads: int):
    import torch

    from splitserve.engine.config import EngineConfig
    from splitserve.engine.llm_engine import LLMEngine

    torch.set_num_threads(num_threads)
    # Room for a full batch of prompts plus their greedy tokens twice over: never a preemption.
    blocks_per_seq = -(-(prompt_len + 64) // EngineConfig.__dataclass_fields__["block_size"].default)
    config = EngineConfig(
        model=model,
        num_kv_blocks=2 * batch * blocks_per_seq + 64,
        max_num_seqs=max(batch, 64),
        async_scheduling=False,
    )
    return LLMEngine(config)


def _prefill(engine, prompts: list[list[int]]) -> tuple[list[float], float, float]:
    """Runs prompts to their first token: (CPU s of each model forward, whole prefill CPU s,
    whole prefill wall s)."""
    from splitserve.proto.messages.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for ids in prompts:
        engine.add_request(prompt_token_ids=ids, params=params)
    forward = engine.model.forward
    forwards: list[float] = []

    def timed(*args, **kwargs):
        start = time.process_time()
        try:
            return forward(*args, **kwargs)
        finally:
            forwards.append(time.process_time() - start)

    engine.model.forward = timed
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    try:
        while engine.has_unfinished():
            engine.step()
    finally:
        del engine.model.forward  # the class's method shows through again
    return forwards, time.process_time() - cpu_start, time.perf_counter() - wall_start


def _fingerprint(engine, batch: int, prompt_len: int, vocab_size: int, num_tokens: int) -> tuple[str, int]:
    """sha256 of the greedy ids of fixed prompts: one batch of the timed shape, then a mixed
    batch (lengths 1-250, some sharing a cached 128-token prefix); and the number of sequences."""
    from splitserve.proto.messages.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    uniform = make_prompts(7, batch, prompt_len, vocab_size)
    shared = make_prompts(8, 1, 128, vocab_size)[0]
    tails = make_prompts(9, 12, 120, vocab_size)
    engine.generate([shared], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    mixed = [shared + tail[: 8 * i + 1] for i, tail in enumerate(tails)]
    mixed += [p[: 17 * i + 1] for i, p in enumerate(make_prompts(10, 14, 250, vocab_size))]
    outputs = engine.generate(uniform, params) + engine.generate(mixed, params)
    ids = [list(out.token_ids) for out in outputs]
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16], len(ids)


def _top_ops(engine, prompts: list[list[int]], rows: int) -> str:
    import torch
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        _prefill(engine, prompts)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows).strip()


def run(args: argparse.Namespace, model: str) -> str:
    import torch

    engine = _engine(model, args.batch, args.prompt_len, args.threads)
    vocab = engine.model_config.vocab_size
    steps: list[float] = []
    totals_cpu, totals_wall, forward_share, num_steps = [], [], [], []
    with torch.inference_mode():
        _prefill(engine, make_prompts(args.seed + 1000, args.batch, args.prompt_len, vocab))  # warm-up
        for repeat in range(args.repeats):
            # Fresh prompts every repeat: no prefix-cache hit.
            prompts = make_prompts(args.seed + repeat, args.batch, args.prompt_len, vocab)
            forwards, cpu, wall = _prefill(engine, prompts)
            steps += forwards
            totals_cpu.append(cpu)
            totals_wall.append(wall)
            forward_share.append(sum(forwards) / cpu)
            num_steps.append(len(forwards))
        digest, num_seqs = _fingerprint(engine, args.batch, args.prompt_len, vocab, args.check_tokens)
    ms = lambda xs: f"{1e3 * statistics.median(xs):.1f} (min {1e3 * min(xs):.1f})"  # noqa: E731
    lines = [
        f"- {args.batch} prompts x {args.prompt_len} tokens, {args.repeats} repeats, "
        f"{torch.get_num_threads()} torch thread(s), model forwards per prefill {sorted(set(num_steps))}",
        f"- prefill step (model forward) CPU ms: {ms(steps)}",
        f"- whole prefill CPU ms: {ms(totals_cpu)}; wall ms: {ms(totals_wall)}",
        f"- model forward share of CPU: {statistics.median(forward_share):.0%}",
        f"- greedy fingerprint ({num_seqs} sequences x {args.check_tokens} tokens): {digest}",
    ]
    if args.profile_rows:
        prompts = make_prompts(args.seed + 2000, args.batch, args.prompt_len, vocab)
        lines += ["", "```", _top_ops(engine, prompts, args.profile_rows), "```"]
    engine.close()
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m splitserve.bench.engine.prefill_step", description=__doc__)
    parser.add_argument("--model", help="checkpoint directory (default: a fresh `make-model --preset bench`)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--check-tokens", type=int, default=16, help="greedy tokens per fingerprinted sequence")
    parser.add_argument("--profile-rows", type=int, default=0, help="top torch.profiler ops to print (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.batch, args.prompt_len, args.repeats, args.threads, args.check_tokens) < 1:
        raise SystemExit("--batch, --prompt-len, --repeats, --threads and --check-tokens must be >= 1")
    if args.model:
        print(run(args, args.model))
        return 0
    from splitserve.engine.builtin_models.make_model import write_random_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        print(run(args, str(write_random_checkpoint(Path(tmp) / "bench", preset="bench"))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
