"""Runs an LLMEngine in a background thread so an asyncio actor stays responsive.

Only the loop thread touches the engine (scheduler, block pool, cache). Other threads hand it
work with call() and receive outputs through per-request sinks, called on the loop thread.
A worker that buffers what its sinks get passes `flush_outputs`: it is called once after every
step (and every batch of commands) that delivered something, so the worker hands a whole
step's outputs to its event loop in one go instead of one hand-over per token.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from splitserve.engine.core.sequence import Sequence
from splitserve.engine.io.request_output import RequestOutput
from splitserve.engine.llm_engine import LayerHookFactory, LLMEngine

logger = logging.getLogger(__name__)
Sink = Callable[[RequestOutput], None]


class EngineLoopStopped(RuntimeError):
    """The engine loop is not running (stopped or crashed)."""


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        layer_hook: LayerHookFactory | None = None,
        after_step: Callable[[LLMEngine], None] | None = None,
        idle_wait_s: float = 0.05,
        flush_outputs: Callable[[], None] | None = None,
    ):
        self.engine = engine
        self.layer_hook = layer_hook
        self.after_step = after_step
        self.idle_wait_s = idle_wait_s
        self.flush_outputs = flush_outputs
        self._delivered = False  # a sink got something since the last flush_outputs
        self._commands: queue.SimpleQueue[tuple[Callable[[LLMEngine], Any], Future]] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._wake = threading.Event()
        self._stopping = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def call(self, fn: Callable[[LLMEngine], Any]) -> Future:
        """Run fn(engine) on the loop thread between steps; the future holds its result."""
        fut: Future = Future()
        if not self.alive:
            fut.set_exception(EngineLoopStopped(f"engine loop is not running: {self._error!r}"))
            return fut
        self._commands.put((fn, fut))
        self._wake.set()
        return fut

    def add_sequence(self, seq: Sequence, sink: Sink) -> Future:
        """Queue seq (from LLMEngine.make_sequence); its outputs go to sink."""

        def add(engine: LLMEngine) -> None:
            self._sinks[seq.request_id] = sink
            engine.add_sequence(seq)

        return self.call(add)

    def admit_prefilled(
        self, request_id: str, first_token: int, first_logprob: float | None, num_cached_tokens: int, sink: Sink
    ) -> Future:
        """LLMEngine.admit_prefilled on the loop thread: its first output and every later one
        go to sink."""

        def admit(engine: LLMEngine) -> None:
            out = engine.admit_prefilled(request_id, first_token, first_logprob, num_cached_tokens)
            if not out.finished:
                self._sinks[request_id] = sink
            self._delivered = True
            sink(out)

        return self.call(admit)

    def abort(self, request_id: str) -> Future:
        def do_abort(engine: LLMEngine) -> None:
            self._sinks.pop(request_id, None)
            engine.abort(request_id)

        return self.call(do_abort)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # ---- loop thread ---------------------------------------------------------------------
    def _drain_commands(self) -> None:
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(self.engine))
            except BaseException as exc:  # handed to the caller, never kills the loop
                fut.set_exception(exc)

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_commands()
                self._flush()
                if not self.engine.has_unfinished():
                    if self.after_step is not None:
                        self.after_step(self.engine)
                    self._wake.wait(self.idle_wait_s)
                    self._wake.clear()
                    continue
                for out in self.engine.step(self.layer_hook):
                    sink = self._sinks.get(out.request_id)
                    if out.finished:
                        self._sinks.pop(out.request_id, None)
                    if sink is not None:
                        self._delivered = True
                        try:
                            sink(out)
                        except Exception:
                            logger.exception("output sink for %s failed", out.request_id)
                self._flush()
                if self.after_step is not None:
                    self.after_step(self.engine)
        except BaseException as exc:
            self._error = exc
            logger.exception("engine loop crashed")
        finally:
            self._stopping = True
            self._fail_pending()

    def _flush(self) -> None:
        if self._delivered and self.flush_outputs is not None:
            self._delivered = False
            try:
                self.flush_outputs()
            except Exception:
                logger.exception("flushing the step's outputs failed")

    def _fail_pending(self) -> None:
        err = EngineLoopStopped(f"engine loop stopped: {self._error!r}")
        while True:
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                break
            if fut.set_running_or_notify_cancel():
                fut.set_exception(err)
