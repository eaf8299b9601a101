"""The Batch API of one ingress replica: the state store, the /v1/files and /v1/batches routes,
and the runner (which works only while this replica holds the runner lease)."""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from splitserve.cluster.batch.batch_metrics import BatchMetrics
from splitserve.cluster.batch.batch_routes import add_batch_routes
from splitserve.cluster.batch.batch_runner import BatchRunner
from splitserve.cluster.batch.file_routes import add_file_routes
from splitserve.cluster.batch.line_executor import LineExecutor
from splitserve.cluster.config import ServeConfig
from splitserve.cluster.frontend.http.caller import Callers
from splitserve.cluster.state.database import open_state_engine, state_database_url
from splitserve.cluster.state.sql_batch_store import SqlBatchStore


class BatchService:
    def __init__(self, cfg: ServeConfig, holder: str, registry: CollectorRegistry, model_name: str):
        """Opens the state store (a bad URL or unreachable database fails here, at start-up).
        holder: this replica's name in the runner lease (unique per process)."""
        self.cfg = cfg
        self.engine = open_state_engine(state_database_url(cfg.state_dir, cfg.state_url))
        self.store = SqlBatchStore(self.engine)
        self.holder = holder
        self.metrics = BatchMetrics(registry, model_name)
        self.runner: BatchRunner | None = None
        self.executor: LineExecutor | None = None
        self._task: asyncio.Task | None = None

    def install(self, app: FastAPI, auth: list, errors: dict, callers: Callers) -> None:
        """Adds the routes to app (each scoped to its caller's objects); the runner runs lines
        through app itself, each as its batch's owner."""
        add_file_routes(app, self.store, self.cfg, auth, errors, callers)
        self.executor = LineExecutor(app)
        self.runner = BatchRunner(self.store, self.cfg.batch, self.executor.run, self.holder, self.metrics)
        add_batch_routes(app, self.store, self.cfg, auth, errors, callers, on_change=self.runner.wake)

    def start(self) -> None:
        """Starts the runner on the running loop (the one that serves the app)."""
        if self.runner is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.runner.run())

    async def stop(self) -> None:
        if self._task is not None:
            await self.runner.stop()
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.executor is not None:
            await self.executor.close()
        self.engine.dispose()
