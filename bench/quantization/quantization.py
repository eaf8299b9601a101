"""Weight quantization side by side: none / int8 / fp8 / int4 on one trained checkpoint.

  python -m splitserve.bench.quantization.quantization [--model DIR] [--threads 1] [--out bench/results/quantization_run.md]

Per scheme, in one process (the schemes interleave per measurement, so load drifts over all):
  weight bytes      every parameter and buffer of the loaded model (and the decoder matmuls alone)
  perplexity        exp(mean NLL) of held-out text written for this benchmark (not in the
                    training corpus), from the engine's prompt logprobs (SamplingParams.
                    prompt_logprobs: the numbers `echo` + `logprobs` return through the server)
  agreement         teacher-forced: the fraction of positions of full precision's greedy
                    continuations where the scheme's argmax is the same token; and free-running
                    greedy: the fraction of tokens before the first divergence
  decode tok/s      LLMEngine, greedy, ignore_eos, at batch 1 and 32: batch * (N - 1) / (t(N) - t(1))
The model defaults to the trained `small` preset (the default served model, cached).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

SCHEMES = ("none", "int8", "fp8", "int4")
# Written for this benchmark, so it is in no training corpus: perplexity on it is held out.
HELD_OUT = (
    "The committee met on a grey Tuesday morning to discuss the budget for the new library. Several "
    "members argued that the roof should be repaired before any books were bought, while others insisted "
    "that the children of the town had waited long enough for a place to read.",
    "A lighthouse keeper kept a notebook of every ship that passed in the night. Most entries were short, "
    "a name and an hour, but on stormy evenings he wrote whole pages about the sound of the waves and the "
    "lamps of the fishing boats coming home.",
    "When the river froze that winter, the miller could not turn his wheel, so he spent the months teaching "
    "his daughter to keep the accounts. By spring she knew more about the price of grain than anyone in the village.",
    "She walked along the old road to the market, carrying a basket of apples and a letter she had not "
    "yet decided to send. The morning was cold and bright, and the bells of the church rang out over the fields.",
)
PROMPTS = (
    "It was the best of times, it was the worst",
    "Call me Ishmael. Some years ago",
    "Once upon a time there was",
    "She opened the door and",
    "Happy families are all alike;",
    "The history of the world",
    "In the beginning God created",
    "We hold these truths to be",
)


def _engine(model: str, scheme: str):
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=model, quantization=scheme, num_kv_blocks=512, max_num_seqs=64))


def _perplexity(engine, tokenizer, texts) -> float:
    from splitserve.proto.messages.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = engine.generate([tokenizer.encode(t) for t in texts], params)
    logprobs = [lp for out in outs for lp in out.prompt_logprobs]
    return math.exp(-sum(logprobs) / len(logprobs))


def _greedy(engine, prompts, max_tokens: int) -> list[list[int]]:
    from splitserve.proto.messages.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.token_ids for o in engine.generate(prompts, params)]


def _teacher_forced(engine, sequences, starts) -> float:
    """Fraction of continuation tokens each scheme also ranks first (prompt logprobs' rank 1)."""
    from splitserve.proto.messages.sampling_params import SamplingParams

    outs = engine.generate(sequences, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    hits = total = 0
    for out, start in zip(outs, starts):
        ranks = out.prompt_ranks[start - 1 :]  # ranks of tokens start.. given what precedes them
        hits += sum(r == 1 for r in ranks)
        total += len(ranks)
    return hits / total


def _decode_rate(engine, batch: int, max_tokens: int, seed: int) -> float:
    import random

    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    prompts = lambda: [[rng.randrange(10, vocab) for _ in range(16)] for _ in range(batch)]  # noqa: E731
    started = time.perf_counter()
    _greedy(engine, prompts(), 1)
    one = time.perf_counter() - started
    started = time.perf_counter()
    _greedy(engine, prompts(), max_tokens)
    full = time.perf_counter() - started
    return batch * (max_tokens - 1) / max(full - one, 1e-9)


def run(model: str, threads: int, repeats: int, max_tokens: int) -> dict:
    import torch

    from splitserve.engine.io.tokenizer import Tokenizer
    from splitserve.engine.quant.quantize import weight_bytes

    torch.set_num_threads(threads)
    tokenizer = Tokenizer.from_pretrained(model)
    from splitserve.engine.builtin_models.corpus import PASSAGES

    prompts = [tokenizer.encode(p) for p in PROMPTS]
    corpus = [passage[:600] for passage in PASSAGES[:6]]  # training text: where the model is confident
    engines = {s: _engine(model, s) for s in SCHEMES}
    reference = _greedy(engines["none"], prompts, 32)
    sequences = [p + r for p, r in zip(prompts, reference)]
    starts = [len(p) for p in prompts]
    rows = {}
    for scheme, engine in engines.items():
        greedy = _greedy(engine, prompts, 32)
        prefix = [
            next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), len(r)) / len(r)
            for g, r in zip(greedy, reference)
        ]
        rows[scheme] = {
            "weight_bytes": weight_bytes(engine.model),
            "matmul_bytes": sum(weight_bytes(layer) - weight_bytes_norms(layer) for layer in engine.model.layers),
            "perplexity": _perplexity(engine, tokenizer, HELD_OUT),
            "perplexity_corpus": _perplexity(engine, tokenizer, corpus),
            "teacher_forced": _teacher_forced(engine, sequences, starts),
            "greedy_prefix": sum(prefix) / len(prefix),
            "tok_s": {1: [], 32: []},
        }
    for repeat in range(repeats):
        for batch in (1, 32):
            for scheme in SCHEMES if repeat % 2 == 0 else reversed(SCHEMES):
                rate = _decode_rate(engines[scheme], batch, max_tokens, seed=repeat * 100 + batch)
                rows[scheme]["tok_s"][batch].append(rate)
    for row in rows.values():
        row["tok_s"] = {b: statistics.median(v) for b, v in row["tok_s"].items()}
    return rows


