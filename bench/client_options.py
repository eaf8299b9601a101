"""ClientOptions: how the benchmark client talks to the server and bounds a run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
PROMPT_FORMATS = ("token-ids", "text")


@dataclass(frozen=True)
class ClientOptions:
    base_url: str = DEFAULT_BASE_URL
    model: str | None = None  # None: the first id that GET /v1/models lists
    endpoint: str = "completions"
    prompt_format: str = "token-ids"  # chat always sends text
    api_key: str | None = None
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    max_requests: int | None = None
    max_seconds: float | None = None
    temperature: float = 0.0
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)
    show_progress: bool = True
    # Untimed requests sent first (short prompts unlike the workload's, so they warm connections
    # and the server's code paths but not its prefix cache).
    num_warmup_requests: int = 0

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINT_PATHS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINT_PATHS)}, got {self.endpoint!r}")
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}, got {self.prompt_format!r}")
        if not (self.request_timeout_s > 0 and self.connect_timeout_s > 0):
            raise ValueError("request and connect timeouts must be > 0")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {self.max_requests}")
        if self.num_warmup_requests < 0:
            raise ValueError(f"num_warmup_requests must be >= 0, got {self.num_warmup_requests}")
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise ValueError(f"max_seconds must be > 0, got {self.max_seconds}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")

    @property
    def sends_text(self) -> bool:
        return self.endpoint == "chat" or self.prompt_format == "text"
