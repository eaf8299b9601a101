"""`serve` without --model: a trained checkpoint from the model cache, made once."""

from __future__ import annotations

import json

import pytest

from splitserve.cluster import default_model
from splitserve.engine.builtin_models import model_cache
from splitserve.engine.builtin_models.make_model import TRAINING_FILE, ModelSpec


@pytest.fixture
def tiny_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv(model_cache.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(default_model, "DEFAULT_SPEC", ModelSpec("tiny", "llama", seed=0, train_steps=2))
    return tmp_path


def test_the_default_is_trained_once_and_then_cached(tiny_defaults, monkeypatch, capsys):
    assert default_model.DEFAULT_TRAIN_STEPS > 0  # the real default is a trained model
    assert default_model.resolve_model("/some/model") == "/some/model"
    path = default_model.resolve_model(None)
    assert path.startswith(str(tiny_defaults)) and path.endswith("tiny-llama-trained2")
    assert path == str(default_model.default_model_dir())
    assert len(json.loads((default_model.default_model_dir() / TRAINING_FILE).read_text())["losses"]) == 2
    assert "training the default model" in capsys.readouterr().err

    def must_not_write(*args, **kwargs):
        raise AssertionError("the cached default must not be made again")

    monkeypatch.setattr("splitserve.engine.builtin_models.make_model.write_checkpoint", must_not_write)
    assert default_model.resolve_model(None) == path
    assert capsys.readouterr().err == ""
