"""BatchRunner.wake (cluster/batch/batch_runner.py) on a real SQLite store: with a poll interval
far longer than the test, a batch created in this replica (wake) still runs to `completed`,
line after line (each finished line wakes the runner), and stop() ends the runner at once.
Without the wake the runner would next look after an hour."""

from __future__ import annotations

import asyncio
import time

import pytest

from splitserve.cluster.batch.batch_runner import BatchRunner
from splitserve.cluster.config import BatchConfig
from splitserve.cluster.state.database import open_state_engine, state_database_url
from splitserve.cluster.state.records import COMPLETED, VALIDATING, BatchLine, BatchRecord, LineResult
from splitserve.cluster.state.sql_batch_store import SqlBatchStore

pytestmark = pytest.mark.timeout(120)
HOUR_S = 3600.0
SAFETY_S = 60.0  # a safety net for a broken wake, never the thing asserted


async def _completes(store: SqlBatchStore, batch_id: str) -> str:
    deadline = time.monotonic() + SAFETY_S
    while True:
        record = await asyncio.to_thread(store.get_batch, batch_id)
        if record is not None and record.status == COMPLETED or time.monotonic() > deadline:
            return record.status if record is not None else "missing"
        await asyncio.sleep(0.02)


def test_a_batch_created_here_runs_without_waiting_for_the_poll(tmp_path):
    engine = open_state_engine(state_database_url(str(tmp_path), None))
    store = SqlBatchStore(engine)
    ran: list[str] = []

    async def execute(batch: BatchRecord, line: BatchLine) -> LineResult:
        ran.append(line.custom_id)
        return LineResult(line.custom_id, line.line_no, True, 200, f"r{line.line_no}", {"i": line.line_no})

    cfg = BatchConfig(poll_interval_s=HOUR_S, max_concurrency=1)  # one line at a time: each needs a wake
    runner = BatchRunner(store, cfg, execute, "ingress-a", None)

    async def scenario() -> str:
        task = asyncio.create_task(runner.run())
        while not runner.holding:  # its first pass takes the lease, finds nothing, sleeps an hour
            await asyncio.sleep(0.01)
        now = int(time.time())
        record = BatchRecord("batch-1", "/v1/completions", "file-in", "24h", VALIDATING, now, now + 86400, 3)
        lines = [BatchLine(i, f"c{i}", {"prompt": f"p{i}", "max_tokens": 4}) for i in range(3)]
        await asyncio.to_thread(store.create_batch, record, lines)
        runner.wake()  # what the create route does (on_change)
        status = await _completes(store, "batch-1")
        await runner.stop()
        await asyncio.wait_for(task, SAFETY_S)  # stop() ends an hour's sleep at once
        return status

    try:
        assert asyncio.run(scenario()) == COMPLETED
        assert sorted(ran) == ["c0", "c1", "c2"]
    finally:
        engine.dispose()
