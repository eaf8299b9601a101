"""Checkpoints as transformers itself writes them (its own config keys, weight names and tied
embeddings) load and compute transformers' logits: the parity reference for each architecture
the registry adds, independent of `splitserve make-model`."""

from __future__ import annotations

import pytest
import torch
import transformers

from splitserve.engine.config import ConfigError, ModelConfig
from splitserve.engine.model.loader import load_model
from tests.helpers.model import contiguous_metadata, make_kv_cache

SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # explicit, and not hidden / heads: Qwen3 sets it so
    max_position_embeddings=256,
)
CONFIGS = {
    "qwen3": lambda: transformers.Qwen3Config(**SHAPE, tie_word_embeddings=True, rope_theta=1_000_000.0),
    "qwen3-untied": lambda: transformers.Qwen3Config(**SHAPE, tie_word_embeddings=False),
}


def _write(config, path, seed: int):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random norms, so a norm loaded into the wrong place shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("case", list(CONFIGS))
def test_a_transformers_checkpoint_computes_transformers_logits(tmp_path, case):
    hf = _write(CONFIGS[case](), tmp_path, seed=len(case))
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
