"""Write a Hugging Face checkpoint (config, safetensors, tokenizer) for tests, benches and demos.

`splitserve make-model DIR --preset tiny|small|bench|draft --arch llama|mistral|qwen2|qwen3|phi3|gemma3` writes
random weights; `--train-steps N` first trains them N AdamW steps on the built-in corpus
(engine/builtin_models/corpus_training.py) so the model continues and repeats corpus text. Both load
in transformers' AutoModelForCausalLM / AutoTokenizer and in splitserve.engine.model.loader.
Random checkpoints are byte-identical for the same arguments; trained ones are made once per
content key and copied from the cache (engine/builtin_models/model_cache.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from splitserve.engine.builtin_models.corpus_tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    IM_END,
    PAD_TOKEN,
    train_tokenizer,
    write_json,
    write_tokenizer,
)
from splitserve.engine.builtin_models.model_spec import (
    ARCHITECTURE_BY_ARCH,
    DTYPES,
    PRESETS,
    MakeModelError,
    ModelPreset,
    ModelSpec,
)
from splitserve.engine.builtin_models.moe_checkpoint import moe_config_keys
from splitserve.engine.builtin_models.random_weights import random_weights
from splitserve.engine.model.architectures import BY_ARCH

__all__ = [
    "ARCHITECTURE_BY_ARCH",
    "DTYPES",
    "PRESETS",
    "MakeModelError",
    "ModelPreset",
    "ModelSpec",
    "train_tokenizer",
    "write_checkpoint",
    "write_random_checkpoint",
]
TRAINING_FILE = "training.json"  # the loss curve and cost of a trained checkpoint

LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small on purpose: with max_position_embeddings 1024..4096 every frequency band
    # (kept, smoothed, divided) is exercised.
    "original_max_position_embeddings": 256,
}


def _config_dict(
    preset: ModelPreset, arch: str, vocab_size: int, dtype: str, rope_scaling: bool, token_ids: dict[str, int]
) -> dict:
    architecture, model_type = ARCHITECTURE_BY_ARCH[arch]
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": preset.num_hidden_layers,
        "num_attention_heads": preset.num_attention_heads,
        "num_key_value_heads": preset.num_key_value_heads,
        "head_dim": preset.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": preset.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": dict(LLAMA3_ROPE_SCALING) if rope_scaling else None,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
        "tie_word_embeddings": BY_ARCH[arch].tied_embeddings,
        "bos_token_id": token_ids[BOS_TOKEN],
        "eos_token_id": [token_ids[EOS_TOKEN], token_ids[IM_END]],
        "pad_token_id": token_ids[PAD_TOKEN],
        "torch_dtype": dtype,
    }
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    elif arch in ("mistral", "phi3"):
        config.update(sliding_window=None)  # full attention, like Llama
    elif arch in ("qwen2", "qwen3"):
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=preset.num_hidden_layers)
    if arch == "qwen3":
        config.update(attention_bias=False)
    if BY_ARCH[arch].moe_weight_names is not None:
        config.update(moe_config_keys(arch, preset.num_hidden_layers, preset.intermediate_size))
    if arch == "gemma3":
        config.update(_gemma3_keys(preset, rope_scaling))
        del config["hidden_act"], config["rope_theta"], config["rope_scaling"]
    return config


def _gemma3_keys(preset: ModelPreset, rope_scaling: bool) -> dict:
    """Gemma 3 text: sliding and global layers alternating (both kinds in the smallest preset),
    each with its own rope base; a window of half the context (prompts longer than it attend as
    windows in the local layers); final logits soft-capped."""
    full_rope = {"rope_type": "default", "rope_theta": 1_000_000.0}
    if rope_scaling:
        full_rope = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": preset.head_dim,
        "layer_types": [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(preset.num_hidden_layers)
        ],
        "sliding_window": preset.max_position_embeddings // 2,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": full_rope,
        },
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": None,
        "attention_bias": False,
    }


def _write_safetensors(weights: dict, out_dir: Path, num_shards: int) -> None:
    from safetensors.torch import save_file

    names = list(weights)
    if num_shards == 1:
        save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    per_shard = -(-len(names) // num_shards)
    weight_map = {}
    for s in range(num_shards):
        shard_name = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        chunk = {n: weights[n] for n in names[s * per_shard : (s + 1) * per_shard]}
        save_file(chunk, str(out_dir / shard_name), metadata={"format": "pt"})
        weight_map.update({n: shard_name for n in chunk})
    total = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    write_json(out_dir / "model.safetensors.index.json", index)


def write_checkpoint(spec: ModelSpec, out_dir: str | Path, num_threads: int = 1, on_step=None):
    """Write the checkpoint `spec` describes into out_dir (created if missing), training it
    first when spec.train_steps > 0. Returns the TrainingResult, or None for random weights."""
    from splitserve.engine.builtin_models.corpus_training import train_on_corpus

    shape = spec.shape
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(shape.vocab_size)
    token_ids = write_tokenizer(tokenizer, out, shape.max_position_embeddings)
    # The model's vocabulary is exactly the tokenizer's, so every sampled id decodes.
    vocab_size = tokenizer.get_vocab_size()
    config = _config_dict(shape, spec.arch, vocab_size, spec.dtype, spec.rope_scaling, token_ids)
    write_json(out / "config.json", config)
    write_json(
        out / "generation_config.json",
        {
            "bos_token_id": config["bos_token_id"],
            "eos_token_id": config["eos_token_id"],
            "pad_token_id": config["pad_token_id"],
        },
    )
    # Random weights are drawn in float32 and cast, so a trained run starts from exactly the
    # float32 weights the random checkpoint of the same seed holds.
    weights = random_weights(config, spec.seed, "float32")
    if spec.num_shards > len(weights):
        raise MakeModelError(f"num_shards {spec.num_shards} exceeds the {len(weights)} weight tensors")
    result = None
    if spec.train_steps:
        weights, result = train_on_corpus(
            out, weights, tokenizer, spec.train_steps, spec.seed, num_threads=num_threads, on_step=on_step
        )
        write_json(out / TRAINING_FILE, _training_record(spec, result))
    import torch

    torch_dtype = getattr(torch, spec.dtype)
    _write_safetensors({name: t.to(torch_dtype).contiguous() for name, t in weights.items()}, out, spec.num_shards)
    return result


def write_random_checkpoint(
    out_dir: str | Path,
    preset: str = "tiny",
    arch: str = "llama",
    seed: int = 0,
    dtype: str = "float32",
    num_shards: int = 1,
    rope_scaling: bool = False,
) -> Path:
    """Write a complete random-weight checkpoint into out_dir (created if missing)."""
    spec = ModelSpec(preset, arch, seed, dtype, num_shards, rope_scaling)
    write_checkpoint(spec, out_dir)
    return Path(out_dir)


def _training_record(spec: ModelSpec, result) -> dict:
    from dataclasses import asdict

    return {
        "spec": asdict(spec),
        "cache_key": spec.cache_key(),
        "recipe": asdict(result.recipe),
        "steps": result.steps,
        "tokens_seen": result.tokens_seen,
        "num_threads": result.num_threads,
        "wall_s": round(result.wall_s, 3),
        "cpu_s": round(result.cpu_s, 3),
        "losses": [round(loss, 5) for loss in result.losses],
    }


def add_make_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir", help="directory to write the checkpoint into")
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), default="tiny", help="shape; `draft` is a 1-layer draft for small/bench"
    )
    parser.add_argument("--arch", choices=sorted(ARCHITECTURE_BY_ARCH), default="llama")
    parser.add_argument("--seed", type=int, default=0, help="random init (and training data order)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--num-shards", type=int, default=1)
    parser.add_argument(
        "--rope-scaling", action="store_true", help="add Llama-3 rope_scaling to the config (gemma3: linear; not phi3)"
    )
    parser.add_argument(
        "--train-steps",
        type=int,
        default=0,
        help="train this many AdamW steps on the built-in corpus (CPU; 0 = random weights). "
        "The result is cached under $SPLITSERVE_CACHE (default ~/.cache/splitserve)",
    )
    parser.add_argument("--train-threads", type=int, default=1, help="torch intra-op threads while training")
    parser.add_argument("--no-cache", action="store_true", help="train into DIR without reading or filling the cache")


def add_make_model_parser(subparsers) -> argparse.ArgumentParser:
    """Register `make-model` on an argparse subparsers object (cluster/cli/main.py wires it)."""
    parser = subparsers.add_parser("make-model", help="write a random-weight or briefly trained HF checkpoint")
    add_make_model_arguments(parser)
    parser.set_defaults(func=run_make_model)
    return parser


def run_make_model(args: argparse.Namespace) -> int:
    from splitserve.engine.builtin_models.model_cache import cached_checkpoint

    try:
        spec = ModelSpec(
            preset=args.preset,
            arch=args.arch,
            seed=args.seed,
            dtype=args.dtype,
            num_shards=args.num_shards,
            rope_scaling=args.rope_scaling,
            train_steps=args.train_steps,
        )
        if args.train_threads < 1:
            raise MakeModelError(f"--train-threads must be >= 1, got {args.train_threads}")
        out = Path(args.out_dir)
        if out.exists() and not out.is_dir():
            raise MakeModelError(f"{out} exists and is not a directory")
    except MakeModelError as exc:
        print(f"splitserve make-model: error: {exc}", file=sys.stderr)
        return 2
    if not spec.train_steps:
        write_checkpoint(spec, out)
        print(f"wrote {spec.preset} {spec.arch} checkpoint to {out}")
        return 0
    progress = progress_printer(spec.train_steps)
    if args.no_cache:
        write_checkpoint(spec, out, num_threads=args.train_threads, on_step=progress)
        source = "trained (not cached)"
    else:
        cached = cached_checkpoint(spec, num_threads=args.train_threads, on_step=progress)
        out.mkdir(parents=True, exist_ok=True)
        for path in sorted(cached.path.iterdir()):
            shutil.copy2(path, out / path.name)
        source = f"{'cache hit' if cached.hit else 'trained and cached'}: {cached.path}"
    record = json.loads((out / TRAINING_FILE).read_text())
    print(
        f"wrote {spec.preset} {spec.arch} checkpoint trained {spec.train_steps} steps to {out} ({source}); "
        f"loss {record['losses'][0]:.3f} -> {record['losses'][-1]:.3f}, "
        f"training took {record['wall_s']:.1f} s wall, {record['cpu_s']:.1f} s CPU"
    )
    return 0


def progress_printer(steps: int):
    """An on_step callback that prints the loss to stderr about ten times over a run."""
    every = max(1, steps // 10)

    def on_step(step: int, loss: float) -> None:
        if step % every == 0 or step == steps - 1:
            print(f"  step {step + 1}/{steps} loss {loss:.3f}", file=sys.stderr, flush=True)

    return on_step


def main(argv: list[str] | None = None) -> int:
    """`python -m splitserve.engine.builtin_models.make_model DIR [--preset ...]`, the same as `splitserve make-model`."""
    parser = argparse.ArgumentParser(prog="python -m splitserve.engine.builtin_models.make_model")
    add_make_model_arguments(parser)
    return run_make_model(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
