"""FaultInjector: chaos-test faults that fire inside the engine loop's real code paths.

Armed from any thread (a worker's inject_fault actor method), fired on the loop thread:
- fail the next N steps: the step raises from its first layer callback, mid-forward, so the
  recovery sees a batch half computed (KV half written, a prefill's first layer already
  queued to the KV sender) -- the same state a real kernel or transfer failure leaves;
- hang the next N steps for S seconds each, also mid-forward (a hung prefill or kernel);
  a loop stop() interrupts the hang, and so does arming again (a test switching the fault
  off ends a hang in progress, so a test can hang a step "until released", on any machine);
- hold at an output length: a step whose batch has a sequence with at least N output tokens
  hangs until released (armed again) or the loop stops, so a test can stop a replica before
  any of its streams could finish, however long the machine takes to get there;
- stop the loop for good: the loop thread raises between steps, outside any step, which is
  the "cannot carry on" path.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from splitserve.engine.engine_protocol import LayerHookFactory


class InjectedFault(RuntimeError):
    """Raised by an armed fault: never by a healthy engine."""


# How long one held step waits before the next step checks again (a release ends it at once).
HOLD_CHECK_S = 60.0


@dataclass(frozen=True)
class StepFaults:
    """What FaultInjector.arm sets, all at once (what is not given is off): fail the next
    fail_steps steps; hang the next hang_steps steps hang_s seconds each; stop the loop for
    good; hold every step, until armed again, once a sequence in it has hold_at_output_tokens
    output tokens."""

    fail_steps: int = 0
    hang_s: float = 0.0
    hang_steps: int = 1
    stop_loop: bool = False
    hold_at_output_tokens: int = 0

    def __post_init__(self) -> None:
        if min(self.fail_steps, self.hang_s, self.hang_steps, self.hold_at_output_tokens) < 0:
            raise ValueError(f"fault counts and durations must be >= 0: {self}")


class FaultInjector:
    def __init__(self):
        self._lock = threading.Lock()
        self._num_failing_steps = 0
        self._hang_s = 0.0
        self._num_hanging_steps = 0
        self._stop_reason: str | None = None
        self._hold_at_output_tokens = 0
        self._wake = threading.Event()  # ends the hangs claimed under the current arming
        self._interrupted = False
        self.num_fired = 0

    def arm(self, faults: StepFaults) -> None:
        """Set every fault at once (what faults does not name is switched off)."""
        with self._lock:
            self._hold_at_output_tokens = faults.hold_at_output_tokens
            self._num_failing_steps = faults.fail_steps
            self._hang_s = faults.hang_s
            self._num_hanging_steps = faults.hang_steps if faults.hang_s > 0 else 0
            self._stop_reason = "injected loop stop" if faults.stop_loop else None
            wake, self._wake = self._wake, threading.Event()
            if self._interrupted:
                self._wake.set()
        wake.set()  # a hang in progress ends: it was armed under the old setting

    @property
    def armed(self) -> bool:
        return bool(
            self._num_failing_steps or self._num_hanging_steps or self._stop_reason or self._hold_at_output_tokens
        )

    def interrupt(self) -> None:
        """End a hang now and never hang again (the loop is stopping)."""
        with self._lock:
            self._interrupted = True
            self._wake.set()

    # ---- loop thread ---------------------------------------------------------------------
    def check_loop(self) -> None:
        """Between steps: raise if the loop was told to stop for good."""
        if self._stop_reason is not None:
            self.num_fired += 1
            raise InjectedFault(self._stop_reason)

    def wrap(self, layer_hook: LayerHookFactory | None) -> LayerHookFactory | None:
        """layer_hook itself while nothing is armed; otherwise a hook factory that claims this
        step's faults and fires them after the step's first layer."""
        if not (self._num_failing_steps or self._num_hanging_steps or self._hold_at_output_tokens):
            return layer_hook

        def factory(batch):
            inner = layer_hook(batch) if layer_hook is not None else None
            with self._lock:
                fail = self._num_failing_steps > 0
                self._num_failing_steps -= fail
                hang_s = self._hang_s if self._num_hanging_steps > 0 else 0.0
                self._num_hanging_steps -= hang_s > 0
                hold = self._hold_at_output_tokens
                if hold and any(seq.num_output_tokens >= hold for seq in batch.seqs):
                    hang_s = max(hang_s, HOLD_CHECK_S)  # until released; a later step holds again
                wake = self._wake
            if not fail and not hang_s:
                return inner

            def on_layer_done(layer: int) -> None:
                if inner is not None:
                    inner(layer)
                if layer != 0:
                    return
                if hang_s:
                    self.num_fired += 1
                    wake.wait(hang_s)
                if fail:
                    self.num_fired += 1
                    raise InjectedFault(f"injected step failure ({len(batch.seqs)} requests in the batch)")

            return on_layer_done

        return factory
