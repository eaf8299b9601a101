"""Deadline tests that hold on a quiet and on a busy machine.

The deadline must leave time for the first token (a streaming request wants tokens out before
it fires), and the work must outlast it by far however fast the machine is. So the deadline
is sized from the time to first token measured just before (deadline_for), and every decode
step is held (held_decode_steps: the engine's own hang fault, a sleep that no machine beats)
so that the work takes WORK_OVER_DEADLINE times the deadline at least.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator

import httpx
import ray

DEADLINE_OVER_TTFT = 10  # the deadline, in measured times to first token
MIN_DEADLINE_S = 0.5
WORK_OVER_DEADLINE = 30  # the least the held work takes, in deadlines


def deadline_for(first_token_s: list[float]) -> float:
    return round(max(MIN_DEADLINE_S, DEADLINE_OVER_TTFT * max(first_token_s)), 2)


@contextlib.contextmanager
def held_decode_steps(cluster, deadline_s: float, num_tokens: int) -> Iterator[float]:
    """Hold every decode step so that num_tokens take at least WORK_OVER_DEADLINE deadlines;
    yields that least time. Released on exit (the fault's other settings are off by default)."""
    step_s = WORK_OVER_DEADLINE * deadline_s / (num_tokens - 1)
    handles = [r.handle for r in cluster.decode_pool.live_replicas()]
    ray.get([h.inject_fault.remote(hang_s=step_s, hang_steps=10**9) for h in handles], timeout=10)
    try:
        yield step_s * (num_tokens - 1)  # the first token comes from prefill, unheld
    finally:
        ray.get([h.inject_fault.remote() for h in handles], timeout=10)


def http_first_token_s(http: httpx.Client, body: dict, tries: int = 3) -> list[float]:
    """Seconds to the first streamed token of short completions, as a client sees them here, now."""
    took = []
    for _ in range(tries):
        start = time.monotonic()
        with http.stream("POST", "/v1/completions", json={**body, "max_tokens": 2, "stream": True}) as stream:
            assert stream.status_code == 200
            data = (line[len("data: ") :] for line in stream.iter_lines() if line.startswith("data: "))
            assert "choices" in json.loads(next(data))
            took.append(time.monotonic() - start)
            assert list(data)[-1] == "[DONE]"
    return took
