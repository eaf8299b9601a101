"""A request's priority class and priority: `interactive` (the default) or `batch`, named by
the header x-splitserve-priority-class (gRPC: GenerateRequest.priority_class), and vLLM's
`priority` (lower runs first), which defaults to its class's.

Batch requests are sheddable: they never count toward the interactive 429 limits, and are
admitted only to decode replicas with headroom (ServingBackend.generate)."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.cluster.config import PriorityConfig
from splitserve.proto.messages.invalid_request import InvalidRequestError

PRIORITY_CLASS_HEADER = "x-splitserve-priority-class"
INTERACTIVE, BATCH = "interactive", "batch"
PRIORITY_CLASSES = (INTERACTIVE, BATCH)


@dataclass(frozen=True)
class RequestPriority:
    priority: int  # SamplingParams.priority: what the engines order and preempt by
    sheddable: bool  # batch: admitted only with headroom, outside the interactive limits
    name: str = INTERACTIVE


def resolve_priority(cfg: PriorityConfig, class_name: str | None, explicit: int | None) -> RequestPriority:
    """The request's priority from its class (None: interactive) and its own `priority` field.
    Under policy fcfs every request is equal: priority 0, nothing shed."""
    name = INTERACTIVE if class_name in (None, "") else class_name.strip().lower()
    if name not in PRIORITY_CLASSES:
        raise InvalidRequestError(
            f"the priority class must be one of {', '.join(PRIORITY_CLASSES)}, got {class_name!r}"
        )
    if cfg.policy == "fcfs":
        return RequestPriority(0, False, name)
    default = cfg.batch if name == BATCH else cfg.interactive
    return RequestPriority(default if explicit is None else explicit, name == BATCH, name)
