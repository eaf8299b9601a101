"""The windows limits are counted in: the UTC minute (requests/tokens per minute), and the UTC
day or month (budgets). Fixed windows, so every ingress replica and the state store agree on
a window by its start, and `reset` / Retry-After is the time to the window's end."""

from __future__ import annotations

import datetime as dt

REQUESTS, TOKENS, BUDGET = "requests", "tokens", "budget"
MINUTE = 60


def window_bounds(kind: str, period: str, now: float) -> tuple[int, int]:
    """(start, end) in epoch seconds of the window containing now."""
    if kind != BUDGET:
        start = int(now // MINUTE) * MINUTE
        return start, start + MINUTE
    day = dt.datetime.fromtimestamp(now, dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        return int(day.timestamp()), int((day + dt.timedelta(days=1)).timestamp())
    month = day.replace(day=1)
    following = (month + dt.timedelta(days=32)).replace(day=1)
    return int(month.timestamp()), int(following.timestamp())


def hour_start(now: float) -> int:
    return int(now // 3600) * 3600
