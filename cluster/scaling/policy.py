"""Per-pool autoscaling policies: pure decisions from metric snapshots (no Ray, no torch).

Prefill is compute-bound: it scales on queued prefill tokens per replica and on measured
TTFT. Decode is memory-bound: it scales on KV-block utilisation, running sequences per
replica and measured inter-token latency. Both share the same timing rules:

  * over target continuously for upscale_delay_s   -> "up" by `step`, at most max_replicas
  * well under target (every utilisation signal below half its target and every measured
    latency below its target) continuously for downscale_delay_s -> "down" by `step`,
    at least min_replicas
  * below min_replicas / above max_replicas          -> back into range at once
  * snapshot older than metrics_stale_s              -> "hold" (and the evidence restarts)
  * after a scaling action, a cooldown of upscale_delay_s during which the policy holds and
    gathers no evidence: the metrics first have to show the new replica count.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

from splitserve.cluster.config import AutoscalingConfig, DecodeAutoscalingConfig, PrefillAutoscalingConfig
from splitserve.cluster.routing.load import LoadReport

Action = Literal["up", "down", "hold"]
# "Well under target": utilisation below this fraction of its target allows a scale-down.
DOWNSCALE_FRACTION = 0.5


@dataclass(frozen=True)
class MetricsSnapshot:
    """What one pool looked like at `taken_at` (monotonic seconds: the time of its oldest
    replica report, so a stalled poller makes the snapshot stale).

    num_replicas counts serving (non-draining) replicas; loads has one entry per replica.
    ttft_p90_ms / itl_p90_ms: recent measured latency, None when nothing was measured.
    starting_replicas: asked for and not serving yet (only the `sla` policy decides while a
    start is in flight; the reactive policies always see 0)."""

    taken_at: float
    num_replicas: int
    loads: tuple[LoadReport, ...] = ()
    ttft_p90_ms: float | None = None
    itl_p90_ms: float | None = None
    starting_replicas: int = 0

    def __post_init__(self) -> None:
        if self.num_replicas < 0 or self.starting_replicas < 0:
            raise ValueError("num_replicas and starting_replicas must be >= 0")
        object.__setattr__(self, "loads", tuple(self.loads))

    def per_replica(self, total: float) -> float:
        return total / max(self.num_replicas, 1)

    @property
    def queued_tokens_per_replica(self) -> float:
        return self.per_replica(sum(l.queued_prefill_tokens for l in self.loads))

    @property
    def running_per_replica(self) -> float:
        return self.per_replica(sum(l.num_running for l in self.loads))

    @property
    def mean_kv_usage(self) -> float:
        return sum(l.kv_usage for l in self.loads) / len(self.loads) if self.loads else 0.0


@dataclass(frozen=True)
class ScalingDecision:
    action: Action
    target_replicas: int
    reason: str


@dataclass
class _Signal:
    """One metric against its target: over, well under, or in between."""

    name: str
    value: float | None
    target: float
    is_latency: bool = False

    @property
    def over(self) -> bool:
        return self.value is not None and self.value > self.target

    @property
    def well_under(self) -> bool:
        if self.value is None:  # nothing measured (no traffic): no objection to scaling down
            return True
        limit = self.target if self.is_latency else self.target * DOWNSCALE_FRACTION
        return self.value < limit

    def describe(self) -> str:
        value = "n/a" if self.value is None else f"{self.value:.3g}"
        return f"{self.name}={value} (target {self.target:.3g})"


class PoolScalingPolicy(ABC):
    """Shared timing rules; subclasses say which signals a pool has. Stateful: it remembers
    since when the pool has been over / under target and when the cooldown ends."""

    def __init__(self, cfg: AutoscalingConfig):
        self.cfg = cfg
        self._over_since: float | None = None
        self._under_since: float | None = None
        self._cooldown_until = float("-inf")

    @abstractmethod
    def signals(self, snapshot: MetricsSnapshot) -> list[_Signal]:
        """This pool's signals (value against target) in the snapshot."""

    @property
    def cooldown_s(self) -> float:
        return max(self.cfg.upscale_delay_s, self.cfg.interval_s)

    def mark_scaled(self, now: float) -> None:
        """Start the cooldown (decide() calls it on up/down; the autoscaler calls it again
        when the action has finished, since starting or draining replicas takes time)."""
        self._over_since = self._under_since = None
        self._cooldown_until = now + self.cooldown_s

    def decide(self, snapshot: MetricsSnapshot, now: float) -> ScalingDecision:
        cfg = self.cfg
        n = snapshot.num_replicas
        if n < cfg.min_replicas:
            return self._act("up", cfg.min_replicas, f"{n} replicas < min_replicas {cfg.min_replicas}", now)
        if n > cfg.max_replicas:
            return self._act("down", cfg.max_replicas, f"{n} replicas > max_replicas {cfg.max_replicas}", now)
        age = now - snapshot.taken_at
        if age > cfg.metrics_stale_s:
            self._over_since = self._under_since = None
            return ScalingDecision("hold", n, f"metrics stale ({age:.1f} s > {cfg.metrics_stale_s:.1f} s)")
        if now < self._cooldown_until:
            return ScalingDecision("hold", n, f"cooldown ({self._cooldown_until - now:.1f} s left)")
        signals = self.signals(snapshot)
        over = [s for s in signals if s.over]
        under = all(s.well_under for s in signals)
        self._over_since = (self._over_since if self._over_since is not None else now) if over else None
        self._under_since = (self._under_since if self._under_since is not None else now) if under else None
        if over:
            reason = "over target: " + ", ".join(s.describe() for s in over)
            if n >= cfg.max_replicas:
                return ScalingDecision("hold", n, f"{reason}; at max_replicas {cfg.max_replicas}")
            if now - self._over_since >= cfg.upscale_delay_s:
                return self._act("up", min(n + cfg.step, cfg.max_replicas), reason, now)
            return ScalingDecision(
                "hold", n, f"{reason} for {now - self._over_since:.1f} s < upscale_delay_s {cfg.upscale_delay_s:.1f} s"
            )
        if under and n > cfg.min_replicas:
            reason = "well under target: " + ", ".join(s.describe() for s in signals)
            if now - self._under_since >= cfg.downscale_delay_s:
                return self._act("down", max(n - cfg.step, cfg.min_replicas), reason, now)
            return ScalingDecision(
                "hold",
                n,
                f"{reason} for {now - self._under_since:.1f} s < downscale_delay_s {cfg.downscale_delay_s:.1f} s",
            )
        return ScalingDecision("hold", n, "within target: " + ", ".join(s.describe() for s in signals))

    def _act(self, action: Action, target: int, reason: str, now: float) -> ScalingDecision:
        self.mark_scaled(now)
        return ScalingDecision(action, target, reason)


