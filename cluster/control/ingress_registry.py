"""IngressRegistry: the ingress replicas the controller has heard from, what membership
version each has applied and what each still has in flight per replica.

An ingress is live while it keeps calling (its MembershipFollower does, every fraction of a
second); one silent for timeout_s is gone (killed, or scaled down by Serve): drains stop
waiting for it and its metrics are retired.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class IngressState:
    ingress_id: str
    last_seen: float
    applied_version: int = -1
    # replica id -> requests still needing it, as of applied_version (one report: consistent)
    inflight: dict[str, int] = field(default_factory=dict)


class IngressRegistry:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._ingresses: dict[str, IngressState] = {}

    def seen(self, ingress_id: str, applied_version: int, inflight: dict[str, int] | None, now: float) -> None:
        state = self._ingresses.get(ingress_id)
        if state is None:
            state = self._ingresses[ingress_id] = IngressState(ingress_id, now)
        state.last_seen, state.applied_version = now, applied_version
        if inflight is not None:
            state.inflight = inflight

    def live(self, now: float) -> list[IngressState]:
        return [s for s in self._ingresses.values() if now - s.last_seen <= self.timeout_s]

    def expire(self, now: float) -> list[str]:
        """Forget the ingresses silent for timeout_s; returns their ids."""
        gone = [i for i, s in self._ingresses.items() if now - s.last_seen > self.timeout_s]
        for ingress_id in gone:
            del self._ingresses[ingress_id]
        return gone

    def all_applied(self, version: int, now: float) -> bool:
        """Every live ingress routes by `version` or a later view."""
        return all(s.applied_version >= version for s in self.live(now))

    def num_inflight(self, replica_id: str, now: float) -> int:
        """Requests the live ingresses still have on a replica (as of their last report)."""
        return sum(s.inflight.get(replica_id, 0) for s in self.live(now))
