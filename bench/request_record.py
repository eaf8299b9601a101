"""RequestRecord: what the client observed for one request (times are seconds since run start)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# Error value of requests still in flight when the run's wall-time bound expired; metrics leave
# them out of latency and SLO figures (their latency is unknown, not bad) and count them apart.
DEADLINE_ERROR = "deadline"


@dataclass
class RequestRecord:
    request_id: str
    num_prompt_tokens_sent: int
    max_tokens: int
    scheduled_time_s: float
    group_id: str | None = None
    conversation_id: str | None = None
    send_time_s: float | None = None
    first_token_time_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    end_time_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    status: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return (
            self.error is None
            and self.status == 200
            and self.end_time_s is not None
            and self.first_token_time_s is not None
        )

    @property
    def unfinished(self) -> bool:
        return self.error == DEADLINE_ERROR

    @property
    def error_key(self) -> str:
        """'ok', 'http_<status>' for a non-200 answer, 'deadline', or the failure's name."""
        if self.ok:
            return "ok"
        if self.status is not None and self.status != 200:
            return f"http_{self.status}"
        return (self.error or "no_tokens").split(":", 1)[0]

    @property
    def ttft_s(self) -> float | None:
        if self.send_time_s is None or self.first_token_time_s is None:
            return None
        return self.first_token_time_s - self.send_time_s

    @property
    def e2e_s(self) -> float | None:
        if self.send_time_s is None or self.end_time_s is None:
            return None
        return self.end_time_s - self.send_time_s

    @property
    def itl_gaps_s(self) -> list[float]:
        """Gaps between consecutive token-bearing chunks (one gap fewer than chunks)."""
        times = self.chunk_times_s
        return [later - earlier for earlier, later in zip(times, times[1:])]

    @property
    def num_output_tokens(self) -> int:
        """Server-reported completion tokens, else the number of token-bearing chunks."""
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunk_times_s)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["chunk_times_s"] = [round(t, 6) for t in self.chunk_times_s]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in names})