class PrefillScalingPolicy(PoolScalingPolicy):
    """Prefill (compute-bound): queued prefill tokens per replica and TTFT p90."""

    cfg: PrefillAutoscalingConfig

    def __init__(self, cfg: PrefillAutoscalingConfig):
        if not isinstance(cfg, PrefillAutoscalingConfig):
            raise TypeError("PrefillScalingPolicy needs a PrefillAutoscalingConfig")
        super().__init__(cfg)

    def signals(self, snapshot: MetricsSnapshot) -> list[_Signal]:
        return [
            _Signal(
                "queued_tokens_per_replica",
                snapshot.queued_tokens_per_replica,
                self.cfg.target_queued_tokens_per_replica,
            ),
            _Signal("ttft_p90_ms", snapshot.ttft_p90_ms, self.cfg.ttft_target_ms, is_latency=True),
        ]


class DecodeScalingPolicy(PoolScalingPolicy):
    """Decode (memory-bound): KV-block usage, running sequences per replica and ITL p90."""

    cfg: DecodeAutoscalingConfig

    def __init__(self, cfg: DecodeAutoscalingConfig):
        if not isinstance(cfg, DecodeAutoscalingConfig):
            raise TypeError("DecodeScalingPolicy needs a DecodeAutoscalingConfig")
        super().__init__(cfg)

    def signals(self, snapshot: MetricsSnapshot) -> list[_Signal]:
        return [
            _Signal("kv_usage", snapshot.mean_kv_usage, self.cfg.target_kv_usage),
            _Signal("running_per_replica", snapshot.running_per_replica, self.cfg.target_running_per_replica),
            _Signal("itl_p90_ms", snapshot.itl_p90_ms, self.cfg.itl_target_ms, is_latency=True),
        ]


def replica_floor(replicas: int, cfg: AutoscalingConfig) -> int:
    """The fewest replicas a pool serves healthily with: `replicas`, or min_replicas when it
    autoscales. Below it the deployment reports itself degraded."""
    return cfg.min_replicas if cfg.enabled else replicas


def initial_replicas(replicas: int, cfg: AutoscalingConfig) -> int:
    """Replicas a pool starts with: `replicas`, moved into [min, max] when it autoscales."""
    if not cfg.enabled:
        return replicas
    return min(max(replicas, cfg.min_replicas), cfg.max_replicas)
