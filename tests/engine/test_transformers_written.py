"""Checkpoints as transformers itself writes them (its own config keys, weight names and tied
embeddings) load and compute transformers' logits and greedy tokens: the parity reference for
each architecture the registry adds, independent of `splitserve make-model`."""

from __future__ import annotations

import pytest
import torch
import transformers

from splitserve.engine.builtin_models.model_spec import MakeModelError, ModelSpec
from splitserve.engine.config import ConfigError
from splitserve.engine.model.loader import load_model
from splitserve.engine.model_config import ModelConfig
from tests.helpers.model import contiguous_metadata, greedy_generate, make_kv_cache
from tests.helpers.transformers_checkpoint import PARITY_SHAPE, hf_greedy, model_logits, write_transformers_checkpoint

SHAPE = dict(PARITY_SHAPE, head_dim=32)  # explicit, and not hidden / heads: Qwen3 sets it so
CONFIGS = {
    "qwen3": lambda: transformers.Qwen3Config(**SHAPE, tie_word_embeddings=True, rope_theta=1_000_000.0),
    "qwen3-untied": lambda: transformers.Qwen3Config(**SHAPE, tie_word_embeddings=False),
}


@pytest.mark.parametrize("case", list(CONFIGS))
def test_a_transformers_checkpoint_computes_transformers_logits(tmp_path, case):
    hf = write_transformers_checkpoint(CONFIGS[case](), tmp_path, seed=len(case))
    model, config = load_model(tmp_path)
    assert config.qk_norm and config.head_dim == 32
    ids = torch.randint(0, SHAPE["vocab_size"], (40,), generator=torch.Generator().manual_seed(7)).tolist()
    kv_cache, blocks_per_seq = make_kv_cache(model, len(ids))
    meta = contiguous_metadata([len(ids)], [len(ids)], 16, blocks_per_seq)
    logits = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), kv_cache, meta))
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_an_activation_the_mlp_does_not_run_is_refused_by_name():
    raw = {**SHAPE, "architectures": ["Qwen3ForCausalLM"], "hidden_act": "gelu"}
    with pytest.raises(ConfigError, match="hidden_act 'gelu' is not supported"):
        ModelConfig.from_dict(raw)


# Phi-3: hidden / heads gives the head size (Phi3Config has no head_dim of its own).
PHI3_SHAPE = {
    **{k: v for k, v in SHAPE.items() if k != "head_dim"},
    "hidden_size": 128,
    **dict(bos_token_id=1, eos_token_id=2, pad_token_id=0),  # its defaults lie outside a 256 vocabulary
}
PHI3_CONFIGS = {
    "phi3-gqa": lambda: transformers.Phi3Config(**PHI3_SHAPE, rope_scaling=None),
    "phi3-mha": lambda: transformers.Phi3Config(**{**PHI3_SHAPE, "num_key_value_heads": 4}),
}


def _prompt(length: int, vocab_size: int) -> list[int]:
    return torch.randint(0, vocab_size, (length,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.mark.parametrize("case", list(PHI3_CONFIGS))
def test_a_phi3_checkpoint_splits_its_fused_tensors_and_matches_transformers(tmp_path, case):
    hf = write_transformers_checkpoint(PHI3_CONFIGS[case](), tmp_path, seed=len(case))
    names = set(hf.state_dict())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    model, config = load_model(tmp_path)
    assert config.architecture == "Phi3ForCausalLM" and config.head_dim == 32
    ids = _prompt(40, PHI3_SHAPE["vocab_size"])
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(model_logits(model, ids), expected, atol=1e-4, rtol=0)
    assert greedy_generate(model, ids, 12) == hf_greedy(hf, ids, 12)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (
            {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16}},
            "longrope",
        ),
        ({"rope_scaling": {"type": "su", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16}}, "'su'"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
        ({"hidden_act": "gelu_new"}, "hidden_act 'gelu_new'"),
    ],
)
def test_what_phi3_cannot_run_is_refused_by_name(change, named):
    raw = {**PHI3_SHAPE, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", **change}
    with pytest.raises(ConfigError, match=named):
        ModelConfig.from_dict(raw)
    with pytest.raises(MakeModelError, match="not written for phi3"):  # make-model's Llama-3 scaling
        ModelSpec(arch="phi3", rope_scaling=True)


GEMMA3_CONFIGS = {
    # Tied embeddings, an explicit head_dim (not hidden / heads), GQA, both kinds of layer, each
    # with its own rope base, and final logits soft-capped; the window is above every prompt
    # here, and the engine's context is capped at it (the last test).
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **{**SHAPE, "num_hidden_layers": 3},
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=64,
        query_pre_attn_scalar=24,
        final_logit_softcapping=3.0,
    ),
    "gemma3-gqa4-linear-rope": lambda: transformers.Gemma3TextConfig(
        **{**SHAPE, "num_attention_heads": 8, "head_dim": 16},
        sliding_window=128,
        sliding_window_pattern=2,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
    ),
}


@pytest.mark.parametrize("case", list(GEMMA3_CONFIGS))
def test_a_gemma3_checkpoint_matches_transformers(tmp_path, case):
    hf = write_transformers_checkpoint(GEMMA3_CONFIGS[case](), tmp_path, seed=len(case))
    model, config = load_model(tmp_path)
    assert config.architecture == "Gemma3ForCausalLM" and config.qk_norm and config.tie_word_embeddings
    assert {"sliding_attention", "full_attention"} <= set(config.layer_types or [])
    assert config.local_rope_theta != config.rope_theta
    ids = _prompt(40, SHAPE["vocab_size"])
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(model_logits(model, ids), expected, atol=1e-4, rtol=0)
    assert greedy_generate(model, ids, 12) == hf_greedy(hf, ids, 12)


def test_gemma3_windows_its_sliding_layers_and_what_it_cannot_run_is_refused():
    raw = {**SHAPE, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "sliding_window": 64}
    # The window is computed (tests/engine/test_sliding_window.py), not a cap on the context;
    # a global layer sees everything, so no KV block ever falls out of every layer's view.
    config = ModelConfig.from_dict({**raw, "layer_types": ["sliding_attention", "full_attention"]})
    assert config.max_context_len == SHAPE["max_position_embeddings"] and config.kv_window is None
    assert [config.layer_window(i) for i in range(2)] == [64, None]
    every_local = ModelConfig.from_dict(raw)  # sliding_window_pattern 6: both layers local
    assert every_local.kv_window == 64
    every_layer_global = ModelConfig.from_dict({**raw, "layer_types": ["full_attention"] * 2})
    assert every_layer_global.sliding_window is None
    refused = {
        "attn_logit_softcapping": ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping 50.0"),
        "activation": ({"hidden_activation": "silu"}, "hidden_activation 'silu' is not supported"),
        "bidirectional": ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        "local rope": (
            {"rope_parameters": {"sliding_attention": {"rope_type": "yarn", "rope_theta": 1e4}}},
            "'yarn' for the sliding-window layers",
        ),
    }
    for change, named in refused.values():
        with pytest.raises(ConfigError, match=named):
            ModelConfig.from_dict({**raw, **change})
