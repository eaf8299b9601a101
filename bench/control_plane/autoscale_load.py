"""A closed-loop load driven in-process against a DisaggCluster, for the autoscaling trace
and tests: `concurrency` workers each keep one request in flight; changing `concurrency`
while it runs makes the load rise and fall. It records TTFT / ITL into sliding windows (the
autoscaler's latency source) and counts every request that failed."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable

from splitserve.cluster.routing.replica_pools import PREFILL
from splitserve.cluster.scaling.latency_window import LatencyWindow
from splitserve.proto.messages.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class ClosedLoopLoad:
    def __init__(
        self,
        cluster,
        make_prompt: Callable[[int], list[int]],
        params: SamplingParams,
        max_concurrency: int,
        latency_window_s: float = 2.0,
    ):
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        self.cluster = cluster
        self.make_prompt = make_prompt
        self.params = params
        self.max_concurrency = max_concurrency
        self.concurrency = 0
        self.ttft_window = LatencyWindow(latency_window_s)
        self.itl_window = LatencyWindow(latency_window_s)
        self.num_ok = 0
        self.num_failed = 0
        self.failures: list[str] = []
        self.finish_reasons: Counter[str] = Counter()
        self.replicas_used: Counter[str] = Counter()  # prefill and decode replica ids that served
        self._num_sent = 0
        self.num_awaiting_first_token = 0  # in flight, no token yet: queued or being prefilled
        self._workers: list[asyncio.Task] = []
        self._stopping = False

    def latency_ms(self, pool: str, since: float | None = None) -> float | None:
        """Autoscaler latency source: p90 TTFT (prefill) or ITL (decode), in ms."""
        return (self.ttft_window if pool == PREFILL else self.itl_window).percentile_ms(90, since)

    @property
    def num_inflight(self) -> int:
        return self._num_sent - self.num_ok - self.num_failed

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._workers = [loop.create_task(self._worker(slot)) for slot in range(self.max_concurrency)]

    async def stop(self, timeout_s: float = 60.0) -> None:
        """Let in-flight requests finish (up to timeout_s), then stop the workers."""
        self._stopping = True
        done, pending = await asyncio.wait(self._workers, timeout=timeout_s) if self._workers else ((), ())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if pending:
            raise TimeoutError(f"{len(pending)} load workers still busy after {timeout_s:.0f} s")

    async def _worker(self, slot: int) -> None:
        while not self._stopping:
            if slot >= self.concurrency:
                await asyncio.sleep(0.02)
                continue
            await self._one_request(self._num_sent)

    async def _one_request(self, index: int) -> None:
        self._num_sent += 1
        self.num_awaiting_first_token += 1
        start = last = time.perf_counter()
        first = True
        finish_reason = None
        try:
            async for chunk in self.cluster.generate(
                self.make_prompt(index),
                self.params,
                on_route=lambda d: self.replicas_used.update(
                    [d.decode_replica] + ([d.prefill_replica] if d.prefill_replica else [])
                ),
            ):
                now = time.perf_counter()
                if first:
                    self.ttft_window.observe(now - start)
                    self.num_awaiting_first_token -= 1
                    first = False
                elif chunk.token_ids:
                    self.itl_window.observe((now - last) / len(chunk.token_ids))
                last = now
                if chunk.finished:
                    finish_reason = chunk.finish_reason
        except Exception as exc:  # a failed request is what the tests count; keep the load going
            self.num_awaiting_first_token -= first
            self.num_failed += 1
            self.failures.append(repr(exc))
            logger.warning("request %d failed: %r", index, exc)
            return
        self.num_ok += 1
        self.finish_reasons[str(finish_reason)] += 1
