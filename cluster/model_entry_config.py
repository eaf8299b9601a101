"""ModelEntryConfig: one model of a deployment that serves several (ServeConfig.models).

Each entry takes the settings a single model has: its weights, served name, context length,
dtype, quantization, host KV tier, engine, prefill and decode pools (replicas, resources, KV
cache, autoscaling) and speculative decoding. What an entry leaves unset it inherits from the
top-level ServeConfig field of the same name; inside `prefill`, `decode` and `speculative`
only the keys the entry names override the top level's (deep merge; a dict of custom
resources is replaced whole). The served name is the
one thing never inherited: it is the entry's own (`served_model_name`, else its `model`).

The partial pool settings dump as given (only the keys set), so a config that travels as a
dict (build_app's args, the Helm values) means the same after the round trip.
"""

from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel, Field, field_serializer

from splitserve.cluster.pool_config import DecodePoolConfig, PrefillPoolConfig, StrictConfig
from splitserve.engine.config import Dtype, EngineKind, Quantization
from splitserve.engine.speculative.speculative_config import SpeculativeConfig

# Fields of an entry that override ServeConfig's fields of the same name when set.
INHERITED = (
    "model",
    "max_model_len",
    "dtype",
    "quantization",
    "kv_offloading_size",
    "engine",
    "engine_profile",
    "prefill",
    "decode",
    "speculative",
)


class ModelEntryConfig(StrictConfig):
    model: str | None = None
    """Checkpoint directory of this model; unset: the top-level `model`."""
    served_model_name: str | None = None
    """Model id clients send for this model; unset: its `model` exactly as given (never inherited)."""
    max_model_len: int | None = Field(None, ge=1)
    """Context length of this model; unset: the top-level value."""
    dtype: Dtype | None = None
    """Weights and KV-cache dtype of this model; unset: the top-level value."""
    quantization: Quantization | None = None
    """Weight quantization of this model; unset: the top-level value."""
    kv_offloading_size: float | None = Field(None, ge=0)
    """GiB of host KV tier per replica of this model; unset: the top-level value."""
    engine: EngineKind | None = None
    """Engine of this model's pools (real or simulated); unset: the top-level value."""
    engine_profile: str | None = None
    """Step-time profile of this model's simulated engines; unset: the top-level value."""
    prefill: PrefillPoolConfig | None = None
    """This model's prefill pool: the keys given override the top-level `prefill` (e.g. its
    resources, so its replicas land on their own GPU type)."""
    decode: DecodePoolConfig | None = None
    """This model's decode pool: the keys given override the top-level `decode`."""
    speculative: SpeculativeConfig | None = None
    """This model's speculative decoding: the keys given override the top-level `speculative`."""

    @field_serializer("prefill", "decode", "speculative")
    def _only_given(self, value: Any) -> dict | None:
        return None if value is None else value.model_dump(exclude_unset=True)

    def overrides(self) -> dict[str, Any]:
        """{field: value} of what this entry sets, nested settings as their given keys only."""
        given = self.model_dump(exclude_unset=True, exclude_none=True)
        return {k: v for k, v in given.items() if k in INHERITED}

    def served_name(self, default_model: str) -> str:
        """The id clients send for this entry; default_model: the top-level model id."""
        return self.served_model_name or self.model or default_model


def deep_merge(base: dict[str, Any], over: dict[str, Any], model: type[BaseModel]) -> dict[str, Any]:
    """base with over's keys replacing its own; a field that is itself a settings model (a pool,
    its resources, its autoscaling) is merged key by key, any other value (a dict of custom
    resources included) is replaced whole."""
    merged = dict(base)
    for key, value in over.items():
        field = model.model_fields.get(key)
        nested = _settings_model(field.annotation) if field is not None else None
        if nested is not None and isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value, nested)
        else:
            merged[key] = value
    return merged


def _settings_model(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel class of a field's annotation (X or X | None), else None."""
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def check_unique_served_names(names: list[str]) -> list[str]:
    """Two models served under one name could never both be reached: a config error."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"models: two models are served as {name!r}; give each a distinct served_model_name")
        seen.add(name)
    return names
