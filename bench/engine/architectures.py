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


def decode_rate(engine, batch: int, max_tokens: int, seed: int, prompt_len: int = 16) -> float:
    """Decode tok/s: batch * (max_tokens - 1) / (t(max_tokens) - t(1)), fresh prompts each time."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    prompts = lambda: [[rng.randrange(16, vocab) for _ in range(prompt_len)] for _ in range(batch)]  # noqa: E731
    started = time.perf_counter()
    _greedy(engine, prompts(), 1)
    one = time.perf_counter() - started
    started = time.perf_counter()
    _greedy(engine, prompts(), max_tokens)
    full = time.perf_counter() - started
    return batch * (max_tokens - 1) / max(full - one, 1e-9)


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


def run_decode(paths: dict[str, Path], repeats: int, max_tokens: int) -> dict[str, dict[int, float]]:
    from unittest import mock

    from splitserve.engine.model.scripted_decode import CPU_DECODE_FORWARD_ENV

    engines = {}
    for name, path in paths.items():
        with mock.patch.dict("os.environ", {CPU_DECODE_FORWARD_ENV: "eager" if name == EAGER else "scripted"}):
            engines[name] = _engine(path)
    rates: dict[str, dict[int, list[float]]] = {name: {1: [], 32: []} for name in engines}
    for repeat in range(repeats):
        order = list(engines) if repeat % 2 == 0 else list(reversed(engines))
        for batch in (1, 32):
            for name in order:
                rates[name][batch].append(decode_rate(engines[name], batch, max_tokens, seed=repeat * 100 + batch))
    return {name: {b: statistics.median(v) for b, v in per.items()} for name, per in rates.items()}


def run_window(paths: dict[str, Path], repeats: int, num_seqs: int = 8) -> dict[str, dict]:
    """Per model: blocks held at the end of 8 sequences reaching 4 windows of context (a
    3-window prompt, one window of decode), against what the context needs, and decode tok/s
    over that last window."""
    rows: dict[str, dict] = {}
    context = 4 * WINDOW
    rng = random.Random(7)
    for repeat in range(repeats):
        for name, path in paths.items() if repeat % 2 == 0 else reversed(list(paths.items())):
            engine = _engine(path, num_kv_blocks=num_seqs * context // BLOCK_SIZE + 8, max_num_batched_tokens=2048)
            from splitserve.proto.messages.sampling_params import SamplingParams

            params = SamplingParams(temperature=0, max_tokens=WINDOW, ignore_eos=True)
            ids = [
                engine.add_request(prompt_token_ids=[rng.randrange(16, 2048) for _ in range(3 * WINDOW)], params=params)
                for _ in range(num_seqs)
            ]
            held, decode_started, decoded = 0, None, 0
            while engine.has_unfinished():
                outputs = engine.step()
                seqs = [engine.scheduler.requests.get(i) for i in ids]
                if all(s is not None and s.num_output_tokens >= 1 for s in seqs) and decode_started is None:
                    decode_started = time.perf_counter()
                if decode_started is not None:
                    decoded += sum(len(o.new_token_ids) for o in outputs)
                live = [s for s in seqs if s is not None and s.block_table]
                if live and min(s.num_tokens for s in live) >= context - 1:
                    held = max(held, engine.config.num_kv_blocks - engine.kv.num_free_blocks)
            elapsed = time.perf_counter() - (decode_started or time.perf_counter())
            row = rows.setdefault(name, {"tok_s": []})
            row.update(held=held, needed=num_seqs * (context // BLOCK_SIZE), kv_window=engine.kv.window)
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
