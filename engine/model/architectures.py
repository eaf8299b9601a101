"""The model registry: each `architectures` name a config.json may carry, the model class that
runs it, and the features that class supports for it. Torch-free (ModelConfig reads it).

Adding an architecture is an entry here plus, where its layers differ, the option in the
shared layers (engine/model/layers.py, and the scripted decode step, decode_graph.py) that
its entry turns on. What a registered architecture cannot run is refused at start-up by
name (ModelConfig), never run approximately.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

LLAMA_FAMILY = "splitserve.engine.model.llama:LlamaForCausalLM"
# The gated MLP's activations (engine/model/layers.py): SwiGLU's and GeGLU's.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# Which layers config.json's `sliding_window` windows, as transformers' model reads it:
#   ignored: none (Llama has no window);
#   every_layer: all of them whenever it is set (Mistral, Mixtral, Phi-3);
#   every_layer_if_enabled: all of them, only with `use_sliding_window` (Qwen3-MoE);
#   max_window_layers: only with `use_sliding_window`, those `layer_types` names, by default
#     the layers from `max_window_layers` on (Qwen2, Qwen3);
#   layer_types: those `layer_types` (or `sliding_window_pattern`) names (Gemma 3, gemma3_fields).
WindowRule = Literal["ignored", "every_layer", "every_layer_if_enabled", "max_window_layers", "layer_types"]


@dataclass(frozen=True)
class Architecture:
    name: str  # config.json `architectures[0]`
    model_type: str  # config.json `model_type`
    model_class: str = LLAMA_FAMILY  # "module:Class", imported only when a model is built
    attention_bias: bool = False  # q/k/v bias when config.json does not say (Qwen2 always has it)
    qk_norm: bool = False  # RMSNorm over each head of q and of k, before the rotary embedding
    tied_embeddings: bool = False  # what `make-model` writes (a real config.json says itself)
    # Phi-3: q/k/v stored as one `qkv_proj`, gate/up as one `gate_up_proj` in the checkpoint.
    fused_checkpoint: bool = False
    activation: str = "silu"  # the gated MLP's; config.json must name the same one
    make_model_arch: str = ""  # `splitserve make-model --arch` (default: model_type)
    # Gemma 3: every RMSNorm scales by (1 + w), in float32; norms after attention and after the
    # MLP as well as before them; embeddings times sqrt(hidden); sliding and global layers.
    norm_plus_one: bool = False
    sandwich_norms: bool = False
    scaled_embeddings: bool = False
    # The scripted CPU decode step (decode_graph.py) computes this architecture's layers;
    # False: its decode steps run the eager forward.
    scripted_decode: bool = True
    # Mixture of experts (engine/model/moe.py): the checkpoint's MoE block and its experts'
    # gate, up and down projection names; None: every layer's MLP is dense.
    moe_weight_names: tuple[str, str, str, str] | None = None
    # Qwen3-MoE casts the routing weights to the model's dtype before scaling the experts'
    # outputs; Mixtral scales them by the float32 weights.
    moe_weights_in_model_dtype: bool = False
    window_rule: WindowRule = "every_layer"

    @property
    def arch(self) -> str:
        return self.make_model_arch or self.model_type


ARCHITECTURES = {
    arch.name: arch
    for arch in (
        Architecture("LlamaForCausalLM", "llama", window_rule="ignored"),
        Architecture("MistralForCausalLM", "mistral"),
        Architecture(
            "Qwen2ForCausalLM", "qwen2", attention_bias=True, tied_embeddings=True, window_rule="max_window_layers"
        ),
        Architecture("Qwen3ForCausalLM", "qwen3", qk_norm=True, tied_embeddings=True, window_rule="max_window_layers"),
        Architecture("Phi3ForCausalLM", "phi3", fused_checkpoint=True),
        Architecture(
            "Gemma3ForCausalLM",
            "gemma3_text",
            qk_norm=True,
            tied_embeddings=True,
            activation="gelu_pytorch_tanh",
            make_model_arch="gemma3",
            norm_plus_one=True,
            sandwich_norms=True,
            scaled_embeddings=True,
            window_rule="layer_types",
        ),
        Architecture(
            "MixtralForCausalLM",
            "mixtral",
            moe_weight_names=("block_sparse_moe", "w1", "w3", "w2"),
        ),
        Architecture(
            "Qwen3MoeForCausalLM",
            "qwen3_moe",
            qk_norm=True,
            moe_weight_names=("mlp", "gate_proj", "up_proj", "down_proj"),
            moe_weights_in_model_dtype=True,
            window_rule="every_layer_if_enabled",
        ),
    )
}
BY_ARCH = {arch.arch: arch for arch in ARCHITECTURES.values()}


def unsupported_feature(arch: str, raw: dict[str, Any]) -> str | None:
    """What a registered architecture's config.json asks for that its model class does not
    compute, as the one-line start-up error (ModelConfig raises it); None: it runs."""
    expected = ARCHITECTURES[arch].activation
    key = "hidden_activation" if "hidden_activation" in raw else "hidden_act"  # Gemma names it so
    activation = raw.get(key) or expected
    if activation != expected:
        return f"{arch} with {key} {activation!r} is not supported (its MLP runs {expected})"
    rope_params = raw.get("rope_parameters")
    nested = rope_params if isinstance(rope_params, dict) else {}
    partial = nested.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if float(partial) != 1.0:
        return f"{arch} with partial_rotary_factor {partial} is not supported (rotary over whole heads)"
    if raw.get("attn_logit_softcapping"):
        return f"{arch} with attn_logit_softcapping {raw['attn_logit_softcapping']} is not supported"
    if raw.get("use_bidirectional_attention"):
        return f"{arch} with use_bidirectional_attention is not supported (causal attention only)"
    return None


SLIDING, FULL = "sliding_attention", "full_attention"  # config.json `layer_types` entries


def gemma3_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of a Gemma 3 text config.json, from either layout transformers
    writes: rope settings nested per layer kind under `rope_parameters` (transformers 5), or
    `rope_theta`, `rope_local_base_freq` and `rope_scaling` at the top (transformers 4)."""
    layers = int(raw["num_hidden_layers"])
    pattern = int(raw.get("sliding_window_pattern", 6))
    kinds = raw.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    rope_params = raw.get("rope_parameters")
    nested: dict[str, Any] = rope_params if isinstance(rope_params, dict) else {}
    full = dict(nested.get(FULL) or raw.get("rope_scaling") or {})
    local = dict(nested.get(SLIDING) or {})
    window = raw.get("sliding_window")
    return {
        "layer_types": list(kinds),
        "rope_theta": float(full.pop("rope_theta", raw.get("rope_theta", 1_000_000.0))),
        "rope_scaling": full if full.get("rope_type", full.get("type", "default")) != "default" else None,
        "local_rope_theta": float(local.get("rope_theta", raw.get("rope_local_base_freq", 10_000.0))),
        "local_rope_type": str(local.get("rope_type", "default")),
        "query_pre_attn_scalar": float(raw.get("query_pre_attn_scalar", raw.get("head_dim", 256))),
        "final_logit_softcapping": raw.get("final_logit_softcapping"),
        "sliding_window": int(window) if window and SLIDING in kinds else None,
    }


