"""ModelConfig / EngineConfig / ServeConfig validation."""

import pytest

from splitserve.cluster.config import ServeConfig
from splitserve.engine.config import ConfigError, EngineConfig
from splitserve.engine.model_config import ModelConfig

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


def test_the_sliding_window_windows_the_layers_transformers_windows():
    """A window is computed, not a cap on the context: Mistral's covers every layer; Qwen2's
    only with use_sliding_window, from max_window_layers on; Llama has none."""
    mistral = ModelConfig.from_dict({**BASE, "sliding_window": 256})
    assert mistral.max_context_len == 1024 and mistral.kv_window == 256
    assert [mistral.layer_window(i) for i in range(2)] == [256, 256]
    assert ModelConfig.from_dict(BASE).kv_window is None
    qwen = {**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 256, "use_sliding_window": False}
    assert ModelConfig.from_dict(qwen).sliding_window is None and ModelConfig.from_dict(qwen).attention_bias
    mixed = ModelConfig.from_dict({**qwen, "use_sliding_window": True, "max_window_layers": 1})
    assert [mixed.layer_window(i) for i in range(2)] == [None, 256] and mixed.kv_window is None
    llama = ModelConfig.from_dict({**BASE, "architectures": ["LlamaForCausalLM"], "sliding_window": 256})
    assert llama.sliding_window is None
    with pytest.raises(ConfigError, match="sliding_window must be >= 1"):
        ModelConfig.from_dict({**BASE, "sliding_window": -4})


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


def test_each_setting_has_one_definition():
    """The dtype list, the router policies and the KV block count's name and default are
    defined once; everything that offers them derives from that definition."""
    import typing

    from splitserve.cluster.cli.main import build_parser
    from splitserve.cluster.config import EnginePoolConfig
    from splitserve.cluster.routing.router_config import ROUTER_POLICIES, RouterPolicy
    from splitserve.engine.config import DEFAULT_NUM_KV_BLOCKS, DTYPES, Dtype
    from splitserve.engine.ops.kv_cache import DTYPE_BY_NAME

    assert DTYPES == typing.get_args(Dtype) and tuple(DTYPE_BY_NAME) == DTYPES
    schema = ServeConfig.model_json_schema()
    assert tuple(schema["properties"]["dtype"]["anyOf"][0]["enum"]) == DTYPES
    assert tuple(schema["$defs"]["RouterConfig"]["properties"]["policy"]["enum"]) == ROUTER_POLICIES
    assert ROUTER_POLICIES == typing.get_args(RouterPolicy)
    commands = build_parser().parse_args(["generate", "--model", "m", "--prompt", "p"]).command_parsers
    generate = {a.dest: a for a in commands["generate"]._actions}
    assert tuple(generate["dtype"].choices) == DTYPES
    assert tuple({a.dest: a for a in commands["make-model"]._actions}["dtype"].choices) == DTYPES
    # One name (num_kv_blocks: device-neutral) and one default for the KV block count.
    assert EngineConfig(model="m").num_kv_blocks == EnginePoolConfig().num_kv_blocks == DEFAULT_NUM_KV_BLOCKS
    assert generate["num_kv_blocks"].default == DEFAULT_NUM_KV_BLOCKS
    assert schema["$defs"]["PrefillPoolConfig"]["properties"]["num_kv_blocks"]["default"] == DEFAULT_NUM_KV_BLOCKS


def test_model_id_rule():
    assert ServeConfig().model_id == "small-llama-trained300"  # the default model's name
    assert ServeConfig(model="./models/my-llama").model_id == "./models/my-llama"  # as given, like vLLM
    assert ServeConfig(model="./models/my-llama", served_model_name="llama").model_id == "llama"


def test_max_model_len_reaches_the_engines_and_is_bounded_by_the_model():
    from splitserve.cluster.control.worker_pool import engine_config_for

    cfg = ServeConfig(max_model_len=300, prefill={"num_kv_blocks": 99})
    engine = EngineConfig(**engine_config_for(cfg, cfg.prefill, "m"))
    assert engine.max_model_len == 300 and engine.num_kv_blocks == 99
    model = ModelConfig.from_dict(BASE)
    assert model.resolve_max_model_len(None) == 1024 and model.resolve_max_model_len(300) == 300
    with pytest.raises(ConfigError, match="max_model_len 2048 exceeds the model's context of 1024"):
        model.resolve_max_model_len(2048)
    with pytest.raises(ValueError):
        ServeConfig(max_model_len=0)


