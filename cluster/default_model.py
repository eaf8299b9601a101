"""The model `splitserve serve` uses when none is given: the `small` preset, briefly trained, made once.

Training it (DEFAULT_SPEC.train_steps AdamW steps on the built-in corpus, see
bench/results/trained_model.md for the cost) makes the demo answer in corpus-like text instead
of random tokens. It lives in the content-addressed model cache (engine/builtin_models/model_cache.py),
so `make serve`, make-model and the benches pay for it once per machine.
"""

from __future__ import annotations

import sys
from pathlib import Path

from splitserve.engine.builtin_models.model_spec import ModelSpec

DEFAULT_TRAIN_STEPS = 300
DEFAULT_SPEC = ModelSpec(preset="small", arch="llama", seed=0, train_steps=DEFAULT_TRAIN_STEPS)


def default_model_spec() -> ModelSpec:
    """DEFAULT_SPEC (read at call time: tests swap in a smaller one). It trains in transformers'
    model classes, which every install has (a dependency, since the default must be trained)."""
    return DEFAULT_SPEC


# Its directory's name, and the model id clients send when serve is given no model.
DEFAULT_MODEL_NAME = default_model_spec().name


def default_model_dir() -> Path:
    from splitserve.engine.builtin_models.model_cache import cache_entry_path

    return cache_entry_path(default_model_spec())


def resolve_model(model: str | None) -> str:
    """Return a checkpoint directory: the given one, or the cached default (made if missing)."""
    if model:
        return model
    from splitserve.engine.builtin_models.make_model import progress_printer
    from splitserve.engine.builtin_models.model_cache import cached_checkpoint

    spec = default_model_spec()
    if not (default_model_dir() / "config.json").is_file():
        print(
            f"splitserve: training the default model ({spec.name}, {spec.train_steps} steps on CPU), "
            "once per machine; it is cached for later runs",
            file=sys.stderr,
            flush=True,
        )
    return str(cached_checkpoint(spec, on_step=progress_printer(spec.train_steps)).path)
