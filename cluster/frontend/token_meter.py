"""Per-request token metrics, recorded in batches: a streamed request yields one chunk per
engine step, and updating the ITL histogram and the token counter for each (three locks
and a bucket scan per token) was a measurable share of the ingress's CPU per token. A
TokenMeter keeps them and records them every FLUSH_TOKENS tokens and when the request ends,
so /metrics lags a stream by at most that many tokens. The controller's ITL samples (the
IngressReporter's, for the autoscaler's window) stay one per chunk, handed over in the same
batches, so each is stamped at most that many tokens late."""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter

from splitserve.cluster.frontend.metrics import Metrics
from splitserve.cluster.ingress.ingress_reporter import IngressReporter

FLUSH_TOKENS = 32


def observe_many(histogram, values: list[float]) -> None:
    """histogram.observe(v) for every v, as one update per bucket touched (prometheus_client
    has no batch observe: this does what its Histogram.observe does -- the sum, then the
    first bucket whose upper bound is >= the value -- with its child's value holders)."""
    histogram._raise_if_not_observable()
    for bucket, count in Counter(bisect_left(histogram._upper_bounds, v) for v in values).items():
        histogram._buckets[bucket].inc(count)
    histogram._sum.inc(sum(values))


class TokenMeter:
    """The generated tokens and inter-token gaps of one request, not yet recorded."""

    def __init__(self, metrics: Metrics, reporter: IngressReporter | None = None):
        """reporter: also gets one gap per chunk (None: the request is not reported)."""
        self.metrics = metrics
        self.reporter = reporter
        self.num_tokens = 0
        self.itl: list[float] = []  # one gap per token after the first chunk
        self.chunk_gaps: list[float] = []  # the reporter's: one per chunk after the first

    def add(self, num_tokens: int, gap: float | None) -> None:
        """A chunk of num_tokens tokens; gap: seconds per token since the previous chunk
        (None for the first chunk, whose latency is the TTFT)."""
        self.num_tokens += num_tokens
        if gap is not None and num_tokens:
            self.itl.extend([gap] * num_tokens)
            if self.reporter is not None:
                self.chunk_gaps.append(gap)
        if self.num_tokens >= FLUSH_TOKENS:
            self.flush()

    def flush(self) -> None:
        if self.num_tokens:
            self.metrics.generation_tokens.inc(self.num_tokens)
            self.num_tokens = 0
        if self.itl:
            observe_many(self.metrics.itl, self.itl)
            self.itl = []
        if self.chunk_gaps and self.reporter is not None:
            self.reporter.observe_itls(self.chunk_gaps)
            self.chunk_gaps = []