def test_the_serve_app_is_a_controller_and_ingress_replicas():
    """build_app: a one-replica controller deployment bound into the ingress deployment, whose
    replica count (or Serve autoscaling) comes from `ingress`, placed anywhere unless
    ingress.resources says otherwise."""
    from splitserve.cluster.app import CONTROLLER_DEPLOYMENT_NAME, DEPLOYMENT_NAME, build_app

    ingress = build_app({"ingress": {"replicas": 3}})._bound_deployment
    assert (ingress.name, ingress.num_replicas) == (DEPLOYMENT_NAME, 3)
    assert ingress._deployment_config.autoscaling_config is None
    assert ingress.ray_actor_options == {"num_cpus": 0.0, "resources": {}}  # not pinned to the head
    controller = ingress.init_args[1]._bound_deployment
    assert (controller.name, controller.num_replicas) == (CONTROLLER_DEPLOYMENT_NAME, 1)
    assert controller.max_ongoing_requests >= 100  # every ingress long-polls it

    scaled = build_app(
        {
            "ingress": {
                "resources": {"node:__internal_head__": 0.001},
                "autoscaling": {"enabled": True, "min_replicas": 2, "max_replicas": 5, "target_ongoing_requests": 8},
            }
        }
    )._bound_deployment
    autoscaling = scaled._deployment_config.autoscaling_config
    assert (autoscaling.min_replicas, autoscaling.initial_replicas, autoscaling.max_replicas) == (2, 2, 5)
    assert autoscaling.target_ongoing_requests == 8
    assert scaled.ray_actor_options["resources"] == {"node:__internal_head__": 0.001}
    with pytest.raises(ValueError, match="min_replicas must be <= max_replicas"):
        ServeConfig.model_validate({"ingress": {"autoscaling": {"min_replicas": 5, "max_replicas": 2}}})


def test_quantization_is_one_setting_from_cli_yaml_and_generate_to_both_pools():
    from splitserve.cluster.cli.main import build_parser
    from splitserve.cluster.cli.serve_flags import config_from_args
    from splitserve.cluster.control.worker_pool import engine_config_for
    from splitserve.engine.config import QUANTIZATIONS

    schema = ServeConfig.model_json_schema()
    assert tuple(schema["properties"]["quantization"]["enum"]) == QUANTIZATIONS == ("none", "int8", "fp8", "int4")
    cfg = ServeConfig.model_validate({"quantization": "fp8"})
    for pool in (cfg.prefill, cfg.decode):  # both pools load the same weights
        assert EngineConfig(**engine_config_for(cfg, pool, "m")).quantization == "fp8"
    with pytest.raises(ValueError, match="'none', 'int8', 'fp8' or 'int4'"):
        ServeConfig.model_validate({"quantization": "int3"})
    commands = build_parser().parse_args(["generate", "--model", "m", "--prompt", "p"]).command_parsers
    generate = {a.dest: a for a in commands["generate"]._actions}
    assert tuple(generate["quantization"].choices) == QUANTIZATIONS and generate["quantization"].default == "none"
    serve_args = build_parser().parse_args(["serve", "--quantization", "int4"])
    assert config_from_args(serve_args, environ={}).quantization == "int4"


def test_model_entries_inherit_the_top_level_and_survive_a_dump():
    cfg = ServeConfig.model_validate(
        {
            "quantization": "int8",
            "decode": {"replicas": 2, "num_kv_blocks": 128},
            "models": [
                {"model": "/m/small", "decode": {"num_kv_blocks": 32}},
                {"model": "/m/large", "served_model_name": "large", "quantization": "none"},
            ],
        }
    )
    for config in (cfg, ServeConfig.model_validate(cfg.model_dump())):  # build_app's args round trip
        (small_name, small), (large_name, large) = config.model_deployments()
        assert (small_name, small.model_id, large_name, large.model_id) == ("/m/small", "/m/small", "large", "large")
        assert (small.decode.replicas, small.decode.num_kv_blocks, small.quantization) == (2, 32, "int8")
        assert (large.decode.replicas, large.decode.num_kv_blocks, large.quantization) == (2, 128, "none")
        assert not small.models and not large.models
    one = ServeConfig.model_validate({"model": "/m/a"})
    assert one.model_deployments() == [("/m/a", one)]  # no list: the top level is the one model


def test_a_model_entry_that_does_not_hold_together_names_itself():
    with pytest.raises(ValueError, match=r"models\[1\] \('b'\).*kv_cache_dtype"):
        ServeConfig.model_validate(
            {
                "models": [
                    {"model": "/m/a"},
                    {"model": "/m/b", "served_model_name": "b", "decode": {"kv_cache_dtype": "fp8"}},
                ]
            }
        )
