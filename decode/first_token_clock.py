"""FirstTokenClock: where a request's first token spent its time on the decode replica, as
durations on this process's clock (the prefill replica's own are durations on its clock), so
no two machines' clocks are ever compared.

Stages (seconds; the ingress adds its own, cluster/frontend/first_token_stages.py):
- prefill_queue: the prompt waiting to be scheduled, on whichever replica prefilled it;
- prefill_compute: from first scheduled to the first token sampled;
- handoff (remote prefill only): the rest of the fetch from the prefill replica: reserving
  blocks, the prefill call's round trip, transfer setup and wire time (with an early first
  token: the push of the token instead of the transfer);
- decode_admission: making the sequence (a grammar's compile), admitting a prefilled
  sequence, and handing the first token from the engine loop to the actor's event loop.
They add up to replica_seconds, the time from the request's arrival here to its first chunk
leaving; the ingress's round trip less that is the relay's share.
"""

from __future__ import annotations

import time

from splitserve.proto.messages.handoff import PrefillResult


class FirstTokenClock:
    def __init__(self) -> None:
        self.received = time.perf_counter()
        self.set_up: float | None = None  # the sequence is made; its prefill starts
        self.prefilled: PrefillResult | None = None  # a remote prefill's result
        self.fetched: float | None = None  # ... and when it was in (KV received)
        self.first_output: float | None = None  # the engine loop produced the first token

    def mark_set_up(self) -> None:
        self.set_up = time.perf_counter()

    def mark_fetched(self, result: PrefillResult) -> None:
        """The remote prefill's first token is here (an early one, or the call's answer): the
        first that came counts."""
        if self.fetched is None:
            self.prefilled, self.fetched = result, time.perf_counter()

    def mark_first_output(self) -> None:  # the engine loop's thread
        if self.first_output is None:
            self.first_output = time.perf_counter()

    def stages(self, queue_seconds: float | None) -> tuple[dict[str, float], float]:
        """(stage -> seconds, replica_seconds) as the first chunk leaves now; queue_seconds:
        the local prefill's queue time (the engine's first output)."""
        sent = time.perf_counter()
        set_up = self.set_up if self.set_up is not None else self.received
        if self.prefilled is not None and self.fetched is not None:
            result = self.prefilled
            stages = {
                "prefill_queue": result.queue_seconds,
                "prefill_compute": max(result.prefill_seconds - result.queue_seconds, 0.0),
                "handoff": max(self.fetched - set_up - result.prefill_seconds, 0.0),
                "decode_admission": (set_up - self.received) + (sent - self.fetched),
            }
        else:
            first = self.first_output if self.first_output is not None else sent
            queue = min(queue_seconds or 0.0, first - set_up)
            stages = {
                "prefill_queue": queue,
                "prefill_compute": first - set_up - queue,
                "decode_admission": (set_up - self.received) + (sent - first),
            }
        return stages, sent - self.received
