"""A replica's load: the figures it reports (LoadReport, which routing and scaling both read)
and the router's bookkeeping around them (ReplicaLoad).

Replicas report load periodically (Router.update_load). Between two reports the router adds
what it just sent (`pending_*`) so a burst of requests spreads out instead of herding onto the
replica that looked idle in the last report. A report resets the pending counts.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field

from splitserve.proto.messages.poll_reply import PollReply


@dataclass(frozen=True)
class LoadReport:
    """One replica's load as it last reported it."""

    queued_prefill_tokens: int = 0  # prompt tokens waiting to be prefilled
    num_running: int = 0  # requests in the running batch
    kv_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    num_waiting: int = 0  # requests queued, not yet running
    # LoRA (0 / empty where the replica serves none): its device adapter slots, and the
    # adapters in them and in its host cache (routing/adapter_affinity.py scores them).
    lora_slots: int = 0
    device_adapters: frozenset[str] = frozenset()
    host_adapters: frozenset[str] = frozenset()
    # Measured costs (0: not measured yet), for prefill placement (prefill_placement.py): the
    # engine's prefilling step as prefill_step_seconds + prefill_seconds_per_token * tokens
    # (a prompt's tail, chunks, mixed steps: the eager forward), the same for a fresh prompt's
    # step alone (fresh_*: the CPU's scripted prefill), its decode-only step; bytes of one KV
    # block; and the KV it sent, in bytes per second of sending (prefill replicas; the mean
    # since start: TransferTotals' bytes over seconds).
    prefill_seconds_per_token: float = 0.0
    decode_step_seconds: float = 0.0
    prefill_step_seconds: float = 0.0
    fresh_prefill_seconds_per_token: float = 0.0
    fresh_prefill_step_seconds: float = 0.0
    kv_block_bytes: int = 0
    transfer_bytes_per_second: float = 0.0

    def prefill_line(self, fresh: bool) -> tuple[float, float] | None:
        """(fixed seconds per step, seconds per token) of the forward this replica runs for a
        prefill: `fresh` (one prompt with no cached prefix, alone in its step) on the fresh
        line, anything else on the other; the other line while that one is not measured yet
        (a replica that ran only fresh prompts, or only tails); None while neither is."""
        lines = [
            (self.fresh_prefill_step_seconds, self.fresh_prefill_seconds_per_token),
            (self.prefill_step_seconds, self.prefill_seconds_per_token),
        ]
        for step, per_token in lines if fresh else lines[::-1]:
            if per_token > 0:
                return step, per_token
        return None

    def __post_init__(self) -> None:
        if min(self.queued_prefill_tokens, self.num_running, self.num_waiting) < 0:
            raise ValueError("load counts must be >= 0")
        measured = (
            self.prefill_seconds_per_token,
            self.decode_step_seconds,
            self.prefill_step_seconds,
            self.fresh_prefill_seconds_per_token,
            self.fresh_prefill_step_seconds,
            self.transfer_bytes_per_second,
        )
        if min(*measured, self.kv_block_bytes) < 0:
            raise ValueError("measured costs must be >= 0")
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"kv_usage must be in [0, 1], got {self.kv_usage}")

    @classmethod
    def from_poll(cls, poll: PollReply) -> LoadReport:
        engine, transfer = poll.engine, poll.transfer
        return cls(
            queued_prefill_tokens=engine.num_waiting_tokens,
            # num_active (decode) counts every request the replica holds: running, waiting
            # and in transfer; adding num_running to it would count requests twice.
            num_running=max(engine.num_running, poll.num_active),
            kv_usage=engine.kv_usage,
            num_waiting=engine.num_waiting,
            lora_slots=engine.lora_slots,
            device_adapters=frozenset(engine.lora_device_adapters),
            host_adapters=frozenset(engine.lora_host_adapters),
            prefill_seconds_per_token=engine.prefill_seconds_per_token,
            decode_step_seconds=engine.decode_step_seconds,
            prefill_step_seconds=engine.prefill_step_seconds,
            fresh_prefill_seconds_per_token=engine.fresh_prefill_seconds_per_token,
            fresh_prefill_step_seconds=engine.fresh_prefill_step_seconds,
            kv_block_bytes=engine.kv_block_bytes,
            transfer_bytes_per_second=transfer.num_bytes / transfer.seconds if transfer.seconds > 0 else 0.0,
        )


@dataclass
class ReplicaLoad:
    replica_id: Hashable
    report: LoadReport = field(default_factory=LoadReport)
    draining: bool = False  # gets no new requests
    pending_tokens: int = 0  # tokens routed here since the last report
    pending_requests: int = 0  # requests routed here since the last report
    updated_at: float = field(default_factory=time.monotonic)
    report_epoch: int = 0  # reports received: a claim made before the last one is covered by it
    # LoRA adapters routed here since the last report: resident by the time they are served.
    routed_adapters: set[str] = field(default_factory=set)

    def update(self, report: LoadReport) -> None:
        """Replace the load with a fresh report from the replica; forget pending counts."""
        self.report = report
        self.pending_tokens = 0
        self.pending_requests = 0
        self.routed_adapters.clear()
        self.report_epoch += 1
        self.updated_at = time.monotonic()

    def add_pending(self, num_tokens: int) -> PendingClaim:
        """Account for a request just routed here until the next report, or until the
        returned claim is released, whichever comes first."""
        self.pending_tokens += num_tokens
        self.pending_requests += 1
        return PendingClaim(self, self.report_epoch, num_tokens)

    @property
    def effective_queued_tokens(self) -> int:
        return self.report.queued_prefill_tokens + self.pending_tokens

    @property
    def effective_running(self) -> int:
        """Running + routed since the report. Waiting requests are not added: their prompt
        tokens are already counted in queued_prefill_tokens."""
        return self.report.num_running + self.pending_requests


@dataclass(eq=False)
class PendingClaim:
    """One routed request's share of a replica's pending counts. Without it, requests that
    finished before the replica's next report still counted as queued and running, so a
    client sending one request after another made its cache-holding replica look busy and
    drove its prefix elsewhere."""

    load: ReplicaLoad
    epoch: int  # the load's report_epoch when the request was routed
    num_tokens: int
    released: bool = False

    def release(self) -> None:
        """The request left that queue (prefill: its first token came back; decode: it
        ended): take its share back, once. If a report arrived since, it replaced the
        pending counts and counts the request itself until the next one: nothing to undo."""
        if self.released:
            return
        self.released = True
        load = self.load
        if load.report_epoch == self.epoch:
            load.pending_tokens = max(0, load.pending_tokens - self.num_tokens)
            load.pending_requests = max(0, load.pending_requests - 1)
