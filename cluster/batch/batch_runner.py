"""The batch runner: runs every unfinished batch job to an end, in whichever ingress replica
holds the `batch-runner` lease in the state store.

Every replica runs one; the lease holder works, the others wait to take over. A holder that
dies (its replica killed, `splitserve serve` stopped) stops renewing, and the next holder
resumes every unfinished job from the store: lines with a stored result are done, the rest
run (again). A result is stored once per custom_id (the store's primary key), so a line run
twice -- its first runner died after the request -- still appears exactly once in the output
or error file. Concurrency adapts to spare capacity: +1 line per success up to
`batch.max_concurrency`, halved whenever the cluster refuses a line for lack of headroom.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable

from splitserve.cluster.batch.batch_metrics import BatchMetrics
from splitserve.cluster.batch.line_executor import retry_later
from splitserve.cluster.batch.openai_objects import new_file_id, result_line
from splitserve.cluster.config import BatchConfig
from splitserve.cluster.state.batch_store import BatchStore
from splitserve.cluster.state.records import (
    CANCELLED,
    CANCELLING,
    COMPLETED,
    EXPIRED,
    FINALIZING,
    IN_PROGRESS,
    VALIDATING,
    BatchLine,
    BatchRecord,
    FileRecord,
    LineResult,
)

logger = logging.getLogger(__name__)
LEASE = "batch-runner"
RETENTION_EVERY_S = 60.0
# Runs one line of the batch as the batch's owner (line_executor.LineExecutor.run).
Execute = Callable[[BatchRecord, BatchLine], Awaitable[LineResult]]


class BatchRunner:
    def __init__(
        self, store: BatchStore, cfg: BatchConfig, execute: Execute, holder: str, metrics: BatchMetrics | None
    ):
        self.store, self.cfg, self.execute, self.holder, self.metrics = store, cfg, execute, holder, metrics
        self.window = 1.0  # lines allowed in flight now (AIMD)
        self.inflight: dict[tuple[str, str], asyncio.Task] = {}  # (batch id, custom_id) -> task
        self.holding = False
        self._stopped = asyncio.Event()
        # Set when there is work to look at now (a batch created or cancelled in this replica, a
        # line done): the runner looks at once, so poll_interval_s only paces what other
        # replicas change, expiry and the lease's renewal, and an idle runner rarely wakes.
        self._wake = asyncio.Event()
        self._last_retention = 0.0

    async def run(self) -> None:
        """Until stop(): take or renew the lease, then move every unfinished batch on."""
        while not self._stopped.is_set():
            try:
                await self.step()
            except Exception:
                logger.exception("batch runner pass failed; retrying")
            await self._sleep(self.cfg.poll_interval_s)

    async def _sleep(self, seconds: float) -> None:
        """Until stop(), wake() or seconds pass."""
        if self._wake.is_set():
            self._wake.clear()
            return
        waits = [asyncio.ensure_future(self._stopped.wait()), asyncio.ensure_future(self._wake.wait())]
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()
        self._wake.clear()

    def wake(self) -> None:
        """Look at the store now (called on the runner's loop)."""
        self._wake.set()

    async def stop(self) -> None:
        """Abort the lines in flight and hand the lease back, so another replica resumes at once."""
        self._stopped.set()
        await self._abort(list(self.inflight))
        if self.holding:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.store.release_lease, LEASE, self.holder)
            self.holding = False

    async def step(self) -> None:
        held = await asyncio.to_thread(self.store.acquire_lease, LEASE, self.holder, self.cfg.lease_s, time.time())
        if held and not self.holding:
            logger.info("batch runner lease taken by %s", self.holder)
        if not held:
            if self.holding:
                logger.warning("batch runner lease lost by %s; its lines in flight are aborted", self.holder)
                await self._abort(list(self.inflight))
            self.holding = False
            return
        self.holding = True
        now = time.time()
        for batch in await asyncio.to_thread(self.store.unfinished_batches):
            await self._advance(batch, now)
        if now - self._last_retention > RETENTION_EVERY_S:
            self._last_retention = now
            await self._apply_retention(now)
        if self.metrics:
            self.metrics.concurrency.set(self._limit())
            self.metrics.set_jobs(await asyncio.to_thread(self.store.count_batches))

    async def _advance(self, batch: BatchRecord, now: float) -> None:
        if batch.status == VALIDATING:  # the lines were checked when the batch was created
            await asyncio.to_thread(self.store.transition, batch.id, (VALIDATING,), IN_PROGRESS, int(now))
            self.wake()  # its lines start on the next pass, now
        elif batch.status == IN_PROGRESS and now >= batch.expires_at:
            await self._abort([k for k in self.inflight if k[0] == batch.id])
            await self._close_unrun(batch, "batch_expired", "the batch expired before this request ran")
            await self._finish(batch, (IN_PROGRESS,), EXPIRED, now)
        elif batch.status == IN_PROGRESS:
            await self._start_lines(batch, now)
        elif batch.status == CANCELLING:
            await self._abort([k for k in self.inflight if k[0] == batch.id])
            await self._close_unrun(batch, "batch_cancelled", "the batch was cancelled before this request ran")
            await self._finish(batch, (CANCELLING,), CANCELLED, now)
        elif batch.status == FINALIZING:
            await self._finish(batch, (FINALIZING,), COMPLETED, now)

    async def _start_lines(self, batch: BatchRecord, now: float) -> None:
        free = self._limit() - len(self.inflight)
        running = frozenset(cid for bid, cid in self.inflight if bid == batch.id)
        if free <= 0:
            return
        lines = await asyncio.to_thread(self.store.pending_lines, batch.id, free, running)
        if not lines and not running:
            await asyncio.to_thread(self.store.transition, batch.id, (IN_PROGRESS,), FINALIZING, int(now))
            self.wake()  # its files are written on the next pass, now
            return
        for line in lines:
            key = (batch.id, line.custom_id)
            task = asyncio.get_running_loop().create_task(self._run_line(batch, line))
            self.inflight[key] = task
            task.add_done_callback(lambda _t, key=key: self._line_done(key))

    def _line_done(self, key: tuple[str, str]) -> None:
        self.inflight.pop(key, None)
        self.wake()  # its slot is free, or its batch may be finished

    async def _run_line(self, batch: BatchRecord, line: BatchLine) -> None:
        try:
            result = await self.execute(batch, line)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("batch %s line %r failed to run; it runs again later", batch.id, line.custom_id)
            self._shrink()
            return
        if retry_later(result):
            self._shrink()
            if self.metrics:
                self.metrics.line_retries.inc()
            return
        stored = await asyncio.to_thread(self.store.record_result, batch.id, result)
        self.window = min(float(self.cfg.max_concurrency), self.window + 1.0)
        if stored and self.metrics:
            self.metrics.lines.labels("completed" if result.ok else "failed").inc()
            self.metrics.tokens.inc(result.completion_tokens)

    def _limit(self) -> int:
        return max(1, min(self.cfg.max_concurrency, int(self.window)))

    def _shrink(self) -> None:
        self.window = max(1.0, self.window / 2)

    async def _abort(self, keys: list[tuple[str, str]]) -> None:
        """Cancel these lines' requests (their blocks are freed as for a client that left)."""
        tasks = [self.inflight[k] for k in keys if k in self.inflight]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _close_unrun(self, batch: BatchRecord, code: str, message: str) -> None:
        """Give every line that has no result an error result, so each custom_id ends up in a file."""
        pending = await asyncio.to_thread(self.store.pending_lines, batch.id, batch.total)
        results = [
            LineResult(x.custom_id, x.line_no, False, 0, f"{batch.id}-{x.line_no}", {"code": code, "message": message})
            for x in pending
        ]
        if results:
            new = await asyncio.to_thread(self.store.record_results, batch.id, results)
            if self.metrics:
                self.metrics.lines.labels("failed").inc(new)

    async def _finish(self, batch: BatchRecord, from_statuses: tuple[str, ...], to_status: str, now: float) -> None:
        """Write the output and error files (one line per custom_id, in input order) and the final status."""
        results = await asyncio.to_thread(self.store.results, batch.id)
        created = int(now)
        expires = batch.created_at + int(self.cfg.retention_s)
        output = _result_file(f"{batch.id}_output.jsonl", [r for r in results if r.ok], created, expires, batch.owner)
        error = _result_file(f"{batch.id}_error.jsonl", [r for r in results if not r.ok], created, expires, batch.owner)
        finished = await asyncio.to_thread(
            self.store.finish_batch, batch.id, from_statuses, to_status, created, output, error
        )
        if finished:
            logger.info("batch %s %s: %d results", batch.id, to_status, len(results))

    async def _apply_retention(self, now: float) -> None:
        for batch_id in await asyncio.to_thread(self.store.finished_batches_before, int(now - self.cfg.retention_s)):
            await asyncio.to_thread(self.store.delete_batch, batch_id, True)
            logger.info("batch %s and its files deleted by the retention policy", batch_id)


def _result_file(
    name: str, results: list[LineResult], created: int, expires: int, owner: str
) -> tuple[FileRecord, bytes] | None:
    """An output or error file, the batch owner's as the batch is."""
    if not results:
        return None
    content = "".join(json.dumps(result_line(r), separators=(",", ":")) + "\n" for r in results).encode()
    return FileRecord(new_file_id(), "batch_output", name, len(content), created, expires, owner), content
