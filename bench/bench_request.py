"""BenchRequest: one request a workload asks the benchmark client to send."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


class WorkloadError(ValueError):
    """A workload, trace or load description that cannot produce valid requests."""


@dataclass(frozen=True)
class BenchRequest:
    """A prompt (token ids, optionally rendered as text), an output length and when to send it.

    `arrival_offset_s` is seconds after the run starts (open-loop); closed-loop runs ignore it.
    `depends_on` names the request that must finish before this one is sent (the previous turn
    of a conversation), so a multi-turn prompt reaches the server after its history did.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    arrival_offset_s: float = 0.0
    group_id: str | None = None
    conversation_id: str | None = None
    turn_index: int = 0
    depends_on: str | None = None
    prompt_text: str | None = None

    def __post_init__(self) -> None:
        if not self.request_id:
            raise WorkloadError("request_id must be non-empty")
        if len(self.prompt_token_ids) == 0:
            raise WorkloadError(f"{self.request_id}: prompt_token_ids must be non-empty")
        if self.max_tokens < 1:
            raise WorkloadError(f"{self.request_id}: max_tokens must be >= 1, got {self.max_tokens}")
        if self.arrival_offset_s < 0:
            raise WorkloadError(f"{self.request_id}: arrival_offset_s must be >= 0, got {self.arrival_offset_s}")
        if self.turn_index < 0:
            raise WorkloadError(f"{self.request_id}: turn_index must be >= 0")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def with_arrival(self, arrival_offset_s: float) -> BenchRequest:
        return dataclasses.replace(self, arrival_offset_s=arrival_offset_s)

    def with_text(self, prompt_text: str) -> BenchRequest:
        return dataclasses.replace(self, prompt_text=prompt_text)

    def to_dict(self, include_tokens: bool = False) -> dict[str, Any]:
        """JSON-friendly summary; token ids only on request since they dominate the size."""
        out: dict[str, Any] = {
            "request_id": self.request_id,
            "num_prompt_tokens": self.num_prompt_tokens,
            "max_tokens": self.max_tokens,
            "arrival_offset_s": self.arrival_offset_s,
            "group_id": self.group_id,
            "conversation_id": self.conversation_id,
            "turn_index": self.turn_index,
            "depends_on": self.depends_on,
        }
        if include_tokens:
            out["prompt_token_ids"] = list(self.prompt_token_ids)
        return out
