"""BatchHeadroom: the router's policy for sheddable (batch) work. A decode replica takes it only
while below both thresholds -- KV usage as it last reported, and running requests including those
routed since -- so batch work fills spare capacity and never the room interactive work needs.
With none below them the router refuses (NoHeadroomError): the frontend answers 429 and the
Batch API runner tries the line again later."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.cluster.routing.load import ReplicaLoad

UNBOUNDED = 2**31


@dataclass(frozen=True)
class BatchHeadroom:
    max_kv_usage: float = float("inf")  # a fraction of the replica's KV blocks in use
    max_running: int = UNBOUNDED  # running requests on the replica

    def admits(self, load: ReplicaLoad) -> bool:
        return load.report.kv_usage < self.max_kv_usage and load.effective_running < self.max_running
