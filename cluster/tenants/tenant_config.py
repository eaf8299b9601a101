"""One tenant of a shared deployment: its API keys, rate limits, token budget, models, priority.

The field names are the configuration's public contract (YAML `tenants:`, the tenants file,
Helm values), so they stay stable. Unset limits are unlimited; negative ones are refused.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class TenantConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, hide_input_in_errors=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    """The tenant's alias: its metrics label and usage key (never a key)."""
    api_keys: list[str] = Field(default_factory=list)
    """The tenant's API keys, inline (tests, small setups)."""
    api_keys_file: str | None = None
    """A file with one API key per line (a mounted Kubernetes Secret); re-read on reload."""
    requests_per_minute: int | None = Field(None, ge=0)
    """Requests admitted per minute (429 above); unset: unlimited."""
    tokens_per_minute: int | None = Field(None, ge=0)
    """Tokens per minute: prompt (cached ones at cached_token_weight) + max_tokens reserved at admission, settled to the real count at the end."""
    max_requests_in_flight: int | None = Field(None, ge=0)
    """Requests of this tenant in flight at once per ingress replica (429 above)."""
    budget_tokens: int | None = Field(None, ge=0)
    """Tokens per budget_period (counted as tokens_per_minute is); past it: 429 insufficient_quota."""
    budget_period: Literal["day", "month"] = "month"
    """The budget's period (UTC calendar day or month)."""
    models: list[str] = Field(default_factory=lambda: ["*"])
    """Models the tenant may use; "*": all (others: 404 model_not_found)."""
    priority: int = Field(0, ge=-(2**31), lt=2**31)
    """The tenant's requests' default scheduling priority (lower runs first)."""
    max_tokens_reserved: int | None = Field(None, ge=1)
    """Reserve at most this many completion tokens per request at admission (unset: the request's max_tokens)."""
    cached_token_weight: float = Field(1.0, ge=0, le=1)
    """What one cached prompt token counts for in tokens_per_minute and budget_tokens."""

    @model_validator(mode="after")
    def _check_keys(self) -> TenantConfig:
        if not self.api_keys and not self.api_keys_file:
            raise ValueError(f"tenant {self.name!r} needs api_keys or api_keys_file")
        if any(not key.strip() for key in self.api_keys):
            raise ValueError(f"tenant {self.name!r} has an empty API key")
        return self

    def allows_model(self, model: str) -> bool:
        return "*" in self.models or model in self.models

    def __repr__(self) -> str:  # keys never reach a log line through a repr
        return f"TenantConfig(name={self.name!r})"

    __str__ = __repr__


def check_unique_names(tenants: list[TenantConfig]) -> list[TenantConfig]:
    names = [t.name for t in tenants]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"tenant names must be unique: {', '.join(duplicates)} repeat")
    return tenants
