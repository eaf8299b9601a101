"""ForwardThread: async scheduling's forward thread (engine/step_pipeline.py). It runs the
submitted steps' forward passes and sampling (`StepRunner.run`) one after another, in order,
while the engine loop's thread schedules the next step and processes the last one's tokens.
torch releases the GIL inside its ops, so on CPU the two threads share the cores; on a GPU
the thread queues the kernels and waits where the sampled tokens are read back.

A step submitted while the one before it is still running (scheduled ahead) gets that step's
result as `previous`, its placeholder rows' input tokens, and samples only once the loop
thread set the earlier step's `updated` event: its tokens are then in the scheduler, so grammar
masks, penalties, min_tokens and seeded generators see what the synchronous step's see.
Torch-free: what it runs is the engine's runner.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from splitserve.engine.core.scheduled_batch import ScheduledBatch
from splitserve.engine.core.sequence import SequenceStatus


@dataclass
class InFlightStep:
    """A submitted step: its batch, the blocks its forward writes (one extra reference each,
    so a request ending meanwhile cannot hand them to anyone else before the forward is done),
    its result (ForwardThread._run's), and the event
    the loop thread sets once the scheduler holds its tokens (or gave up on them)."""

    batch: ScheduledBatch
    pins: list[int]
    future: Future = field(default_factory=Future)
    updated: threading.Event = field(default_factory=threading.Event)

    def live_rows(self) -> int:
        """Requests of the batch still running as the batch scheduled them (not finished,
        aborted or preempted since): the rows whose tokens will be used."""
        preemptions = self.batch.preemptions
        return sum(
            1
            for index, seq in enumerate(self.batch.seqs)
            if seq.status is SequenceStatus.RUNNING and seq.num_preemptions == preemptions[index]
        )


class ForwardThread:
    def __init__(self, runner: Any):
        self.runner = runner
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-forward")

    def submit(
        self,
        batch: ScheduledBatch,
        prepared: Any,
        pins: list[int],
        on_layer_done: Any = None,
        previous: InFlightStep | None = None,
    ) -> InFlightStep:
        """Queue a prepared step behind the one in flight (previous: still running when this
        one was scheduled, None when every token it reads is known)."""
        step = InFlightStep(batch, pins)
        step.future = self._executor.submit(self._run, prepared, on_layer_done, previous)
        return step

    def _run(
        self, prepared: Any, on_layer_done: Any, previous: InFlightStep | None
    ) -> tuple[dict, float, float, float]:
        """(sampled tokens, forward start, end, seconds of it spent waiting for the loop
        thread to take the previous step's tokens in: host work the forward waited for)."""
        last_tokens, before_sampling = None, None
        stalled = [0.0]
        if previous is not None:  # it ran before this one on this thread: done
            if previous.future.exception() is None:
                last_tokens = previous.future.result()[0]
            updated = previous.updated

            def before_sampling() -> None:
                waiting_from = time.perf_counter()
                updated.wait()
                stalled[0] = time.perf_counter() - waiting_from

        start = time.perf_counter()
        sampled = self.runner.run(prepared, on_layer_done, last_tokens, before_sampling)
        return sampled, start, time.perf_counter(), stalled[0]
