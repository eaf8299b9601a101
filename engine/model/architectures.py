"""The model registry: each `architectures` name a config.json may carry, the model class that
runs it, and the features that class supports for it. Torch-free (ModelConfig reads it).

Adding an architecture is an entry here plus, where its layers differ, the option in the
shared layers (engine/model/layers.py, and the scripted decode step, decode_graph.py) that
its entry turns on. Every registered architecture runs every engine feature (tensor
parallelism, quantization, the scripted decode step); what one of them cannot run is
refused at start-up by name (ModelConfig), never run approximately.
"""

from __future__ import annotations

from dataclasses import dataclass

LLAMA_FAMILY = "splitserve.engine.model.llama:LlamaForCausalLM"


@dataclass(frozen=True)
class Architecture:
    name: str  # config.json `architectures[0]`
    model_type: str  # config.json `model_type`; also `splitserve make-model --arch`
    model_class: str = LLAMA_FAMILY  # "module:Class", imported only when a model is built
    attention_bias: bool = False  # q/k/v bias when config.json does not say (Qwen2 always has it)
    qk_norm: bool = False  # RMSNorm over each head of q and of k, before the rotary embedding
    tied_embeddings: bool = False  # what `make-model` writes (a real config.json says itself)


ARCHITECTURES = {
    arch.name: arch
    for arch in (
        Architecture("LlamaForCausalLM", "llama"),
        Architecture("MistralForCausalLM", "mistral"),
        Architecture("Qwen2ForCausalLM", "qwen2", attention_bias=True, tied_embeddings=True),
        Architecture("Qwen3ForCausalLM", "qwen3", qk_norm=True, tied_embeddings=True),
    )
}
BY_MODEL_TYPE = {arch.model_type: arch for arch in ARCHITECTURES.values()}
# The MLP activation every registered architecture's gated MLP uses (SwiGLU).
ACTIVATION = "silu"