def window_fields(arch: Architecture, raw: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields `sliding_window` and `layer_types` (each layer's kind) of a
    config.json, by the architecture's window rule (WindowRule above); {} where no layer is
    windowed. Gemma 3's come with the rest of its fields (gemma3_fields)."""
    window = raw.get("sliding_window")
    rule = arch.window_rule
    if not window or rule in ("ignored", "layer_types"):
        return {}
    if rule != "every_layer" and not raw.get("use_sliding_window", False):
        return {}
    layers = int(raw["num_hidden_layers"])
    kinds = [SLIDING] * layers
    if rule == "max_window_layers":
        first = int(raw.get("max_window_layers", 28))  # transformers' default
        kinds = raw.get("layer_types") or [SLIDING if i >= first else FULL for i in range(layers)]
    if SLIDING not in kinds:
        return {}
    return {"sliding_window": int(window), "layer_types": list(kinds)}


def moe_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of a mixture-of-experts config.json: the experts per layer and
    per token, an expert's intermediate size, whether the k routing weights are rescaled to sum
    to one, and which layers are sparse. Mixtral: every layer, renormalised. Qwen3-MoE: every
    `decoder_sparse_step`-th layer not in `mlp_only_layers` (the others a dense MLP of
    `intermediate_size`), renormalised only with `norm_topk_prob` (transformers' default: not)."""
    layers = int(raw["num_hidden_layers"])
    mixtral = "num_local_experts" in raw
    experts = int(raw["num_local_experts"] if mixtral else raw.get("num_experts", 0))
    step = int(raw.get("decoder_sparse_step", 1))
    dense = set(raw.get("mlp_only_layers") or [])
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(raw["num_experts_per_tok"]),
        "moe_intermediate_size": int(raw.get("moe_intermediate_size") or raw["intermediate_size"]),
        "norm_topk_prob": bool(raw.get("norm_topk_prob", mixtral)),
        "moe_layers": [i for i in range(layers) if experts and i not in dense and (i + 1) % step == 0],
    }
