"""FaultInjector: chaos-test faults that fire inside the engine loop's real code paths.

Armed from any thread (a worker's inject_fault actor method), fired on the loop thread:
- fail the next N steps: the step raises from its first layer callback, mid-forward, so the
  recovery sees a batch half computed (KV half written, a prefill's first layer already
  queued to the KV sender) -- the same state a real kernel or transfer failure leaves;
- hang the next N steps for S seconds each, also mid-forward (a hung prefill or kernel);
  a loop stop() interrupts the hang, and so does arming again (a test switching the fault
  off ends a hang in progress, so a test can hang a step "until released", on any machine);
- hold at an output length: a step whose every sequence has at least N output tokens hangs
  until released (armed again) or the loop stops, so a test can stop a replica with all of
  its streams mid-way, however long the machine takes to get there. A request queued to join
  (EngineLoop.add_sequence, admit_prefilled, or asking for blocks a remote prefill fills:
  reserve_prompt_blocks) ends a held step so that it can: the next step
  holds again once it, too, has N tokens -- a stream that arrives late still gets there;
- stop the loop for good: the loop thread raises between steps, outside any step, which is
  the "cannot carry on" path.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from splitserve.engine.engine_protocol import LayerHookFactory


class InjectedFault(RuntimeError):
    """Raised by an armed fault: never by a healthy engine."""


# A held step's safety net only: a test that never releases it still ends (that step then
# completes, and the next one holds again).
HOLD_SAFETY_S = 300.0


@dataclass(frozen=True)
class StepFaults:
    """What FaultInjector.arm sets, all at once (what is not given is off): fail the next
    fail_steps steps; hang the next hang_steps steps hang_s seconds each; stop the loop for
    good; hold every step whose every sequence has hold_at_output_tokens output tokens, until
    armed again."""

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
        self._cond = threading.Condition()
        self._num_failing_steps = 0
        self._hang_s = 0.0
        self._num_hanging_steps = 0
        self._stop_reason: str | None = None
        self._hold_at_output_tokens = 0
        self._arming = 0  # counts arm(): a hang claimed under an earlier arming ends
        # Requests queued to join the batch: a hold yields until a step has taken them in.
        self._joining: set[str] = set()
        self._interrupted = False
        self.num_fired = 0
        self.holding = False  # a step is held now (tests wait for it)

    def arm(self, faults: StepFaults) -> None:
        """Set every fault at once (what faults does not name is switched off)."""
        with self._cond:
            self._hold_at_output_tokens = faults.hold_at_output_tokens
            self._num_failing_steps = faults.fail_steps
            self._hang_s = faults.hang_s
            self._num_hanging_steps = faults.hang_steps if faults.hang_s > 0 else 0
            self._stop_reason = "injected loop stop" if faults.stop_loop else None
            self._arming += 1
            if not faults.hold_at_output_tokens:
                self._joining.clear()
            self._cond.notify_all()  # a hang in progress ends: it was armed under the old setting

    @property
    def armed(self) -> bool:
        return bool(
            self._num_failing_steps or self._num_hanging_steps or self._stop_reason or self._hold_at_output_tokens
        )

    def interrupt(self) -> None:
        """End a hang now and never hang again (the loop is stopping)."""
        with self._cond:
            self._interrupted = True
            self._cond.notify_all()

    def joining(self, request_id: str) -> None:
        """A request was queued to join the batch: a held step ends, and no step holds, until
        a step has it (or it was dropped: joined)."""
        with self._cond:
            if self._hold_at_output_tokens:
                self._joining.add(request_id)
                self._cond.notify_all()

    # ---- loop thread ---------------------------------------------------------------------
    def joined(self, request_id: str) -> None:
        """A joining request will never be in a step (it failed to join, or finished at once)."""
        with self._cond:
            self._joining.discard(request_id)

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
            with self._cond:
                fail = self._num_failing_steps > 0
                self._num_failing_steps -= fail
                hang_s = self._hang_s if self._num_hanging_steps > 0 else 0.0
                self._num_hanging_steps -= hang_s > 0
                joiners = self._joining & {seq.request_id for seq in batch.seqs}
                hold = self._hold_at_output_tokens
                held = bool(hold and batch.seqs) and all(seq.num_output_tokens >= hold for seq in batch.seqs)
                arming = self._arming
            if not (fail or hang_s or held or joiners):
                return inner

            def on_layer_done(layer: int) -> None:
                if inner is not None:
                    inner(layer)
                if layer != 0:
                    return
                if joiners:  # they are in a running step: a later step may hold them
                    with self._cond:
                        self._joining -= joiners
                if hang_s or held:
                    self.num_fired += 1
                    self._hang(arming, hang_s, held)
                if fail:
                    self.num_fired += 1
                    raise InjectedFault(f"injected step failure ({len(batch.seqs)} requests in the batch)")

            return on_layer_done

        return factory

    def _hang(self, arming: int, hang_s: float, held: bool) -> None:
        """Wait hang_s, or while held until released (a joining request ends it too); an
        arming after `arming` or an interrupt ends either at once."""
        with self._cond:
            held = held and not self._joining  # a request waits to join: let this step through
            if not (hang_s or held):
                return

            def ended() -> bool:
                return self._interrupted or self._arming != arming or (held and bool(self._joining))

            self.holding = held
            try:
                self._cond.wait_for(ended, HOLD_SAFETY_S if held else hang_s)
            finally:
                self.holding = False
