"""StepTimeProfile: how long an engine step and a KV transfer take, for the simulated engine.

One formula for every step, the roofline of a transformer step (docs/ARCHITECTURE.md,
"Simulated engine", gives the derivations and sources):

    step_s = step_overhead_s
             + max(weight_read_s, new_tokens * token_compute_s)   # weights once, or compute
             + context_tokens * context_token_s                   # KV read by attention

- new_tokens: tokens computed this step (a prefill chunk's tokens plus one per decoding
  sequence); prefill is the compute-bound side of the max, decode the memory-bound side.
- context_tokens: KV positions the step's sequences attend to (the sum of their lengths).
- a KV transfer of n bytes takes kv_link.latency_s + n / kv_link.bytes_per_s.

Tensor parallelism: the four step figures above are for the profile's own
`tensor_parallel_size`; `tensor_parallel` gives the same four for other TP sizes (a replica of
that many GPUs: weights, compute and KV reads split over the ranks, two all-reduces per layer
added to the overhead). A simulated replica of TP size n steps by `for_tensor_parallel(n)`; a
size the profile has no figures for is a one-line error naming the sizes it has. The ranks
themselves do no work of their own in simulation: their time is in the step.

A profile is a YAML or JSON file; the shipped ones (profiles/*.yaml) are named by their stem:
`cpu-fitted` (measured from the real engine here by `splitserve bench profile-engine`),
`llama-8b-h200` and `llama-70b-h200` (roofline-derived).
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from splitserve.engine.config import ConfigError

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
DEFAULT_PROFILE = "cpu-fitted"


class KVLinkProfile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    bytes_per_s: float = Field(gt=0)
    """Bandwidth of one prefill -> decode KV transfer."""
    latency_s: float = Field(0.0, ge=0)
    """Fixed cost of one transfer (set-up, the first byte)."""


class StepFigures(BaseModel):
    """The step formula's four terms for one tensor-parallel size (StepTimeProfile's fields)."""

    model_config = ConfigDict(extra="forbid")

    step_overhead_s: float = Field(ge=0)
    weight_read_s: float = Field(0.0, ge=0)
    token_compute_s: float = Field(ge=0)
    context_token_s: float = Field(0.0, ge=0)


class StepTimeProfile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    description: str = ""
    """What it models, from what sources, with which formulas."""
    step_overhead_s: float = Field(ge=0)
    """Fixed cost of every step: scheduling, launches, sampling."""
    weight_read_s: float = Field(0.0, ge=0)
    """Memory floor of a step: reading the weights once (weight bytes / HBM bandwidth)."""
    token_compute_s: float = Field(ge=0)
    """Compute per new token (2 x parameters FLOPs / achieved FLOP/s)."""
    context_token_s: float = Field(0.0, ge=0)
    """KV read per attended context token (KV bytes per token / HBM bandwidth)."""
    kv_link: KVLinkProfile
    """The prefill -> decode KV link."""
    kv_bytes_per_token: int | None = Field(None, ge=1)
    """KV bytes per token of the modelled model; unset: the model directory's (config.json)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """The TP size (GPUs per replica) the step figures above are for."""
    tensor_parallel: dict[int, StepFigures] = Field(default_factory=dict)
    """The step figures of other TP sizes, by size."""

    @property
    def tensor_parallel_sizes(self) -> list[int]:
        return sorted({self.tensor_parallel_size, *self.tensor_parallel})

    def for_tensor_parallel(self, size: int) -> StepTimeProfile:
        """This profile as a replica of `size` ranks steps; ConfigError for a size it lacks."""
        if size == self.tensor_parallel_size:
            return self
        figures = self.tensor_parallel.get(size)
        if figures is None:
            sizes = ", ".join(map(str, self.tensor_parallel_sizes))
            raise ConfigError(
                f"step-time profile {self.name!r} has no figures for tensor_parallel_size {size} "
                f"(it has {sizes}); add them under `tensor_parallel:`"
            )
        return self.model_copy(update={**figures.model_dump(), "tensor_parallel_size": size})

    def step_s(self, new_tokens: int, context_tokens: int) -> float:
        compute = max(self.weight_read_s, new_tokens * self.token_compute_s)
        return self.step_overhead_s + compute + context_tokens * self.context_token_s

    def prefill_s(self, num_tokens: int) -> float:
        """One prefill step of a num_tokens prompt computed from scratch."""
        return self.step_s(num_tokens, num_tokens)

    def decode_s(self, batch_size: int, context_tokens: int) -> float:
        """One decode step of batch_size sequences holding context_tokens in all."""
        return self.step_s(batch_size, context_tokens)

    def transfer_s(self, num_bytes: int) -> float:
        return self.kv_link.latency_s + num_bytes / self.kv_link.bytes_per_s if num_bytes else 0.0

    @classmethod
    def load(cls, name_or_path: str | None = None) -> StepTimeProfile:
        """A shipped profile by name, or a YAML/JSON file; a bad one is a one-line ConfigError."""
        name_or_path = name_or_path or DEFAULT_PROFILE
        path = Path(name_or_path)
        if not path.suffix and not path.exists():
            path = PROFILE_DIR / f"{name_or_path}.yaml"
        if not path.is_file():
            shipped = ", ".join(sorted(p.stem for p in PROFILE_DIR.glob("*.yaml")))
            raise ConfigError(f"step-time profile {name_or_path!r} is neither a file nor a shipped one ({shipped})")
        try:
            return cls.model_validate(yaml.safe_load(path.read_text()))
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(part) for part in first["loc"]) or "the file"
            raise ConfigError(f"invalid step-time profile {path}: {field}: {first['msg']}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"invalid step-time profile {path}: {exc}".splitlines()[0]) from None

    def dump(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.model_dump(), sort_keys=False, width=100))

    @staticmethod
    def shipped() -> list[str]:
        return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))
