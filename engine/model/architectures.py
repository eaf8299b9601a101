"""The model registry: each `architectures` name a config.json may carry, the model class that
runs it, and the features that class supports for it. Torch-free (ModelConfig reads it).

Adding an architecture is an entry here plus, where its layers differ, the option in the
shared layers (engine/model/layers.py, and the scripted decode step, decode_graph.py) that
its entry turns on. What a registered architecture cannot run is refused at start-up by
name (ModelConfig), never run approximately.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LLAMA_FAMILY = "splitserve.engine.model.llama:LlamaForCausalLM"
# The gated MLP's activations (engine/model/layers.py): SwiGLU's and GeGLU's.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


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

    @property
    def arch(self) -> str:
        return self.make_model_arch or self.model_type


ARCHITECTURES = {
    arch.name: arch
    for arch in (
        Architecture("LlamaForCausalLM", "llama"),
        Architecture("MistralForCausalLM", "mistral"),
        Architecture("Qwen2ForCausalLM", "qwen2", attention_bias=True, tied_embeddings=True),
        Architecture("Qwen3ForCausalLM", "qwen3", qk_norm=True, tied_embeddings=True),
        Architecture("Phi3ForCausalLM", "phi3", fused_checkpoint=True),
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
    return None
