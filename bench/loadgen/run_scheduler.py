"""RunScheduler: dispatches one run's requests and collects what the client observed."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import TYPE_CHECKING

import httpx

from splitserve.bench import require_extra
from splitserve.bench.loadgen.records import BenchRequest, LoadPoint, RequestRecord, RunResult

tqdm = require_extra("tqdm").tqdm

if TYPE_CHECKING:  # the client imports this module; the reverse import is for types only
    from splitserve.bench.loadgen.client import BenchClient


class RunScheduler:
    """One run: offers requests open-loop (at their arrival offsets, optionally capped) or
    closed-loop (a fixed number of workers), honours turn dependencies and the wall-time bound,
    and collects the records."""

    def __init__(
        self, client: BenchClient, http: httpx.AsyncClient, model: str, requests: list[BenchRequest], load: LoadPoint
    ) -> None:
        self.client, self.http, self.model, self.requests, self.load = client, http, model, requests, load
        self.records: list[RequestRecord] = []
        self.finished = {request.request_id: asyncio.Event() for request in requests}
        self.max_offset_s = max((r.arrival_offset_s for r in requests), default=0.0)
        self.start = time.perf_counter()

    def clock(self) -> float:
        return time.perf_counter() - self.start

    async def execute(self, config_name: str) -> RunResult:
        options = self.client.options
        self.progress = tqdm(
            total=len(self.requests),
            desc=f"{config_name} {self.load.label}",
            unit="req",
            disable=not options.show_progress,
            leave=False,
        )
        started_at = time.time()
        self.start = time.perf_counter()
        if self.load.mode == "closed-loop":
            queue = deque(self.requests)
            tasks = [
                asyncio.create_task(self._worker(queue)) for _ in range(min(self.load.concurrency, len(self.requests)))
            ]
        else:
            cap = asyncio.Semaphore(self.load.concurrency or max(1, len(self.requests)))
            tasks = [asyncio.create_task(self._arrive(request, cap)) for request in self.requests]
        try:
            if tasks:
                done, pending = await asyncio.wait(tasks, timeout=options.max_seconds)
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                for task in done:
                    task.result()  # surfaces a bug in the runner instead of hiding it
        finally:
            self.progress.close()
        return RunResult(
            config_name=config_name,
            load=self.load,
            model=self.model,
            base_url=options.base_url,
            duration_s=self.clock(),
            records=self.records,
            num_not_sent=len(self.requests) - len(self.records),
            started_at_unix_s=started_at,
        )

    async def _worker(self, queue: deque[BenchRequest]) -> None:
        while queue:
            await self._handle(queue.popleft())

    async def _arrive(self, request: BenchRequest, cap: asyncio.Semaphore) -> None:
        delay = request.arrival_offset_s - self.clock()
        if delay > 0:
            await asyncio.sleep(delay)
        async with cap:
            await self._handle(request)

    async def _handle(self, request: BenchRequest) -> None:
        try:
            record = RequestRecord(
                request_id=request.request_id,
                num_prompt_tokens_sent=request.num_prompt_tokens,
                max_tokens=request.max_tokens,
                scheduled_time_s=request.arrival_offset_s,
                group_id=request.group_id,
                conversation_id=request.conversation_id,
            )
            dependency = self.finished.get(request.depends_on) if request.depends_on else None
            if dependency is not None:
                # The previous turn is itself bounded by the request timeout and its own history.
                bound = self.max_offset_s + (request.turn_index + 1) * self.client.options.request_timeout_s
                try:
                    await asyncio.wait_for(dependency.wait(), timeout=bound)
                except TimeoutError:
                    record.error = f"dependency_timeout: {request.depends_on} unfinished after {bound:g}s"
                    self.records.append(record)
                    return
            self.records.append(record)
            await self.client.send(self.http, self.model, request, record, self.clock)
        finally:
            self.finished[request.request_id].set()
            self.progress.update(1)
