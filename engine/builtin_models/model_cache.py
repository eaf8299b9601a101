"""Content-addressed cache of make-model checkpoints, shared by make-model, the bench and `serve`.

Layout: `$SPLITSERVE_CACHE/models/<key>/<name>/` (default root ~/.cache/splitserve), where key is
`ModelSpec.cache_key()` (preset shape, arch, seed, dtype, steps, training recipe, corpus hash)
and name is readable (`small-llama-trained300`); the served model name is the directory's name.
An entry is built in a private temp directory and renamed into place in one step, so readers
never see a half-written checkpoint and concurrent makers cannot corrupt one; an exclusive lock
per key makes a second maker wait for the first instead of training again.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from splitserve.engine.builtin_models.model_spec import ModelSpec

CACHE_ENV = "SPLITSERVE_CACHE"


@dataclass(frozen=True)
class CachedCheckpoint:
    path: Path  # the checkpoint directory (config.json, safetensors, tokenizer)
    hit: bool  # True: found in the cache; False: made by this call


def models_cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "splitserve")) / "models"


def cache_entry_path(spec: ModelSpec, root: str | Path | None = None) -> Path:
    """Where the checkpoint for spec lives (or will live) in the cache."""
    base = Path(root) if root is not None else models_cache_root()
    return base / spec.cache_key() / spec.name


def cached_checkpoint(
    spec: ModelSpec, root: str | Path | None = None, num_threads: int = 1, on_step=None
) -> CachedCheckpoint:
    """The cached checkpoint for spec, made (and trained, when spec.train_steps > 0) if missing."""
    from splitserve.engine.builtin_models.make_model import write_checkpoint

    path = cache_entry_path(spec, root)
    if (path / "config.json").is_file():
        return CachedCheckpoint(path, hit=True)
    entry = path.parent
    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(entry.parent / f".{entry.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by the OS if this process dies
        if (path / "config.json").is_file():  # made while we waited for the lock
            return CachedCheckpoint(path, hit=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.tmp-", dir=entry.parent))
        try:
            write_checkpoint(spec, staging / spec.name, num_threads=num_threads, on_step=on_step)
            try:
                staging.rename(entry)
            except OSError:
                # Someone without the lock (another filesystem's semantics) got there first.
                if not (path / "config.json").is_file():
                    raise
                return CachedCheckpoint(path, hit=True)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return CachedCheckpoint(path, hit=False)
