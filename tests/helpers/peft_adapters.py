"""LoRA adapters written by `peft` itself on a transformers checkpoint, and transformers + peft's
own greedy tokens with one applied: the parity reference for engine/lora/."""

from __future__ import annotations

from pathlib import Path

import peft
import torch
import transformers

from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from tests.helpers.transformers_checkpoint import hf_greedy, write_transformers_checkpoint

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# name -> (seed, r, lora_alpha, targets, use_rslora): ranks, scalings and targets that differ.
FOUR_ADAPTERS = {
    "attn": (1, 8, 16, ATTENTION, False),
    "mlp": (2, 4, 8, MLP, False),
    "all-rs": (3, 16, 8, ATTENTION + MLP, True),
    "qv": (4, 2, 4, ["q_proj", "v_proj"], False),
}


def write_peft_adapter(
    base_dir: Path, out: Path, seed: int, r: int, alpha: float, targets: list[str], use_rslora: bool = False
) -> Path:
    """A random adapter (init_lora_weights=False: lora_B is not zero, so it changes the output)
    for the checkpoint in base_dir, saved by peft to out."""
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=r, lora_alpha=alpha, target_modules=targets, use_rslora=use_rslora, init_lora_weights=False
    )
    peft.get_peft_model(base, config).save_pretrained(out)
    return out


def peft_greedy(base_dir: Path, adapter_dir: Path | None, ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generate on the base checkpoint, with the adapter applied by peft
    (None: the base alone)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval()
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir).eval()
    return hf_greedy(model, ids, max_new_tokens)


def write_base_and_adapters(
    root: Path, config: transformers.PretrainedConfig, seed: int, adapters: dict
) -> tuple[Path, dict[str, Path]]:
    """A random transformers checkpoint (with its tokenizer) under root/base, and one peft
    adapter per name under root/<name>, from its (seed, r, alpha, targets, rslora)."""
    base = root / "base"
    write_transformers_checkpoint(config, base, seed=seed, tokenizer=True)
    return base, {name: write_peft_adapter(base, root / name, *spec) for name, spec in adapters.items()}


def lora_engine(checkpoint: tuple[Path, dict[str, Path]], **overrides) -> LLMEngine:
    """An engine on write_base_and_adapters' base with every adapter a LoRA module (4 GPU
    slots, rank up to 16); overrides replace any of its EngineConfig fields."""
    base, adapters = checkpoint
    settings = dict(
        model=str(base),
        num_kv_blocks=64,
        enable_lora=True,
        lora_modules={name: str(path) for name, path in adapters.items()},
        max_loras=4,
        max_lora_rank=16,
    )
    return LLMEngine(EngineConfig(**{**settings, **overrides}))
