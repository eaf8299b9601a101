"""Runs an engine (EngineProtocol: LLMEngine or SimulatedEngine) in a background thread so an
asyncio actor stays responsive.

Only the loop thread touches the engine (scheduler, block pool, cache); with async
scheduling the engine's forward thread runs the forward passes meanwhile (engine/step_pipeline.py).
Other threads hand it work with call() and receive outputs through per-request sinks, called
on the loop thread.
A worker that buffers what its sinks get passes `flush_outputs`: it is called once after every
step (and every batch of commands) that delivered something, so the worker hands a whole
step's outputs to its event loop in one go instead of one hand-over per token.

Failures: a step that raises fails only its batch (EngineProtocol.step undoes it exactly); each of
those requests' sinks gets the EngineStepError, and the loop serves on. If the loop cannot
carry on -- `max_consecutive_step_failures` steps failed in a row, or anything raised outside
a step -- it stops for good: it aborts every request (all blocks go back to the pool), hands
each sink and each queued call an EngineLoopStopped, refuses new calls at once, and says why
in `stop_reason`. The worker then reports itself dead in its poll reply.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from splitserve.engine.core.sequence import Sequence
from splitserve.engine.engine_errors import EngineLoopStopped, EngineStepError
from splitserve.engine.engine_protocol import EngineProtocol, LayerHookFactory
from splitserve.engine.fault_injector import FaultInjector, StepFaults
from splitserve.engine.io.request_output import RequestOutput
from splitserve.proto.messages.engine_stats import EngineStats
from splitserve.proto.messages.handoff import PrefillResult
from splitserve.proto.messages.sampling_params import SamplingParams

__all__ = ["EngineLoop", "EngineLoopStopped", "EngineStepError", "Sink"]

logger = logging.getLogger(__name__)
# Gets each output of its request, or once the exception that failed it (EngineStepError,
# EngineLoopStopped); called on the loop thread, so it must only hand the item over.
Sink = Callable[[RequestOutput | Exception], None]


class EngineLoop:
    def __init__(
        self,
        engine: EngineProtocol,
        layer_hook: LayerHookFactory | None = None,
        after_step: Callable[[EngineProtocol], None] | None = None,
        idle_wait_s: float = 0.05,
        max_consecutive_step_failures: int = 3,
        name: str = "engine",
        flush_outputs: Callable[[], None] | None = None,
    ):
        if max_consecutive_step_failures < 1:
            raise ValueError(f"max_consecutive_step_failures must be >= 1, got {max_consecutive_step_failures}")
        self.engine = engine
        self.layer_hook = layer_hook
        self.after_step = after_step
        self.idle_wait_s = idle_wait_s
        self.flush_outputs = flush_outputs
        self._delivered = False  # a sink got something since the last flush_outputs
        self.max_consecutive_step_failures = max_consecutive_step_failures
        self.name = name
        self.faults = FaultInjector()
        self._commands: queue.SimpleQueue[tuple[Callable[[EngineProtocol], Any], Future]] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._wake = threading.Event()
        self._stopping = False
        # Guards _accepting against call(): a command is either queued before the loop stops
        # accepting (and then failed by it) or refused at once -- never left unanswered.
        self._lock = threading.Lock()
        self._accepting = True
        self._stopped = threading.Event()  # set once the stopped loop released everything
        self.error: BaseException | None = None  # why it stopped, if it failed
        self._final_stats: EngineStats | None = None  # the engine's stats after the release
        self.num_failed_steps = 0
        self._num_consecutive_failures = 0
        self._thread = threading.Thread(target=self._run, name=f"engine-loop-{name}", daemon=True)

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._accepting and self._thread.is_alive()

    @property
    def stop_reason(self) -> str:
        """Why the loop is not running ("" while it is)."""
        return "" if self.alive else str(self._stopped_error())

    def wait_stopped(self, timeout_s: float) -> bool:
        """Wait until a stopping loop has released everything; True if it has."""
        return self._stopped.wait(timeout_s)

    def final_stats(self, timeout_s: float = 5.0) -> EngineStats:
        """A stopped loop's engine stats, once it released everything (blocking: wait_stopped).
        If the release failed or is not done, every block counts as held: nobody can tell."""
        if self.wait_stopped(timeout_s) and self._final_stats is not None:
            return self._final_stats
        num_blocks = self.engine.config.num_kv_blocks
        return EngineStats(
            num_free_blocks=0,
            num_blocks=num_blocks,
            kv_usage=1.0,
            num_running=0,
            num_waiting=0,
            num_waiting_tokens=0,
            num_preemptions=0,
            num_computed_prompt_tokens=0,
            num_prefix_hit_tokens=0,
        )

    def call(self, fn: Callable[[EngineProtocol], Any]) -> Future:
        """Run fn(engine) on the loop thread between steps; the future holds its result."""
        fut: Future = Future()
        with self._lock:
            if self._accepting:
                self._commands.put((fn, fut))
                self._wake.set()
                return fut
        fut.set_exception(self._stopped_error())
        return fut

    async def make_sequence(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        prefill_only: bool = False,
        deadline: float | None = None,
    ) -> Sequence:
        """EngineProtocol.make_sequence for an asyncio actor. A constrained request's grammar may take
        long to compile: that runs on a worker thread, never on the loop thread or the event
        loop, so other requests keep streaming, and within the request's deadline (time.time()),
        so compile time counts toward it (TimeoutError past it). InvalidRequestError for bad
        input, an invalid grammar included."""
        if params.structured_output is None:
            return self.engine.make_sequence(None, prompt_token_ids, params, request_id, prefill_only=prefill_only)
        build = asyncio.to_thread(
            self.engine.make_sequence, None, prompt_token_ids, params, request_id, prefill_only=prefill_only
        )
        timeout = None if deadline is None else max(deadline - time.time(), 0.001)
        return await asyncio.wait_for(build, timeout)

    def add_sequence(self, seq: Sequence, sink: Sink) -> Future:
        """Queue seq (from EngineProtocol.make_sequence); its outputs go to sink."""

        def add(engine: EngineProtocol) -> None:
            try:
                self._sinks[seq.request_id] = sink
                engine.add_sequence(seq)
            except BaseException:
                self.faults.joined(seq.request_id)
                raise

        self.faults.joining(seq.request_id)  # a held step lets it in
        return self.call(add)

    def accept_first_token(self, request_id: str, first: PrefillResult, sink: Sink) -> Future:
        """EngineProtocol.accept_first_token on the loop thread: an early first token's output
        goes to sink now (and the later ones, once admit_prefilled lets the sequence join).
        The future's result: whether it went out (else admit_prefilled sends it)."""

        def accept(engine: EngineProtocol) -> bool:
            out = engine.accept_first_token(request_id, first)
            if out is None:
                return False
            self._sinks[request_id] = sink
            self._delivered = True
            sink(out)
            return True

        return self.call(accept)

    def admit_prefilled(self, request_id: str, first: PrefillResult, sink: Sink) -> Future:
        """EngineProtocol.admit_prefilled on the loop thread: its first output (unless
        accept_first_token sent it) and every later one go to sink."""

        def admit(engine: EngineProtocol) -> None:
            try:
                out = engine.admit_prefilled(request_id, first)
            except BaseException:
                self.faults.joined(request_id)
                raise
            if out is not None and out.finished:
                self.faults.joined(request_id)
            else:
                self._sinks[request_id] = sink
            if out is not None:
                self._delivered = True
                sink(out)

        self.faults.joining(request_id)
        return self.call(admit)

    def reserve_prompt_blocks(self, seq: Sequence) -> Future:
        """EngineProtocol.reserve_prompt_blocks on the loop thread (the blocks a remote prefill
        writes into). A held step lets the call through, as a request joining: without its
        blocks the request could never join."""

        def reserve(engine: EngineProtocol):
            try:
                return engine.reserve_prompt_blocks(seq)
            finally:
                self.faults.joined(seq.request_id)  # it joins again when admitted (admit_prefilled)

        self.faults.joining(seq.request_id)
        return self.call(reserve)

    def abort(self, request_id: str) -> Future:
        """Abort a request. On a stopped loop it is a no-op: everything was released already."""

        def do_abort(engine: EngineProtocol) -> None:
            self._sinks.pop(request_id, None)
            engine.abort(request_id)
            self.faults.joined(request_id)

        fut = self.call(do_abort)
        if fut.done() and isinstance(fut.exception(), EngineLoopStopped):
            fut = Future()
            fut.set_result(None)
        return fut

    @property
    def holding(self) -> bool:
        """Chaos testing: a step is held now (StepFaults.hold_at_output_tokens)."""
        return self.faults.holding

    def inject_faults(self, faults: StepFaults) -> None:
        """Chaos testing (FaultInjector): fail or hang the next steps, hold the steps once
        every sequence reached an output length, or stop the loop for good."""
        self.faults.arm(faults)
        self._wake.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        self.faults.interrupt()
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
                self.faults.check_loop()
                self._drain_commands()
                self._flush()
                if not self.engine.has_unfinished():
                    if self.after_step is not None:
                        self.after_step(self.engine)
                    self._wake.wait(self.idle_wait_s)
                    self._wake.clear()
                    continue
                self._step()
                self._flush()
                if self.after_step is not None:
                    self.after_step(self.engine)
        except BaseException as exc:
            self.error = exc
            logger.exception("engine loop of %s stopped for good; failing its requests", self.name)
        finally:
            self._release_everything()

    def _step(self) -> None:
        completed = self.engine.num_steps
        try:
            # Outputs go to the sinks through _deliver_outputs (this thread): with async
            # scheduling while the next step's forward runs on the engine's forward thread.
            self.engine.step(self.faults.wrap(self.layer_hook), self._deliver_outputs)
        except EngineStepError as exc:
            self.num_failed_steps += 1
            self._num_consecutive_failures += 1
            logger.error(
                "%s: engine step failed; failing its %d request(s): %s",
                self.name,
                len(exc.request_ids),
                ", ".join(exc.request_ids),
                exc_info=exc.__cause__,
            )
            error = EngineStepError(f"{self.name}: {exc}", exc.request_ids)
            for request_id in exc.request_ids:
                self._deliver(self._sinks.pop(request_id, None), error, request_id)
            if self._num_consecutive_failures >= self.max_consecutive_step_failures:
                raise EngineLoopStopped(
                    f"{self._num_consecutive_failures} engine steps failed in a row; the last: {exc.__cause__!r}"
                ) from exc
            return
        if self.engine.num_steps > completed:  # a forward succeeded (async scheduling: not every call takes one in)
            self._num_consecutive_failures = 0

    def _deliver_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            sink = self._sinks.pop(out.request_id, None) if out.finished else self._sinks.get(out.request_id)
            self._deliver(sink, out, out.request_id)
        self._flush()

    def _deliver(self, sink: Sink | None, item: RequestOutput | Exception, request_id: str) -> None:
        if sink is None:
            return
        self._delivered = True
        try:
            sink(item)
        except Exception:
            logger.exception("output sink for %s failed", request_id)

    def _flush(self) -> None:
        if self._delivered and self.flush_outputs is not None:
            self._delivered = False
            try:
                self.flush_outputs()
            except Exception:
                logger.exception("%s: handing the step's outputs over failed", self.name)

    def _release_everything(self) -> None:
        """The loop is ending: stop accepting, abort every request so each block goes back
        to the pool, then fail every sink and queued call with EngineLoopStopped."""
        with self._lock:
            self._accepting = False
        try:
            self.engine.abort_all()
            self._final_stats = self.engine.stats()
        except BaseException:
            logger.exception("%s: releasing the requests of the stopped engine failed", self.name)
        error = self._stopped_error()
        sinks, self._sinks = self._sinks, {}
        for request_id, sink in sinks.items():
            self._deliver(sink, error, request_id)
        self._flush()
        while True:
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                break
            if fut.set_running_or_notify_cancel():
                fut.set_exception(error)
        self._stopped.set()

    def _stopped_error(self) -> EngineLoopStopped:
        reason = f"engine loop of {self.name} stopped: {self.error!r}" if self.error else f"{self.name} is shut down"
        return EngineLoopStopped(reason)
