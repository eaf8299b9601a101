"""StepPipeline: async scheduling. The engine's host work overlaps the forward pass: step N+1
is scheduled and its inputs prepared as soon as step N's tokens are in the scheduler, and while
N+1's forward pass runs (on the engine loop's thread, as in the synchronous step) a second
thread, the output thread, builds step N's outputs (detokenization, stop strings) and delivers
and flushes them. Design after vLLM's async scheduling (`--async-scheduling`: the next step is
scheduled before the previous one's outputs are processed) and SGLang's overlap scheduler
(`event_loop_overlap`: a step's results are processed while the next batch runs).

A step's timeline (docs/ARCHITECTURE.md draws it with the synchronous one):

    loop thread:    [schedule N+1 | prepare N+1][forward + sample N+1     ][join][update N+1]
    output thread:                              [outputs N, deliver, flush]

Unlike vLLM's AsyncScheduler, N+1 is not scheduled with placeholders before N's tokens exist:
scheduling and input preparation stay in front of the forward, and in exchange nothing needs
correcting for grammar masks, penalties, token-level stops or preemption. What must precede
the next forward stays on the loop thread, in the synchronous step's order:
the scheduler's update (tokens appended, EOS / stop tokens / max_tokens / grammar termination
checked, blocks cached), so N+1 is scheduled knowing every token-level stop, and grammar masks,
penalties and seeded generators see exactly the state they see without overlap. What N+1
assumes is that N's requests were not ended by the output work that runs beside it: a stop
string found while detokenizing N (or a failure building N's outputs). Such a request finishes
at once, its output ending there; N+1's row for it is discarded (Scheduler.update skips
requests that are no longer running), so nothing past its end is ever emitted. Its blocks go
back to the pool during N+1's forward, which may still write them: harmless, since nothing
allocates blocks until the loop thread is back (no step, command or transfer runs meanwhile).

A prefill-only request's one output (disaggregated prefill) is not deferred: its sink starts
the KV transfer or pins the blocks for it, which must happen before a later command (the decode
side's ack) may release them.

Threads: the output thread touches the engine only between the loop thread's prepare and join,
while the loop thread runs the forward pass, which reads the sequences' tokens and parameters
(sampling, penalties, grammar masks) but changes none of them; torch releases the GIL inside
its ops, where the output thread's Python runs. Speculative decoding steps synchronously (a
stop string inside a run of accepted drafts truncates a sequence the verification reads).

Failures: a failed forward fails N+1's batch; a failure building N's outputs fails N's batch
(its requests in N+1 are aborted, their rows discarded); each raises EngineStepError as a failed
synchronous step does, after the other batch was carried on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from splitserve.engine.core.scheduler import ScheduledBatch
from splitserve.engine.core.sequence import Sequence, SequenceStatus
from splitserve.engine.engine_errors import EngineStepError
from splitserve.engine.engine_protocol import LayerHookFactory
from splitserve.engine.io.request_output import RequestOutput

if TYPE_CHECKING:
    from splitserve.engine.paged_engine import PagedEngine

# Hands a step's outputs over (the engine loop's sinks and flush), on the output thread.
Deliver = Callable[[list[RequestOutput]], None]


class StepPipeline:
    # Fewest pending outputs worth handing to the output thread. On CPU the hand-over (a
    # thread wake-up, the GIL shared with the forward's Python) costs about what a few
    # requests' output work hides: bench/results/overlap.md measured overlap losing at batch
    # 1-8 and gaining from 32. Smaller steps' outputs are built before the next step, as
    # without overlap. On a GPU the forward runs on the device: every step overlaps.
    CPU_MIN_OUTPUTS = 16

    def __init__(self, engine: PagedEngine):
        self.engine = engine
        self.min_outputs = 1 if str(engine.config.device).startswith("cuda") else self.CPU_MIN_OUTPUTS
        self._output_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-outputs")
        # The last step's requests that received tokens, whose outputs are not built yet.
        self._pending: list[Sequence] = []
        self._pending_batch: ScheduledBatch | None = None

    @property
    def busy(self) -> bool:
        """A step's outputs are still to be built."""
        return bool(self._pending)

    def clear(self) -> None:
        """Forget the pending outputs (the engine aborted every request)."""
        self._pending, self._pending_batch = [], None

    def drop(self, request_id: str) -> None:
        """An aborted request's pending output is never built: nothing reaches it past the abort."""
        if any(seq.request_id == request_id for seq in self._pending):
            self._pending = [seq for seq in self._pending if seq.request_id != request_id]

    def step(self, layer_hook: LayerHookFactory | None = None, deliver: Deliver | None = None) -> list[RequestOutput]:
        """Run the next step while the last one's outputs are built; with deliver they are
        handed to it on the output thread (and [] returned), otherwise returned."""
        timing = self.engine.timing
        entered = timing.step_entered()
        try:
            return self._step(layer_hook, deliver)
        finally:
            timing.step_exited(entered, self.engine.has_unfinished())

    def _step(self, layer_hook: LayerHookFactory | None, deliver: Deliver | None) -> list[RequestOutput]:
        engine = self.engine
        pending, pending_batch = self._pending, self._pending_batch
        self.clear()
        before: list[RequestOutput] = []
        if pending and len(pending) < self.min_outputs:  # too few to pay for the hand-over
            before = self._outputs(pending, pending_batch, deliver)
            pending = []
        batch = engine.scheduler.schedule()
        if batch.is_empty:  # nothing to overlap with: the last step's outputs, here and now
            return before + (self._outputs(pending, pending_batch, deliver) if pending else [])
        try:
            prepared = engine.runner.prepare(batch)
            on_layer_done = layer_hook(batch) if layer_hook is not None else None
        except Exception as exc:
            outputs_error = self._run_outputs(pending, pending_batch, deliver)
            raise self._failed(batch, exc, outputs_error) from exc
        job: Future | None = None
        if pending:
            job = self._output_thread.submit(self._outputs_beside, pending, pending_batch, deliver)
        start = time.perf_counter()
        try:
            sampled = engine.runner.run(prepared, on_layer_done)
        except Exception as exc:
            outputs_error = self._join(job)
            raise self._failed(batch, exc, outputs_error) from exc
        end = time.perf_counter()
        engine.timing.forward(start, end)
        engine.timing.waited(end - start)
        outputs: list[RequestOutput] = []
        outputs_error = None
        if job is not None and job.cancel():
            # The output thread never got a core during the forward (a busy machine): build
            # the outputs here rather than wait for it to be scheduled.
            job = None
            try:
                outputs = self._outputs(pending, pending_batch, deliver)
            except EngineStepError as exc:
                outputs_error = exc
        if job is not None:
            try:
                outputs = job.result()
            except EngineStepError as exc:
                outputs_error = exc
            engine.timing.waited(time.perf_counter() - end)  # the output thread's time, counted there
        self._forget_finished(batch)
        try:
            advanced = engine.scheduler.update(batch, sampled)
        except Exception as exc:
            raise self._failed(batch, exc, outputs_error) from exc
        self._pending, self._pending_batch = [s for s in advanced if not s.prefill_only], batch
        engine.num_steps += 1
        prefilled = [s for s in advanced if s.prefill_only]
        if prefilled:
            # A prefill's one output goes out now, as without overlap: its sink starts the KV
            # transfer or pins the blocks for it, before any command (an ack) may release them.
            try:
                outputs = outputs + self._outputs(prefilled, batch, deliver)
            except EngineStepError as exc:
                outputs_error = exc if outputs_error is None else _merged(outputs_error, exc)
        if outputs_error is not None:
            raise outputs_error
        return before + outputs

    def _outputs(
        self, seqs: list[Sequence], batch: ScheduledBatch | None, deliver: Deliver | None
    ) -> list[RequestOutput]:
        """The outputs of a step's requests (output thread, or the loop thread when nothing
        runs). A failure fails the batch."""
        engine = self.engine
        try:
            outputs = [engine._prefilled_output(s) if s.prefill_only else engine._emit_output(s) for s in seqs]
        except Exception as exc:
            assert batch is not None
            raise EngineStepError(f"engine step failed: {exc!r}", engine._fail_batch(batch)) from exc
        if deliver is None:
            return outputs
        deliver(outputs)
        return []

    def _outputs_beside(
        self, seqs: list[Sequence], batch: ScheduledBatch | None, deliver: Deliver | None
    ) -> list[RequestOutput]:
        """_outputs on the output thread, timed as host work beside the forward."""
        started = time.perf_counter()
        try:
            return self._outputs(seqs, batch, deliver)
        finally:
            self.engine.timing.beside(time.perf_counter() - started)

    def _run_outputs(
        self, seqs: list[Sequence], batch: ScheduledBatch | None, deliver: Deliver | None
    ) -> EngineStepError | None:
        """The pending outputs when the next step failed before its forward: delivered (or
        dropped when nobody delivers: the step raises), and their failure, if any."""
        if not seqs:
            return None
        try:
            self._outputs(seqs, batch, deliver)
        except EngineStepError as exc:
            return exc
        return None

    @staticmethod
    def _join(job: Future | None) -> EngineStepError | None:
        if job is None:
            return None
        try:
            job.result()
        except EngineStepError as exc:
            return exc
        return None

    def _forget_finished(self, batch: ScheduledBatch) -> None:
        """Requests of the batch that finished while its forward ran (a stop string, a failed
        output): drop what the forward recreated for them (a seeded generator)."""
        for seq in batch.seqs:
            if seq.status is SequenceStatus.FINISHED:
                self.engine._forget(seq.request_id)

    def _failed(self, batch: ScheduledBatch, exc: Exception, outputs_error: EngineStepError | None) -> EngineStepError:
        """Fail batch; with the previous step's output failure, one error naming both batches."""
        self._forget_finished(batch)
        error = EngineStepError(f"engine step failed: {exc!r}", self.engine._fail_batch(batch))
        return error if outputs_error is None else _merged(outputs_error, error)


def _merged(first: EngineStepError, second: EngineStepError) -> EngineStepError:
    """One error failing both batches' requests (a step's outputs and the next step failed)."""
    return EngineStepError(str(second), list(dict.fromkeys([*first.request_ids, *second.request_ids])))
