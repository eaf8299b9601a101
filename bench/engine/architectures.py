"""Every architecture side by side on this CPU: the runs behind bench/results/architectures.md.

  python -m splitserve.bench.engine.architectures [--repeats 3] [--max-tokens 16] [--out FILE]

Three parts, one process, one torch thread, fp32, greedy, ignore_eos, random weights:
  decode        LLMEngine decode tok/s at batch 1 and 32 (batch * (N - 1) / (t(N) - t(1)), 16-token
                prompts) for each architecture, `splitserve make-model --preset bench --arch A`
                (hidden 256, 2 layers, vocabulary 2048); the engines interleave per repeat
  moe           a Mixtral (8 experts of width 512, top 2) against the dense model with the same
                active parameters (the bench Llama: width 1024, the same attention): step time
                at batch 1 and 32, and where the MoE layer's time goes (bench/engine/architectures_moe.py)
  window        blocks held, and decode tok/s, at a context of 4x the window: Mistral with a
                256-token window against the same weights without one, and Gemma 3 with local
                and global layers, 8 sequences each (engine/core/kv_cache_manager.py frees what
                no layer sees where every layer is windowed)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3", "mixtral", "qwen3_moe")
WINDOW = 256
BLOCK_SIZE = 16


def _engine(path: Path, num_kv_blocks: int = 1024, **extra):
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.llm_engine import LLMEngine

    return LLMEngine(
        EngineConfig(model=str(path), num_kv_blocks=num_kv_blocks, max_num_seqs=64, block_size=BLOCK_SIZE, **extra)
    )


def _greedy(engine, prompts: list[list[int]], max_tokens: int):
    from splitserve.proto.messages.sampling_params import SamplingParams

    return engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))


def decode_rate(engine, batch: int, max_tokens: int, seed: int, prompt_len: int = 16) -> tuple[float, float]:
    """(decode tok/s, CPU ms per decode step): from the runs of 1 and max_tokens tokens with fresh
    prompts, batch * (max_tokens - 1) / (t(max_tokens) - t(1)) and the process CPU time likewise
    (every thread's: on a shared machine wall time also measures the neighbours)."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    prompts = lambda: [[rng.randrange(16, vocab) for _ in range(prompt_len)] for _ in range(batch)]  # noqa: E731
    wall, cpu = [], []
    for tokens in (1, max_tokens):
        started, started_cpu = time.perf_counter(), time.process_time()
        _greedy(engine, prompts(), tokens)
        wall.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
    steps = max_tokens - 1
    return batch * steps / max(wall[1] - wall[0], 1e-9), 1e3 * max(cpu[1] - cpu[0], 0.0) / steps


def write_transformers_checkpoint(config, out: Path, tokenizer_from: Path, seed: int = 0) -> Path:
    """transformers' random model for config, with a make-model checkpoint's tokenizer files."""
    import shutil

    import torch
    import transformers

    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tokenizer_from / name, out / name)
    return out


