"""Aliases and model routes (virtual models): which served model answers a name, validated.

ServeConfig nests them as `aliases` and `model_routes`, so the CLI flags, the YAML file and
the Helm schema derive from them. An alias maps a served name to one model, or splits its
traffic by weight (canary, A/B). A model route is a virtual model (e.g. `auto`) whose policy
picks a model per request: `rules` (prompt length, max_tokens, tenant, a header, structured
output or tools), `cascade` (the small model first; the large one when the small model's own
confidence over its first tokens is below a threshold) or `scorer` (a pluggable
`RouteScorer`, e.g. a trained RouteLLM-style classifier, by import path). It is configuration,
imported by `cluster/config.py`, so it imports nothing of the service (no torch).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

RoutePolicy = Literal["rules", "cascade", "scorer"]
# A served, alias or route name, as clients send it in `model`.
NAME_PATTERN = r"^[A-Za-z0-9_.:/-]+$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class RouteRule(_Strict):
    """One rule of a `rules` route: every condition it sets must hold (unset ones match
    anything); the first rule that matches picks its target."""

    target: str = Field(min_length=1)
    """The served model this rule sends the request to."""
    min_prompt_tokens: int | None = Field(None, ge=0)
    """Matches prompts of at least this many tokens."""
    max_prompt_tokens: int | None = Field(None, ge=0)
    """Matches prompts of at most this many tokens."""
    min_max_tokens: int | None = Field(None, ge=1)
    """Matches requests whose max_tokens is at least this."""
    max_max_tokens: int | None = Field(None, ge=1)
    """Matches requests whose max_tokens is at most this."""
    tenants: list[str] = Field(default_factory=list)
    """Matches requests of these tenants (by name); empty: any tenant."""
    header: str | None = None
    """Matches requests carrying this HTTP header (gRPC metadata key), e.g. x-splitserve-tier."""
    header_value: str | None = None
    """...with this value (unset: any value)."""
    structured_output: bool | None = None
    """true: matches requests with a structured-output constraint; false: without one."""
    tools: bool | None = None
    """true: matches chat requests that declare tools; false: requests without tools."""

    @model_validator(mode="after")
    def _check(self) -> RouteRule:
        if self.header_value is not None and self.header is None:
            raise ValueError("header_value needs header")
        if self.header is not None:
            self.header = self.header.lower()  # HTTP header names are case-insensitive
        return self


class CascadeConfig(_Strict):
    """The small model answers first; its first `window_tokens` tokens are held back, and if
    their confidence (the geometric mean of the small model's own token probabilities) is
    below `threshold` the small request is aborted and the large model answers instead."""

    small: str = Field(min_length=1)
    """The served model that answers first."""
    large: str = Field(min_length=1)
    """The served model escalated to."""
    window_tokens: int = Field(8, ge=1, le=256)
    """Tokens of the small model's answer the confidence is measured over (and held back)."""
    threshold: float = Field(0.5, ge=0, le=1)
    """Escalate when the confidence is below this (`splitserve calibrate-route` picks it)."""

    @model_validator(mode="after")
    def _check(self) -> CascadeConfig:
        if self.small == self.large:
            raise ValueError(f"cascade: small and large are both {self.small!r}")
        return self


class ScorerConfig(_Strict):
    """A RouteScorer scores each request in [0, 1] ("needs the large model"); at or above
    `threshold` it goes to `large`, else to `small`."""

    scorer: str = "length"
    """Built-in `length` (prompt length and hard-task keywords), or a RouteScorer subclass by import path `package.module:Class`."""
    options: dict[str, float | str | list[str]] = Field(default_factory=dict)
    """Keyword arguments of the scorer's constructor."""
    small: str = Field(min_length=1)
    """The served model for requests scored below the threshold."""
    large: str = Field(min_length=1)
    """The served model for requests scored at or above it."""
    threshold: float = Field(0.5, ge=0, le=1)
    """Requests scored at or above this go to the large model."""


class ModelRouteConfig(_Strict):
    """A virtual model: clients send its `name` as `model`; its policy picks a served model."""

    name: str = Field(min_length=1, max_length=128, pattern=NAME_PATTERN)
    """The model id clients send, e.g. auto."""
    policy: RoutePolicy
    """rules, cascade or scorer (then the section of that name is required)."""
    rules: list[RouteRule] = Field(default_factory=list)
    """rules policy: tried in order; the first match picks the model."""
    default: str | None = None
    """rules policy: the model when no rule matches."""
    cascade: CascadeConfig | None = None
    """cascade policy: its small and large models, window and threshold."""
    scorer: ScorerConfig | None = None
    """scorer policy: the scorer, its models and threshold."""

    @model_validator(mode="after")
    def _check_policy(self) -> ModelRouteConfig:
        if self.policy == "rules" and self.default is None:
            raise ValueError(f"model route {self.name!r}: a rules route needs a default model")
        if self.policy == "cascade" and self.cascade is None:
            raise ValueError(f"model route {self.name!r}: policy cascade needs a cascade section")
        if self.policy == "scorer" and self.scorer is None:
            raise ValueError(f"model route {self.name!r}: policy scorer needs a scorer section")
        return self

    def targets(self) -> list[str]:
        """Every served model this route may send a request to."""
        if self.policy == "rules":
            return [rule.target for rule in self.rules] + [self.default or ""]
        section = self.cascade if self.policy == "cascade" else self.scorer
        assert section is not None
        return [section.small, section.large]


AliasTarget = str | dict[str, float]


def alias_weights(target: AliasTarget) -> dict[str, float]:
    """An alias's targets with their weights ({model: 1.0} for a plain alias)."""
    return {target: 1.0} if isinstance(target, str) else dict(target)


def check_model_routes(served: set[str], aliases: dict[str, AliasTarget], routes: list[ModelRouteConfig]) -> None:
    """ValueError naming the alias or route and the model when a target is not served, or
    when a name is taken twice (by a model, an alias or a route)."""
    for name, target in aliases.items():
        weights = alias_weights(target)
        if not weights:
            raise ValueError(f"alias {name!r} names no model")
        for model, weight in weights.items():
            if not weight > 0:
                raise ValueError(f"alias {name!r}: the weight of {model!r} must be > 0, got {weight!r}")
            if model not in served:
                raise ValueError(
                    f"alias {name!r} names model {model!r}, which is not served (served: {sorted(served)})"
                )
    taken = set(served)
    for name in aliases:
        if name in taken:
            raise ValueError(f"alias {name!r} is already a served model's name")
        taken.add(name)
    for route in routes:
        if route.name in taken:
            raise ValueError(f"model route {route.name!r}: the name is already a served model or alias")
        taken.add(route.name)
        for model in route.targets():
            if model not in served:
                raise ValueError(
                    f"model route {route.name!r} names model {model!r}, which is not served (served: {sorted(served)})"
                )
