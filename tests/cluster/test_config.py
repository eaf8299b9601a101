"""ModelConfig / EngineConfig / ServeConfig validation."""

import pytest

from splitserve.cluster.config import ServeConfig
from splitserve.engine.config import ConfigError, EngineConfig, ModelConfig

BASE = {
    "architectures": ["MistralForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
}


def test_sliding_window_caps_the_context():
    assert ModelConfig.from_dict(BASE).max_context_len == 1024
    assert ModelConfig.from_dict({**BASE, "sliding_window": 256}).max_context_len == 256
    qwen = {**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 256, "use_sliding_window": False}
    assert ModelConfig.from_dict(qwen).max_context_len == 1024
    assert ModelConfig.from_dict(qwen).attention_bias


@pytest.mark.parametrize(
    "patch,match",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture"),
        ({"num_key_value_heads": 3}, "multiple"),
        ({"architectures": []}, "architectures"),
    ],
)
def test_bad_model_configs(patch, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict({**BASE, **patch})
    with pytest.raises(ConfigError, match="missing required key"):
        ModelConfig.from_dict({k: v for k, v in BASE.items() if k != "hidden_size"})


def test_engine_and_serve_config_checks():
    with pytest.raises(ConfigError, match="power of two"):
        EngineConfig(model="m", block_size=12)
    with pytest.raises(ValueError):
        ServeConfig.model_validate({"prefill": {"replicas": -1}})
    with pytest.raises(ValueError):
        ServeConfig.model_validate({"router": {"policy": "fastest"}})
    with pytest.raises(ValueError):
        ServeConfig.model_validate({"unknown_field": 1})