def bench_shape(**changes) -> dict:
    """The `bench` preset's shape as transformers config keys (make-model's token ids)."""
    shape = dict(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    return {**shape, **changes}


EAGER = "dense, eager forward"  # the dense model without its scripted decode step, as the MoE runs


def run_decode(paths: dict[str, Path], repeats: int, max_tokens: int) -> dict[str, dict[int, dict[str, float]]]:
    from unittest import mock

    from splitserve.engine.model.scripted_decode import CPU_DECODE_FORWARD_ENV

    engines = {}
    for name, path in paths.items():
        with mock.patch.dict("os.environ", {CPU_DECODE_FORWARD_ENV: "eager" if name == EAGER else "scripted"}):
            engines[name] = _engine(path)
    rates: dict[str, dict[int, list[tuple[float, float]]]] = {name: {1: [], 32: []} for name in engines}
    for engine in engines.values():  # warm up: TorchScript optimises a graph on its first runs
        for batch in (1, 32):
            decode_rate(engine, batch, 4, seed=batch)
    for repeat in range(repeats):
        order = list(engines) if repeat % 2 == 0 else list(reversed(engines))
        for batch in (1, 32):
            for name in order:
                rates[name][batch].append(decode_rate(engines[name], batch, max_tokens, seed=repeat * 100 + batch))
    return {
        name: {
            batch: {"tok_s": statistics.median(r[0] for r in runs), "cpu_ms": statistics.median(r[1] for r in runs)}
            for batch, runs in per.items()
        }
        for name, per in rates.items()
    }


def run_window(paths: dict[str, Path], repeats: int, num_seqs: int = 8) -> dict[str, dict]:
    """Per model: blocks held once num_seqs sequences all reach 4 windows of context (a
    3-window prompt, one window of decode), against what that context needs without freeing,
    and decode tok/s over that last window (and the few tokens past it)."""
    from splitserve.proto.messages.sampling_params import SamplingParams

    rows: dict[str, dict] = {}
    context = 4 * WINDOW
    rng = random.Random(7)
    # Chunked prefill puts the sequences a few tokens apart: a margin so that all are alive at 4 windows.
    params = SamplingParams(temperature=0, max_tokens=WINDOW + 16, ignore_eos=True)
    for repeat in range(repeats):
        for name, path in paths.items() if repeat % 2 == 0 else reversed(list(paths.items())):
            engine = _engine(path, num_kv_blocks=num_seqs * context // BLOCK_SIZE + 16, max_num_batched_tokens=2048)
            prompts = [[rng.randrange(16, 2048) for _ in range(3 * WINDOW)] for _ in range(num_seqs)]
            seqs = [engine.scheduler.requests[engine.add_request(prompt_token_ids=p, params=params)] for p in prompts]
            held, needed, decoded, decode_started = None, 0, 0, None
            while engine.has_unfinished():
                outputs = engine.step()
                if decode_started is None and all(s.num_output_tokens >= 1 for s in seqs):
                    decode_started = time.perf_counter()
                elif decode_started is not None:
                    decoded += sum(len(o.new_token_ids) for o in outputs)
                if held is None and all(s.num_tokens >= context and not s.is_finished for s in seqs):
                    held = engine.config.num_kv_blocks - engine.kv.num_free_blocks
                    needed = sum(-(-s.num_tokens // BLOCK_SIZE) for s in seqs)  # every token's block
            elapsed = time.perf_counter() - (decode_started or time.perf_counter())
            row = rows.setdefault(name, {"tok_s": []})
            row.update(held=held, needed=needed, kv_window=engine.kv.window)
            row["tok_s"].append(decoded / max(elapsed, 1e-9))
    for row in rows.values():
        row["tok_s"] = statistics.median(row["tok_s"])
    return rows


def checkpoints(work: Path) -> tuple[dict[str, Path], dict[str, Path], dict[str, Path]]:
    import transformers

    from splitserve.engine.builtin_models.make_model import write_random_checkpoint

    per_arch = {arch: write_random_checkpoint(work / arch, preset="bench", arch=arch) for arch in ARCHS}
    tokenizer = per_arch["llama"]
    moe = transformers.MixtralConfig(**bench_shape(intermediate_size=512), num_local_experts=8, num_experts_per_tok=2)
    versus = {
        "dense (llama, width 1024)": per_arch["llama"],
        "moe (mixtral, 8 x 512, top 2)": write_transformers_checkpoint(moe, work / "moe-8x512", tokenizer),
        EAGER: per_arch["llama"],
    }
    layer_types = ["sliding_attention", "full_attention"]
    window = {
        "mistral, window 256": transformers.MistralConfig(**bench_shape(), sliding_window=WINDOW),
        "mistral, no window": transformers.MistralConfig(**bench_shape(), sliding_window=None),
        "gemma3, window 256 (local + global)": transformers.Gemma3TextConfig(
            **bench_shape(), sliding_window=WINDOW, layer_types=layer_types, query_pre_attn_scalar=64
        ),
    }
    windowed = {
        name: write_transformers_checkpoint(config, work / f"window-{i}", tokenizer)  # same seed: same weights
        for i, (name, config) in enumerate(window.items())
    }
    return per_arch, versus, windowed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    import torch

    from splitserve.bench.engine.architectures_moe import moe_breakdown, report

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-arch-") as tmp:
        per_arch, versus, windowed = checkpoints(Path(tmp))
        results = {
            "decode": run_decode(per_arch, args.repeats, args.max_tokens),
            "moe": run_decode(versus, args.repeats, args.max_tokens),
            "moe_breakdown": moe_breakdown(versus, args.repeats),
            "window": run_window(windowed, args.repeats),
        }
    print(report(results))
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
