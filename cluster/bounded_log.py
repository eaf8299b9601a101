"""BoundedLog: a list that keeps only its newest `maxlen` entries, for the event logs a
long-running process appends to forever (the controller's replica events, the autoscaler's
actions). A list, not a deque, so readers keep slicing it (`events[n:]`)."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


class BoundedLog(list[T]):
    def __init__(self, maxlen: int):
        if maxlen < 1:
            raise ValueError(f"maxlen must be >= 1, got {maxlen}")
        super().__init__()
        self.maxlen = maxlen

    def append(self, item: T) -> None:
        """Add item as the newest entry; past maxlen the oldest goes."""
        super().append(item)
        if len(self) > self.maxlen:
            del self[: len(self) - self.maxlen]
