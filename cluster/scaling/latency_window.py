"""A sliding window of recent latency samples, for the autoscaler (Prometheus histograms
are cumulative since start, so they cannot say what the latency is *now*)."""

from __future__ import annotations

import math
import threading
import time
from collections import deque


class LatencyWindow:
    def __init__(self, window_s: float = 10.0, max_samples: int = 4096):
        if window_s <= 0:
            raise ValueError("window_s must be > 0")
        if max_samples < 1:
            raise ValueError("max_samples must be >= 1")
        self.window_s = window_s
        # Bounded: under heavy load only the newest samples count, memory stays flat.
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self._lock = threading.Lock()

    def observe(self, seconds: float, now: float | None = None) -> None:
        with self._lock:
            self._samples.append((time.monotonic() if now is None else now, seconds))

    def percentile_ms(self, q: float, since: float | None = None, now: float | None = None) -> float | None:
        """The q-th percentile (nearest rank) in ms of samples newer than both the window and
        `since` (monotonic seconds); None when there are none."""
        if not 0 < q <= 100:
            raise ValueError("q must be in (0, 100]")
        now = time.monotonic() if now is None else now
        start = now - self.window_s if since is None else max(now - self.window_s, since)
        with self._lock:
            while self._samples and self._samples[0][0] < now - self.window_s:
                self._samples.popleft()
            values = sorted(v for t, v in self._samples if t >= start)
        if not values:
            return None
        return values[max(math.ceil(q / 100 * len(values)) - 1, 0)] * 1000.0

    def __len__(self) -> int:
        return len(self._samples)
