"""SpeculativeConfig: how an engine speculates, validated on construction (pydantic).

One definition for every surface: the engine reads it (EngineConfig.speculative), ServeConfig
nests it as `speculative` (so `splitserve serve --speculative.method ngram`, the YAML file and
the Helm values schema all derive from it), and `splitserve generate` builds the same flags
from it. Each field's docstring is its help text. Torch-free.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

SpeculativeMethod = Literal["none", "ngram", "draft"]
SPECULATIVE_METHODS: tuple[str, ...] = get_args(SpeculativeMethod)
SpeculativePolicy = Literal["adaptive", "fixed"]


class SpeculativeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    method: SpeculativeMethod = "none"
    """Speculative decoding in the decode pool: none, ngram (prompt lookup) or draft (a smaller model)."""
    num_speculative_tokens: int = Field(8, ge=1, le=32)
    """Most tokens proposed per sequence per step (the policy picks k up to this)."""
    draft_model: str | None = None
    """method=draft: checkpoint directory of the draft model (same tokenizer as the served model); ignored otherwise."""
    prompt_lookup_min: int = Field(2, ge=1)
    """method=ngram: shortest suffix (in tokens) matched against the prompt and output so far."""
    prompt_lookup_max: int = Field(4, ge=1)
    """method=ngram: longest suffix matched (the longest match wins)."""
    policy: SpeculativePolicy = "adaptive"
    """adaptive: k per step from batch size, measured acceptance and measured step costs (off when it
    would not pay); fixed: always num_speculative_tokens."""

    @model_validator(mode="after")
    def _check(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative method 'draft' needs draft_model (a checkpoint directory)")
        return self

    @property
    def enabled(self) -> bool:
        return self.method != "none"
