"""AttemptFailure: what a failed attempt means to the dispatcher's retry (before a chunk reached
the caller): which replica a retry avoids, whether it uses up retry budget (a dead replica is
not the request's fault), and the error kind when it gives up. A failure after chunks streamed
may move the stream instead (stream_migration.py)."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.cluster.ingress.request_channel_client import ChannelClosed
from splitserve.cluster.request_error import ErrorKind
from splitserve.cluster.routing.replica_pools import DECODE, PREFILL
from splitserve.proto.messages.request_channel import Failed, FailureKind

# A replica's failure: (the pool whose replica a retry avoids -- None: no retry helps --,
# whether the retry costs budget, the kind when giving up).
_RETRY: dict[FailureKind, tuple[str | None, bool, ErrorKind]] = {
    FailureKind.PREFILL_FAILED: (PREFILL, True, ErrorKind.INTERNAL),
    FailureKind.PREFILL_TIMEOUT: (PREFILL, True, ErrorKind.UNAVAILABLE),
    FailureKind.PREFILL_DEAD: (PREFILL, False, ErrorKind.UNAVAILABLE),
    FailureKind.BUSY: (DECODE, True, ErrorKind.UNAVAILABLE),
    FailureKind.REPLICA_DEAD: (DECODE, False, ErrorKind.UNAVAILABLE),
    FailureKind.REPLICA_DRAINING: (DECODE, False, ErrorKind.UNAVAILABLE),
    FailureKind.INVALID: (None, True, ErrorKind.INVALID),
    FailureKind.STEP_FAILED: (None, True, ErrorKind.INTERNAL),
    FailureKind.INTERNAL: (None, True, ErrorKind.INTERNAL),
}


@dataclass(frozen=True)
class AttemptFailure:
    avoid: str | None  # the pool whose replica a retry avoids
    costs_budget: bool
    give_up_kind: ErrorKind
    retryable: bool
    message: str

    @classmethod
    def of(cls, failure: Failed | ChannelClosed) -> AttemptFailure:
        """The replica's Failed, or the channel to the decode replica broken (it died, most likely)."""
        if isinstance(failure, Failed):
            avoid, costs_budget, give_up_kind = _RETRY[failure.kind]
            return cls(avoid, costs_budget, give_up_kind, failure.retryable and avoid is not None, failure.message)
        return cls(DECODE, False, ErrorKind.UNAVAILABLE, True, str(failure))
