"""`splitserve serve`'s command line with several models: repeated --model / --served-model-name
make a models list, duplicate served names are one-line errors, and serve resolves every
model's checkpoint (no Ray here)."""

from __future__ import annotations

import os

import pytest

from splitserve.cluster.cli.main import build_parser
from splitserve.cluster.cli.serve_flags import config_from_args
from splitserve.cluster.config import ServeConfig


def parse(*argv: str) -> ServeConfig:
    return config_from_args(build_parser().parse_args(["serve", *argv]), environ={})


def test_repeated_model_flags_make_a_models_list_paired_by_position():
    cfg = parse("--model", "/m/small", "--model", "/m/large", "--served-model-name", "small", "--decode.replicas", "2")
    assert [(e.model, e.served_model_name) for e in cfg.models] == [("/m/small", "small"), ("/m/large", None)]
    deployments = cfg.model_deployments()
    assert [name for name, _ in deployments] == ["small", "/m/large"]
    assert all(one.decode.replicas == 2 and not one.models for _, one in deployments)  # inherited
    assert parse("--model", "/m/a", "--served-model-name", "a").model_id == "a"  # once each: one model


def test_duplicate_served_names_are_one_line_errors(capsys):
    with pytest.raises(ValueError, match="two models are served as 'x'"):
        parse("--model", "/m/a", "--model", "/m/b", "--served-model-name", "x", "--served-model-name", "x")
    with pytest.raises(ValueError, match="pair each --served-model-name with a --model"):
        parse("--model", "/m/a", "--served-model-name", "x", "--served-model-name", "y")
    with pytest.raises(ValueError, match="give every model as --model"):
        parse("/m/a", "--model", "/m/b", "--model", "/m/c")
    # a served name equal to another entry's model path collides too
    with pytest.raises(ValueError, match="two models are served as '/m/a'"):
        ServeConfig.model_validate({"models": [{"model": "/m/a"}, {"model": "/m/b", "served_model_name": "/m/a"}]})


def test_serve_resolves_every_models_checkpoint_and_keeps_its_served_name(tiny_model, models_root):
    from splitserve.cluster.cli.preflight import check_model
    from splitserve.cluster.cli.serve import _with_resolved_models
    from tests.helpers.model import make_checkpoint

    other = str(make_checkpoint(models_root, "draft", "qwen2"))
    relative = os.path.relpath(other)
    cfg = parse("--model", tiny_model, "--model", relative, "--served-model-name", "alpha", "--max-model-len", "256")
    dirs = {name: check_model(one) for name, one in cfg.model_deployments()}  # preflight, per model
    resolved = _with_resolved_models(cfg, dirs)
    assert [(name, one.model) for name, one in resolved.model_deployments()] == [
        ("alpha", os.path.abspath(tiny_model)),
        (relative, os.path.abspath(other)),  # clients keep sending the name as given
    ]
