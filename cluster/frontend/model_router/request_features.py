"""RequestFeatures: what a model route may look at to pick a model, before any compute."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.proto.messages.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestFeatures:
    prompt_token_ids: list[int]  # the first prompt's (completions may send several)
    params: SamplingParams
    choices: int = 1  # generations of the request: prompts x n
    tenant: str | None = None  # the tenant's name, when tenants are configured
    headers: dict[str, str] = field(default_factory=dict)  # lower-case names (gRPC: metadata)
    tools: bool = False  # a chat request declaring tools

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def structured_output(self) -> bool:
        return self.params.structured_output is not None
