"""StepPipeline: async scheduling, after vLLM's AsyncScheduler (`--async-scheduling`: step N+1
is scheduled while step N runs, with an output placeholder for each token N samples) and
SGLang's overlap scheduler (`event_loop_overlap`, its FutureMap resolving placeholder ids
before the next forward). The forward passes run on a forward thread (engine/forward_thread.py)
in order; the engine loop's thread schedules and prepares the next step while one runs, then
takes that step's tokens in and builds its outputs while the next one runs:

    loop thread:    [sched N+1 | prep N+1][wait N][update N][outputs N, deliver, flush][commands][sched N+2 | prep N+2] ...
    forward thread: [forward N                   ][forward N+1              ...      (sample N+1 after update N)][forward N+2
                                                  ^ N+1 queued behind N: the forward never waits for host work

- Scheduling ahead (Scheduler.commit): a submitted batch's positions count as computed at
  once, and each request it samples for holds a placeholder (`num_output_placeholders`) for
  that token, so N+1 is scheduled past them: N's decode rows continue with one more position
  each, a prompt's next chunk follows its last (a chunk needs no placeholder: its tokens are
  known). A request whose last token N samples (max_tokens, the context length) is not
  scheduled again. A prefill-only request (disaggregated prefill) gets no placeholder: it is
  not scheduled past its prompt, and its one output is delivered as soon as N is taken in,
  before any later command (decode's ack) may release its blocks.
- Placeholder rows (engine/model_runner.py): N+1's decode row of a request N samples for is
  built with input token 0; on the forward thread, just before N+1's forward, it is filled in
  from N's result (an index fill of the input ids). N+1's sampling waits until the loop thread
  has taken N's tokens in (update N): grammar masks (computed after the forward then), penalties,
  logit_bias, min_tokens, logprobs and seeded generators see exactly the synchronous step's
  state, so greedy output is identical and seeded sampling reproducible.
- Correcting for ends: a request that ends in N (EOS, a stop token, max_tokens, a grammar's end
  in update N; a stop string while building N's outputs; an abort or a failure) while N+1 has
  its row: the row is computed and discarded (Scheduler.update skips requests no longer
  running as the batch scheduled them), nothing past its end is emitted. A preempted request
  (while scheduling N+1 with N in flight) gets nothing from N and recomputes. Blocks: each
  submitted forward holds an extra reference on the blocks it writes until it is taken in,
  so a request ending meanwhile frees its blocks to the pool only once no forward can still
  write them; the prefix cache enters a block only once its KV is written (update N caches up
  to N's positions, not N+1's). So a waiting request whose next uncached block N is writing
  is admitted one step later, from the prefix cache, rather than computing it again. A step whose every row died (all its requests ended) is waited
  for at once, so an idle engine holds nothing.
- When nothing can be scheduled ahead (e.g. all running requests end in N, or the pool is
  full until N's finished requests free blocks), N+1 is scheduled once N's tokens are in, in
  the synchronous order, and still runs while N's outputs are built.
- Speculative decoding steps synchronously (PagedEngine builds no pipeline for it): drafts are
  proposed from the previous step's accepted tokens, which a placeholder does not have. On
  CPU, so do steps with fewer than CPU_MIN_REQUESTS requests (the pipeline drains into them).
- A step scheduled ahead preempts no running request (Scheduler.schedule(ahead=True)): the
  victim would lose the step in flight, and among equals again the next time. Where blocks
  run out the rest wait for the step scheduled once N is taken in, which preempts as ever.
- Failures: a failed forward (or prepare) fails its own batch, an EngineStepError as a failed
  synchronous step; the step scheduled behind it reads token 0 for its placeholder rows, whose
  requests that failure failed, and serves the others. A failure taking N's tokens in or
  building its outputs fails N's batch. The error is raised by the loop thread's step that
  took the failed step in, once the other batch was carried on.

Threads: only the loop thread touches the scheduler, the block pool and the outputs; the
forward thread reads the sequences its prepared step samples for (parameters, output tokens,
grammars), whose tokens the loop thread appends only while no sampling of theirs runs. On CPU
they share the GIL: torch releases it inside each op, so an eager forward made of many short
ops needs it back after each one and waits whenever the loop thread runs Python. A CPU decode
step therefore runs as one TorchScript call that holds no GIL (engine/model/scripted_decode.py),
and async scheduling is on by default only where it does (engine/config.py,
async_scheduling_pays). The forward thread still takes the GIL to enter and leave that call;
on CPU the pipeline lowers the interpreter's switch interval (CPU_SWITCH_INTERVAL) so that it
waits at most that long for the loop thread to let go.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from splitserve.engine.core.scheduled_batch import ScheduledBatch
from splitserve.engine.core.sequence import Sequence, SequenceStatus
from splitserve.engine.engine_errors import EngineStepError
from splitserve.engine.engine_protocol import LayerHookFactory
from splitserve.engine.forward_thread import ForwardThread, InFlightStep
from splitserve.engine.io.request_output import RequestOutput

if TYPE_CHECKING:
    from splitserve.engine.paged_engine import PagedEngine

# Hands a step's outputs over (the engine loop's sinks and flush), on the loop thread.
Deliver = Callable[[list[RequestOutput]], None]


class StepPipeline:
    # Fewest requests (running and waiting) worth a forward thread on CPU. Below it the
    # hand-over (a thread wake-up each way per step, the GIL taken back twice) costs about what
    # the host work it hides saves: measured on the bench preset, decode steps ahead ran 0.95x
    # the synchronous step at 8 requests, 0.97x at 12 and 1.14x at 16. Smaller steps run the
    # synchronous step, and the pipeline drains into it. On a GPU every step goes ahead.
    CPU_MIN_REQUESTS = 16
    # Seconds a thread waiting for the GIL gives the holder before asking it to let go (Python's
    # default is 5 ms, as long as a whole decode step here). Measured on the bench preset at
    # batch 8-64, 0.5 ms was as fast or faster than 5 ms and 0.2 ms (bench/results/overlap.md).
    CPU_SWITCH_INTERVAL = 0.0005

    def __init__(self, engine: PagedEngine):
        self.engine = engine
        self.forward = ForwardThread(engine.runner)
        self._in_flight: InFlightStep | None = None
        on_gpu = str(engine.config.device).startswith("cuda")
        # On a GPU every step goes ahead; on CPU steps from CPU_MIN_REQUESTS requests on.
        self.min_requests = 1 if on_gpu else self.CPU_MIN_REQUESTS
        if not on_gpu and sys.getswitchinterval() > self.CPU_SWITCH_INTERVAL:
            sys.setswitchinterval(self.CPU_SWITCH_INTERVAL)  # process-wide; only ever lowered

    @property
    def busy(self) -> bool:
        """A step is submitted whose tokens are not taken in yet."""
        return self._in_flight is not None

    def clear(self) -> None:
        """Wait for the step in flight and forget it (the engine aborts every request)."""
        step, self._in_flight = self._in_flight, None
        if step is not None:
            self._discard(step)

    def drop_dead(self) -> None:
        """After an abort: if no request of the step in flight is left, wait for it now, so
        its blocks are back in the pool once the engine has nothing left to run."""
        if self._in_flight is not None and not self._in_flight.live_rows():
            step, self._in_flight = self._in_flight, None
            self._discard(step)

    def _discard(self, step: InFlightStep) -> None:
        """Wait for a step none of whose tokens is needed, and release what it holds."""
        step.updated.set()  # nothing is behind it
        step.future.exception()  # waits; a failure fails nobody: its requests have all ended
        self._release(step)
        self._forget_finished(step.batch)

    def step(self, layer_hook: LayerHookFactory | None = None, deliver: Deliver | None = None) -> list[RequestOutput]:
        """Submit the next step, then take the one in flight in: its outputs are handed to
        deliver (and [] returned), or returned."""
        timing = self.engine.timing
        entered = timing.step_entered()
        try:
            return self._step(layer_hook, deliver)
        finally:
            timing.step_exited(entered, self.engine.has_unfinished())

    def _step(self, layer_hook: LayerHookFactory | None, deliver: Deliver | None) -> list[RequestOutput]:
        engine = self.engine
        scheduler = engine.scheduler
        small = len(scheduler.running) + len(scheduler.waiting) < self.min_requests
        last, self._in_flight = self._in_flight, None
        if last is None and small:  # too few requests to pay for the forward thread
            outputs = engine._step_sync(layer_hook)
            if deliver is None:
                return outputs
            deliver(outputs)
            return []
        errors: list[EngineStepError] = []
        try:
            following = None if small else self._launch(layer_hook, last, errors)  # ahead, while last runs
        except BaseException:
            self._in_flight = last  # outside any batch (the loop stops): clear() still waits for it
            raise
        if last is None:
            self._in_flight = following
            _raise(errors)
            return []
        try:
            advanced = self._take_in(last, errors)
        finally:
            last.updated.set()  # the step behind it may sample now
        outputs = []
        prefilled = [seq for seq in advanced if seq.prefill_only]
        if prefilled:  # at once: its sink starts the KV transfer or pins the blocks for it
            outputs += self._outputs(prefilled, last.batch, deliver, errors)
        if following is None and not small:  # nothing could go ahead: schedule knowing last's tokens
            following = self._launch(layer_hook, None, errors)
        outputs += self._outputs([s for s in advanced if not s.prefill_only], last.batch, deliver, errors)
        self._forget_finished(last.batch)
        if following is not None and not following.live_rows():
            self._discard(following)  # every request it computes for has ended
            following = None
        self._in_flight = following
        _raise(errors)
        return outputs

    def _launch(
        self, layer_hook: LayerHookFactory | None, last: InFlightStep | None, errors: list[EngineStepError]
    ) -> InFlightStep | None:
        """Schedule, prepare and submit the next step (last: the step still running before it)."""
        engine = self.engine
        batch = engine.scheduler.schedule(ahead=last is not None)
        if batch.is_empty:
            return None
        try:
            prepared = engine.runner.prepare(batch)
            on_layer_done = layer_hook(batch) if layer_hook is not None else None
        except Exception as exc:
            errors.append(self._failed(batch, exc))
            return None
        engine.scheduler.commit(batch)
        return self.forward.submit(batch, prepared, self._pin(batch), on_layer_done, last)

    def _take_in(self, step: InFlightStep, errors: list[EngineStepError]) -> list[Sequence]:
        """Wait for step's forward and hand its tokens to the scheduler; the requests that got one."""
        engine = self.engine
        waited_from = time.perf_counter()
        try:
            sampled, start, end, stalled = step.future.result()
        except Exception as exc:
            errors.append(self._failed(step.batch, exc))
            return []
        finally:
            engine.timing.waited(time.perf_counter() - waited_from)
            self._release(step)
        batch = step.batch
        engine.timing.forward(start, end, stalled, batch.num_tokens, batch.num_prefill_tokens, batch.is_fresh_prompt)
        try:
            advanced = engine.scheduler.update(step.batch, sampled)
        except Exception as exc:
            errors.append(self._failed(step.batch, exc))
            return []
        engine.num_steps += 1
        return advanced

    def _outputs(
        self, seqs: list[Sequence], batch: ScheduledBatch, deliver: Deliver | None, errors: list[EngineStepError]
    ) -> list[RequestOutput]:
        """The outputs of a step's requests; a failure fails the batch."""
        if not seqs:
            return []
        engine = self.engine
        try:
            outputs = [engine._prefilled_output(s) if s.prefill_only else engine._emit_output(s) for s in seqs]
        except Exception as exc:
            errors.append(self._failed(batch, exc))
            return []
        if deliver is None:
            return outputs
        deliver(outputs)
        return []

    def _pin(self, batch: ScheduledBatch) -> list[int]:
        """One more reference on each block the batch's forward writes (Scheduler.commit set starts)."""
        assert batch.starts is not None
        size = self.engine.config.block_size
        pins = []
        for seq, start, num_new in zip(batch.seqs, batch.starts, batch.num_new_tokens):
            pins.extend(seq.block_table[start // size : (start + num_new - 1) // size + 1])
        self.engine.kv.pool.touch(pins)
        return pins

    def _release(self, step: InFlightStep) -> None:
        pins, step.pins = step.pins, []
        if pins:
            self.engine.kv.pool.free(pins)

    def _forget_finished(self, batch: ScheduledBatch) -> None:
        """Requests of the batch that ended while its forward ran: drop what the forward
        recreated for them (a seeded generator)."""
        for seq in batch.seqs:
            if seq.status is SequenceStatus.FINISHED:
                self.engine._forget(seq.request_id)

    def _failed(self, batch: ScheduledBatch, exc: Exception) -> EngineStepError:
        self._forget_finished(batch)
        error = EngineStepError(f"engine step failed: {exc!r}", self.engine._fail_batch(batch))
        error.__cause__ = exc  # raised later (_raise), from the cause
        return error


def _raise(errors: list[EngineStepError]) -> None:
    """One error failing every failed batch's requests (a step and the one behind it)."""
    if not errors:
        return
    request_ids = list(dict.fromkeys(rid for error in errors for rid in error.request_ids))
    error = EngineStepError(str(errors[-1]), request_ids)
    raise error from errors[-1].__cause__
