"""A LoRA adapter as the `peft` library saves it: `adapter_config.json` (r, lora_alpha,
use_rslora, target_modules) and `adapter_model.safetensors` (each targeted Linear's lora_A
[r, in] and lora_B [out, r]). Read into host tensors and checked against the base model here,
so that every refusal is one line at load, before anything reaches a device slot."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from splitserve.engine.engine_errors import LoraAdapterError
from splitserve.engine.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The Linear layers of a decoder layer an adapter may target, by their HF module names.
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS
# peft's key: base_model.model.model.layers.<i>.<self_attn|mlp>.<target>.lora_<A|B>.weight
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# Settings that change what the adapter computes and that this engine does not run: refused,
# never ignored, so an adapter is served exactly or not at all.
_UNSUPPORTED = {
    "use_dora": "DoRA",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "layers_to_transform": "a subset of layers (layers_to_transform)",
    "fan_in_fan_out": "fan_in_fan_out weights",
    "lora_bias": "LoRA biases (lora_bias)",
    "target_parameters": "parameter targets (target_parameters)",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "layer_replication": "layer replication",
}


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter on the host: per (layer, target) its lora_A [r, in] and lora_B [out, r],
    and the scaling PEFT multiplies B(A x) by (lora_alpha / r, or / sqrt(r) with rsLoRA)."""

    name: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def targets(self) -> set[str]:
        return {target for _, target in self.weights}


def target_shape(config: ModelConfig, target: str) -> tuple[int, int]:
    """(out, in) of the base model's Linear a target names (HF's unfused q/k/v, gate/up)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    return {
        "q_proj": (q_size, hidden),
        "k_proj": (kv_size, hidden),
        "v_proj": (kv_size, hidden),
        "o_proj": (hidden, q_size),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }[target]


def _read_config(name: str, path: Path) -> dict:
    if not path.is_dir():
        raise LoraAdapterError(f"LoRA adapter {name!r}: {path} is not a directory")
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise LoraAdapterError(f"LoRA adapter {name!r}: no {CONFIG_FILE} in {path}")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise LoraAdapterError(f"LoRA adapter {name!r}: {config_path} is not valid JSON: {exc}") from None
    if raw.get("peft_type", "LORA") != "LORA":
        raise LoraAdapterError(f"LoRA adapter {name!r}: peft_type {raw['peft_type']!r} is not LORA")
    for key, what in _UNSUPPORTED.items():
        if raw.get(key):
            raise LoraAdapterError(f"LoRA adapter {name!r}: {what} is not supported")
    if raw.get("bias", "none") != "none":
        raise LoraAdapterError(f"LoRA adapter {name!r}: trained biases (bias={raw['bias']!r}) are not supported")
    return raw


def _targets(name: str, raw: dict) -> set[str]:
    targets = raw.get("target_modules")
    if isinstance(targets, str):  # peft accepts a regex here; a saved adapter names its modules
        raise LoraAdapterError(f"LoRA adapter {name!r}: target_modules as a pattern ({targets!r}) is not supported")
    unknown = sorted(set(targets or ()) - set(TARGETS))
    if unknown:
        raise LoraAdapterError(
            f"LoRA adapter {name!r}: unknown target modules {', '.join(unknown)} (supported: {', '.join(TARGETS)})"
        )
    return set(targets or ())


def _scaling(name: str, raw: dict, max_rank: int) -> tuple[int, float]:
    rank, alpha = raw.get("r"), raw.get("lora_alpha", 8)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoraAdapterError(f"LoRA adapter {name!r}: r must be an integer >= 1, got {rank!r}")
    if rank > max_rank:
        raise LoraAdapterError(f"LoRA adapter {name!r}: rank {rank} is above max_lora_rank={max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoraAdapterError(f"LoRA adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
    return rank, alpha / (math.sqrt(rank) if raw.get("use_rslora") else rank)


def load_peft_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read and check one adapter against the base model's shapes; LoraAdapterError if unfit."""
    path = Path(path)
    raw = _read_config(name, path)
    targets = _targets(name, raw)
    rank, scaling = _scaling(name, raw, max_rank)
    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file():
        raise LoraAdapterError(f"LoRA adapter {name!r}: no {WEIGHTS_FILE} in {path}")
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(weights_path).items():
        match = _KEY.match(key)
        if match is None:
            raise LoraAdapterError(f"LoRA adapter {name!r}: unexpected tensor {key}")
        layer, target, half = int(match.group(1)), match.group(3), match.group(4)
        if target not in targets:
            raise LoraAdapterError(f"LoRA adapter {name!r}: tensor {key} is for {target}, not in target_modules")
        if layer >= config.num_hidden_layers:
            raise LoraAdapterError(
                f"LoRA adapter {name!r}: tensor {key} is for layer {layer} but the base model has "
                f"{config.num_hidden_layers} layers (an adapter for another base?)"
            )
        out_dim, in_dim = target_shape(config, target)
        expected = (rank, in_dim) if half == "A" else (out_dim, rank)
        if tuple(tensor.shape) != expected:
            raise LoraAdapterError(
                f"LoRA adapter {name!r}: {key} has shape {tuple(tensor.shape)}, the base model implies "
                f"{expected} (an adapter for another base?)"
            )
        halves.setdefault((layer, target), {})[half] = tensor
    if config.moe_layers and targets & set(MLP_TARGETS):
        raise LoraAdapterError(f"LoRA adapter {name!r}: MLP targets on a mixture-of-experts model are not supported")
    weights = {}
    for where, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise LoraAdapterError(f"LoRA adapter {name!r}: layer {where[0]} {where[1]} has lora_A or lora_B only")
        weights[where] = (pair["A"], pair["B"])
    if not weights:
        raise LoraAdapterError(f"LoRA adapter {name!r}: {weights_path} holds no LoRA weights")
    return LoraAdapter(name, rank, scaling, weights)
