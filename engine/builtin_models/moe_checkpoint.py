"""make-model's mixture-of-experts pieces (Mixtral, Qwen3-MoE): the config.json keys and the
random router and expert weights, in the checkpoint names transformers writes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from splitserve.engine.model.architectures import BY_ARCH

NUM_EXPERTS = 4
EXPERTS_PER_TOKEN = 2
# model_type -> the checkpoint's MoE block and its experts' gate, up and down names.
MOE_WEIGHT_NAMES = {
    arch.model_type: arch.moe_weight_names for arch in BY_ARCH.values() if arch.moe_weight_names is not None
}


def moe_config_keys(arch: str, num_layers: int, intermediate_size: int) -> dict[str, Any]:
    """Four experts, two per token. Qwen3-MoE: experts half the dense width, renormalised
    weights, its last layer dense (mlp_only_layers), so both kinds of layer are written."""
    if arch == "mixtral":
        return {"num_local_experts": NUM_EXPERTS, "num_experts_per_tok": EXPERTS_PER_TOKEN, "sliding_window": None}
    return {
        "num_experts": NUM_EXPERTS,
        "num_experts_per_tok": EXPERTS_PER_TOKEN,
        "moe_intermediate_size": intermediate_size // 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [num_layers - 1],
        "use_sliding_window": False,
        "sliding_window": None,
        "attention_bias": False,
    }


def replace_with_experts(weights: dict, prefix: str, config: dict, linear: Callable[..., Any]) -> None:
    """Swap one layer's dense MLP weights (at prefix, "model.layers.i.") for a router and
    experts, each drawn by linear(out_features, in_features)."""
    block, gate, up, down = MOE_WEIGHT_NAMES[config["model_type"]]
    hidden = config["hidden_size"]
    inter = config.get("moe_intermediate_size") or config["intermediate_size"]
    for name in ("gate_proj", "up_proj", "down_proj"):
        del weights[f"{prefix}mlp.{name}.weight"]
    weights[f"{prefix}{block}.gate.weight"] = linear(NUM_EXPERTS, hidden, gain=4.0)  # decisive routing
    for e in range(NUM_EXPERTS):
        expert = f"{prefix}{block}.experts.{e}."
        weights[expert + f"{gate}.weight"] = linear(inter, hidden)
        weights[expert + f"{up}.weight"] = linear(inter, hidden)
        weights[expert + f"{down}.weight"] = linear(hidden, inter)
