"""Random HF-named weights for make-model checkpoints (the starting point of trained ones too)."""

from __future__ import annotations

from splitserve.engine.builtin_models.moe_checkpoint import MOE_WEIGHT_NAMES, replace_with_experts
from splitserve.engine.model.architectures import moe_fields


def random_weights(config: dict, seed: int, dtype: str) -> dict:
    """HF-named weights. Scaled so logits have a wide spread: greedy top-1/top-2 gaps stay
    far above fp32 rounding noise, which keeps token-for-token parity tests stable."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim, vocab = config["head_dim"], config["vocab_size"]
    q_dim = config["num_attention_heads"] * head_dim
    kv_dim = config["num_key_value_heads"] * head_dim
    qkv_bias = config["model_type"] == "qwen2"
    qk_norm = config["model_type"] in ("qwen3", "qwen3_moe", "gemma3_text")
    gemma = config["model_type"] == "gemma3_text"
    # Gemma's norms scale by (1 + w): its stored weights are the same scales less one.
    norm_offset = 1.0 if gemma else 0.0
    # Gemma multiplies the embeddings by sqrt(hidden): smaller ones keep the same stream.
    embed_std = 0.1 / hidden**0.5 if gemma else 0.1

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def linear(out_features: int, in_features: int, gain: float = 1.0) -> torch.Tensor:
        return normal(out_features, in_features, std=gain / in_features**0.5)

    def norm_weight(mean: float = 1.0, size: int = hidden) -> torch.Tensor:
        return mean * (1.0 + normal(size, std=0.1)) - norm_offset

    tied = config["tie_word_embeddings"]
    moe_layers = moe_fields(config)["moe_layers"] if config["model_type"] in MOE_WEIGHT_NAMES else []
    # Small embeddings: the residual stream is dominated by what the layers compute, so a
    # tied output projection does not just echo the last input token.
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
        if qk_norm:
            weights[p + "self_attn.q_norm.weight"] = norm_weight(size=head_dim)
            weights[p + "self_attn.k_norm.weight"] = norm_weight(size=head_dim)
        weights[p + "self_attn.o_proj.weight"] = linear(hidden, q_dim)
        weights[p + "post_attention_layernorm.weight"] = norm_weight()
        weights[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
        weights[p + "mlp.up_proj.weight"] = linear(inter, hidden)
        weights[p + "mlp.down_proj.weight"] = linear(hidden, inter)
        if i in moe_layers:  # Mixtral, Qwen3-MoE: a router and experts instead
            replace_with_experts(weights, p, config, linear)
        if gemma:  # the norms after attention and the MLP; the pre-MLP one has its own name
            weights[p + "pre_feedforward_layernorm.weight"] = norm_weight()
            weights[p + "post_feedforward_layernorm.weight"] = norm_weight()
        if config["model_type"] == "phi3":  # Phi-3 stores q/k/v and gate/up fused
            qkv = [weights.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"]
            weights[p + "self_attn.qkv_proj.weight"] = torch.cat(qkv)
            gate_up = [weights.pop(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")]
            weights[p + "mlp.gate_up_proj.weight"] = torch.cat(gate_up)
    # Logits with std ~4 whether the output projection is lm_head or the embedding.
    logit_std = 4.0
    weights["model.norm.weight"] = norm_weight(logit_std / (embed_std * hidden**0.5) if tied else 1.0)
    if not tied:
        weights["lm_head.weight"] = linear(vocab, hidden, gain=logit_std)
    torch_dtype = getattr(torch, dtype)
    return {name: t.to(torch_dtype).contiguous() for name, t in weights.items()}
