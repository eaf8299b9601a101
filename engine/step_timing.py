"""StepTiming: where an engine's step time goes -- the forward pass against the host work
around it (scheduling, input preparation, the scheduler's update, detokenization and stop
strings, the loop's output delivery and commands), and how much of that host work the forward
pass had to wait for.

- forward: a step's forward pass and sampling (`StepRunner.run`), wall seconds.
- host: the engine loop thread's busy time around the forward passes, wall seconds.
- exposed host: the gaps between one forward's end and the next one's start while the engine
  had work (and before a busy period's first forward, after its last); the forward passes, or
  the outputs, wait for this part. Synchronous stepping exposes all host work;
  async scheduling (engine/step_pipeline.py) only what the forward thread waits for.
- overlap = 1 - exposed / host: the share of host work hidden behind forward passes.

Recorded on the engine loop thread; with async scheduling a forward pass runs on the forward
thread and is recorded when the loop thread takes it in, less the time its sampling waited for
the loop thread (exposed host work). torch-free.
"""

from __future__ import annotations

import time

from splitserve.engine.step_cost_profile import StepCostProfile


class StepTiming:
    def __init__(self) -> None:
        self.num_steps = 0
        self.forward_seconds = 0.0
        self.host_seconds = 0.0
        self.exposed_host_seconds = 0.0
        self._forward_end: float | None = None  # the last forward's end, while work followed it
        self._host_since: float | None = None  # the loop's last step() exit, while work followed it
        self._waited = 0.0  # seconds the current step() blocked on a forward
        self.profile = StepCostProfile()

    # ---- the loop thread's step() ----------------------------------------------------------
    def step_entered(self) -> float:
        now = time.perf_counter()
        if self._host_since is not None:  # delivery, flushing and commands since the last step()
            self.host_seconds += now - self._host_since
        if self._forward_end is None:  # a busy period starts: its first forward waits from here
            self._forward_end = now
        self._waited = 0.0
        return now

    def waited(self, seconds: float) -> None:
        """step() spent this long in a forward pass, or waiting for the forward thread's:
        not the loop thread's own host work."""
        self._waited += seconds

    def step_exited(self, entered: float, busy: bool) -> None:
        """busy: the engine has more work (the loop steps again at once)."""
        now = time.perf_counter()
        self.host_seconds += max(now - entered - self._waited, 0.0)
        self._host_since = now if busy else None
        if not busy:  # the busy period ends: its outputs waited for what followed the last forward
            if self._forward_end is not None:
                self.exposed_host_seconds += max(now - self._forward_end, 0.0)
            self._forward_end = None  # idle: the next forward waits for requests, not host work

    # ---- forward passes ----------------------------------------------------------------------
    def forward(
        self,
        start: float,
        end: float,
        stalled: float = 0.0,
        num_tokens: int = 0,
        num_prefill_tokens: int = 0,
        fresh_prompt: bool = False,
    ) -> None:
        """A forward pass ran from start to end (perf_counter seconds, any thread), of which
        stalled seconds waiting for host work (async scheduling: its sampling waited for the
        loop thread to take the previous step's tokens in): exposed, not forward. num_tokens,
        num_prefill_tokens, fresh_prompt: the batch's shape, for the step cost profile."""
        if self._forward_end is not None:
            self.exposed_host_seconds += max(start - self._forward_end, 0.0)
        self._forward_end = end
        self.forward_seconds += end - start - stalled
        self.exposed_host_seconds += stalled
        self.num_steps += 1
        self.profile.record(end - start - stalled, num_tokens, num_prefill_tokens, fresh_prompt)

    def stats(self) -> dict[str, float | int]:
        """EngineStats' step timing fields."""
        return {
            "num_timed_steps": self.num_steps,
            "step_forward_seconds": self.forward_seconds,
            "step_host_seconds": self.host_seconds,
            "step_exposed_host_seconds": self.exposed_host_seconds,
            **self.profile.stats(),
        }