def matmul_table(size: int = 4096, batches=(1, 32, 256), reps: int = 3) -> str:
    """ms per [batch, size] x [size, size] matmul, one thread: each engine path and the options
    it was chosen over (measured side by side in this process)."""
    import torch
    import torch.nn.functional as F

    from splitserve.engine.quant.quantize import quantize_weight

    w = torch.randn(size, size) * 0.02
    wb = w.bfloat16()
    q = {s: quantize_weight(w, s) for s in ("int8", "fp8", "int4")}
    i8 = q["int8"]

    def ms(fn) -> float:
        fn()
        started = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - started) / reps * 1e3

    options = {
        "fp32 F.linear": lambda x: F.linear(x, w),
        "bf16 F.linear": lambda x: F.linear(x.bfloat16(), wb),
        "int8 engine (Int8Weight)": lambda x: i8(x),
        "int8 _weight_int8pack_mm, fp32 activations": lambda x: torch.ops.aten._weight_int8pack_mm(
            x, i8.qweight, i8.scale
        ),
        "int8 _weight_int8pack_mm, bf16 activations": lambda x: torch.ops.aten._weight_int8pack_mm(
            x.bfloat16(), i8.qweight, i8.scale_bf16
        ),
        "int8 -> bf16 weight + bf16 GEMM": lambda x: F.linear(x.bfloat16(), i8.qweight.bfloat16()) * i8.scale_bf16,
        "fp8 engine (emulated W8A8)": lambda x: q["fp8"](x),
        "fp8 torch._scaled_mm (CPU)": lambda x: q["fp8"].scaled_mm(x),
        "int4 engine (_weight_int4pack_mm_for_cpu, bf16)": lambda x: q["int4"](x),
    }
    lines = ["| matmul " + f"{size}x{size}, 1 thread | " + " | ".join(f"batch {b} (ms)" for b in batches) + " |"]
    lines.append("|---|" + "---|" * len(batches))
    xs = {b: torch.randn(b, size) for b in batches}
    for name, fn in options.items():
        lines.append(f"| {name} | " + " | ".join(f"{ms(lambda fn=fn, b=b: fn(xs[b])):.1f}" for b in batches) + " |")
    return "\n".join(lines) + "\n"


def weight_bytes_norms(layer) -> int:
    return sum(p.numel() * p.element_size() for p in layer.parameters() if p.dim() == 1)


def render(rows: dict, model: str, threads: int, command: str) -> str:
    base = rows["none"]
    lines = [
        f"`{command}` (model `{Path(model).name}`, torch threads {threads})",
        "",
        "| scheme | weight bytes | decoder matmul bytes | perplexity (held out) | Δ ppl | perplexity (training text) | Δ ppl | teacher-forced agreement | greedy prefix agreement | decode tok/s b=1 | decode tok/s b=32 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for scheme, row in rows.items():
        delta = row["perplexity"] / base["perplexity"] - 1
        delta_corpus = row["perplexity_corpus"] / base["perplexity_corpus"] - 1
        lines.append(
            f"| {scheme} | {row['weight_bytes'] / 2**20:.2f} MiB | {row['matmul_bytes'] / 2**20:.2f} MiB | "
            f"{row['perplexity']:.4g} | {delta * 100:+.2f}% | {row['perplexity_corpus']:.4g} | {delta_corpus * 100:+.2f}% | "
            f"{row['teacher_forced']:.3f} | {row['greedy_prefix']:.3f} | "
            f"{row['tok_s'][1]:.1f} | {row['tok_s'][32]:.1f} |"
        )
    return "\n".join(lines) + "\n"


def torch_threads_one() -> None:
    import torch

    torch.set_num_threads(1)


def main(argv: list[str] | None = None) -> int:
    import sys

    parser = argparse.ArgumentParser(
        prog="python -m splitserve.bench.quantization.quantization", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the trained small preset)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    parser.add_argument("--matmuls", action="store_true", help="also time each matmul path at 4096x4096")
    args = parser.parse_args(argv)
    if args.model is None:
        from splitserve.cluster.default_model import resolve_model

        args.model = resolve_model(None)
    rows = run(args.model, args.threads, args.repeats, args.max_tokens)
    text = render(
        rows, args.model, args.threads, "python -m splitserve.bench.quantization.quantization " + " ".join(sys.argv[1:])
    )
    if args.matmuls:
        torch_threads_one()
        text += "\n" + matmul_table()
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
