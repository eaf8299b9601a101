"""The model `splitserve serve` uses when none is given: the `small` preset, made once."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_PRESET = "small"
DEFAULT_MODEL_NAME = f"{DEFAULT_PRESET}-llama"  # its directory's name, and its model id


def default_model_dir() -> Path:
    root = Path(os.environ.get("SPLITSERVE_CACHE", Path.home() / ".cache" / "splitserve"))
    return root / "models" / DEFAULT_MODEL_NAME


def resolve_model(model: str | None) -> str:
    """Return a checkpoint directory: the given one, or the cached default (made if missing)."""
    if model:
        return model
    path = default_model_dir()
    if not (path / "config.json").is_file():
        from splitserve.engine.testing.make_model import write_random_checkpoint

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
        write_random_checkpoint(tmp, preset=DEFAULT_PRESET, arch="llama", seed=0)
        try:
            tmp.rename(path)
        except OSError:  # another process made it first
            pass
    return str(path)
