"""Aliases and model routes in ServeConfig: a target that is not served is a startup error
naming both the route (or alias) and the model; names never collide."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.model_route_config import alias_weights


def config(**extra) -> ServeConfig:
    return ServeConfig.model_validate({"model": "/models/m", "served_model_name": "m", **extra})


def test_aliases_and_routes_naming_the_served_model_validate():
    cfg = config(
        aliases={"chat": "m", "canary": {"m": 3}},
        model_routes=[
            {"name": "auto", "policy": "rules", "default": "m", "rules": [{"target": "m", "header": "X-Tier"}]},
            {"name": "scored", "policy": "scorer", "scorer": {"small": "m", "large": "m", "threshold": 0.3}},
        ],
    )
    assert alias_weights(cfg.aliases["chat"]) == {"m": 1.0}
    assert alias_weights(cfg.aliases["canary"]) == {"m": 3}
    assert cfg.model_routes[0].rules[0].header == "x-tier"  # header names are case-insensitive
    assert cfg.model_routes[1].targets() == ["m", "m"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"aliases": {"chat": "gone"}}, "alias 'chat' names model 'gone', which is not served"),
        ({"aliases": {"chat": {"m": 1, "gone": 1}}}, "alias 'chat' names model 'gone'"),
        ({"aliases": {"chat": {"m": 0}}}, "the weight of 'm' must be > 0"),
        ({"aliases": {"chat": {}}}, "alias 'chat' names no model"),
        ({"aliases": {"m": "m"}}, "alias 'm' is already a served model's name"),
        (
            {"model_routes": [{"name": "auto", "policy": "cascade", "cascade": {"small": "m", "large": "big"}}]},
            "model route 'auto' names model 'big', which is not served",
        ),
        (
            {"model_routes": [{"name": "auto", "policy": "rules", "default": "m", "rules": [{"target": "x"}]}]},
            "model route 'auto' names model 'x'",
        ),
        ({"model_routes": [{"name": "auto", "policy": "rules"}]}, "a rules route needs a default model"),
        ({"model_routes": [{"name": "auto", "policy": "cascade"}]}, "policy cascade needs a cascade section"),
        ({"model_routes": [{"name": "auto", "policy": "scorer"}]}, "policy scorer needs a scorer section"),
        (
            {"model_routes": [{"name": "a", "policy": "cascade", "cascade": {"small": "m", "large": "m"}}]},
            "small and large are both 'm'",
        ),
        (
            {"aliases": {"auto": "m"}, "model_routes": [{"name": "auto", "policy": "rules", "default": "m"}]},
            "model route 'auto': the name is already a served model or alias",
        ),
        (
            {
                "model_routes": [
                    {"name": "a", "policy": "rules", "default": "m", "rules": [{"target": "m", "header_value": "1"}]}
                ]
            },
            "header_value needs header",
        ),
    ],
)
def test_a_route_or_alias_naming_a_missing_model_is_a_startup_error(extra, message):
    with pytest.raises(ValidationError, match=message):
        config(**extra)


def test_an_alias_or_route_may_target_a_served_lora_adapter():
    lora = {"enable_lora": True, "lora_modules": {"sql": "/adapters/sql"}}
    cfg = config(
        **lora,
        aliases={"sql-stable": "sql", "canary": {"m": 1, "sql": 1}},
        model_routes=[
            {"name": "auto", "policy": "rules", "default": "m", "rules": [{"target": "sql", "header": "X-Sql"}]}
        ],
    )
    assert alias_weights(cfg.aliases["canary"]) == {"m": 1, "sql": 1}
    with pytest.raises(ValidationError, match="alias 'sql' is already a served model's name"):
        config(**lora, aliases={"sql": "m"})
    # Without LoRA served the adapter name is no model.
    with pytest.raises(ValidationError, match="alias 'sql-stable' names model 'sql', which is not served"):
        config(aliases={"sql-stable": "sql"})
