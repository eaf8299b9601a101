"""bench/serving/migration.py's fault side: which decode replica dies and when, the decode
pool's membership over time, the check that every pool is back at baseline afterwards, and
taps on what the ingress observes of each move (its metrics keep only histogram buckets)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

from splitserve.cluster.routing.replica_pools import DECODE

# The dispatcher logs each move with the client's id (x-request-id): which streams moved.
DISPATCHER_LOG = "splitserve.cluster.ingress.dispatcher"


def pick_victim(cluster, min_age_s: float):
    """The decode replica streaming most, among those up at least min_age_s (else any)."""
    now, live = time.monotonic(), cluster.decode_pool.live_replicas()
    inflight = Counter(cluster.dispatcher.inflight.values())
    old = [r for r in live if r.ready_at is not None and now - r.ready_at >= min_age_s] or live
    return max(old, key=lambda r: inflight[r.replica_id]), inflight


async def kill_loop(cluster, kill_at: list[float], healthy_after_s: float, t0: float, kills: list[dict]) -> None:
    import ray

    for at in kill_at:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        victim, inflight = pick_victim(cluster, healthy_after_s)
        ray.kill(victim.handle)
        kills.append(
            {"at_s": time.perf_counter() - t0, "victim": victim.replica_id, "streams": inflight[victim.replica_id]}
        )


async def sample_pool(cluster, t0: float, samples: list, stop: asyncio.Event) -> None:
    while not stop.is_set():
        ids = sorted(r.replica_id for r in cluster.decode_pool.live_replicas())
        samples.append((time.perf_counter() - t0, ids))
        await asyncio.sleep(0.25)


async def pools_at_baseline(cluster, num_decode: int, timeout_s: float) -> dict:
    """Wait until the decode pool is back at num_decode and every live replica is idle with
    its whole KV pool free; returns what was found (ok False at the timeout)."""
    from splitserve.proto.messages.poll_reply import PollReply

    start = time.perf_counter()
    while True:
        states = {}
        for pool in (cluster.prefill_pool, cluster.decode_pool):
            for r in pool.live_replicas():
                states[r.replica_id] = PollReply.from_bytes(await r.handle.poll.remote())
        busy = sorted(
            rid for rid, s in states.items() if not s.is_idle or s.engine.num_free_blocks != s.engine.num_blocks
        )
        live_decode = {r.replica_id for r in cluster.decode_pool.live_replicas()}
        stale = sorted(set(cluster.router.replica_ids(DECODE)) - live_decode)
        ok = not busy and not stale and len(live_decode) == num_decode
        if ok or time.perf_counter() - start > timeout_s:
            host = {rid: (s.engine.host_stored_blocks, s.engine.host_loaded_blocks) for rid, s in states.items()}
            return {
                "ok": ok,
                "after_s": time.perf_counter() - start,
                "busy": busy,
                "stale_routed": stale,
                "live_decode": len(live_decode),
                "host_stored_loaded_blocks": host,
            }
        await asyncio.sleep(0.5)


class MoveTap:
    """Passes the ingress's migration observations on to its metrics, keeping each value: the
    histograms keep only buckets, the benchmark wants percentiles."""

    def __init__(self, metrics):
        self.metrics = metrics
        self.moves: list[tuple[str, int]] = []  # (reason, output tokens carried)
        self.refusals: list[str] = []
        self.gap_s: list[float] = []
        self.recomputed_tokens: list[int] = []

    def moved(self, pool: str, reason: str, num_tokens: int) -> None:
        self.moves.append((reason, num_tokens))
        self.metrics.moved(pool, reason, num_tokens)

    def refused(self, reason: str) -> None:
        self.refusals.append(reason)
        self.metrics.refused(reason)

    def gap(self, seconds: float) -> None:
        self.gap_s.append(seconds)
        self.metrics.gap(seconds)

    def recomputed(self, num_tokens: int) -> None:
        self.recomputed_tokens.append(num_tokens)
        self.metrics.recomputed(num_tokens)


class MovedLabels(logging.Handler):
    """The client ids (x-request-id) of the streams the dispatcher moved, and when
    (perf_counter), from its log line: written as it re-submits the continuation."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.moves: list[tuple[str, float]] = []

    @property
    def labels(self) -> set[str]:
        return {label for label, _ in self.moves}

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.args, tuple) and record.msg.startswith("moving ") and len(record.args) >= 2:
            self.moves.append((str(record.args[1]), time.perf_counter()))
