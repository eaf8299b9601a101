"""ReplicaLoad: the router's view of one replica's load, plus what it routed there since.

Replicas report load periodically (update_load). Between two reports the router adds what
it just sent (`pending_*`) so a burst of requests spreads out instead of herding onto the
replica that looked idle in the last report. A report resets the pending counts.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field


@dataclass
class ReplicaLoad:
    replica_id: Hashable
    queued_prefill_tokens: int = 0  # prompt tokens waiting to be prefilled
    num_running: int = 0  # requests in the running batch
    num_waiting: int = 0  # requests queued, not yet running
    kv_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    draining: bool = False  # gets no new requests
    pending_tokens: int = 0  # tokens routed here since the last report
    pending_requests: int = 0  # requests routed here since the last report
    updated_at: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        if self.queued_prefill_tokens < 0 or self.num_running < 0 or self.num_waiting < 0:
            raise ValueError("load counts must be >= 0")
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"kv_usage must be in [0, 1], got {self.kv_usage}")

    def report(self, queued_prefill_tokens: int, num_running: int, kv_usage: float, num_waiting: int = 0) -> None:
        """Replace the load with a fresh report from the replica; forget pending counts."""
        old = (self.queued_prefill_tokens, self.num_running, self.kv_usage, self.num_waiting)
        self.queued_prefill_tokens = queued_prefill_tokens
        self.num_running = num_running
        self.kv_usage = kv_usage
        self.num_waiting = num_waiting
        try:
            self.check()
        except ValueError:
            (self.queued_prefill_tokens, self.num_running, self.kv_usage, self.num_waiting) = old
            raise
        self.pending_tokens = 0
        self.pending_requests = 0
        self.updated_at = time.monotonic()

    def add_pending(self, num_tokens: int) -> None:
        """Account for a request just routed here until the next report."""
        self.pending_tokens += num_tokens
        self.pending_requests += 1

    @property
    def effective_queued_tokens(self) -> int:
        return self.queued_prefill_tokens + self.pending_tokens

    @property
    def effective_running(self) -> int:
        """Running + routed since the report. Waiting requests are not added: their prompt
        tokens are already counted in queued_prefill_tokens."""
        return self.num_running + self.pending_requests
