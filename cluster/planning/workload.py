"""The planner's workload: requests as (arrival second, input tokens, output tokens), from an
arrival rate and two length distributions, or from a Mooncake-style JSONL trace.

A length is `fixed` ("512": every request 512 tokens) or `mean±spread` ("512+-128" or
"512±128": uniform over mean-spread .. mean+spread, integers). Arrivals at a rate are a Poisson
process (exponential gaps), seeded, so one workload is the same for every configuration the
planner compares. A trace line holds `timestamp` (ms), `input_length` and `output_length`
(bench/loadgen/trace_workload.py replays the same files against a server; only these three
fields matter here).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from splitserve.engine.config import ConfigError

_LENGTH = re.compile(r"^\s*(\d+)\s*(?:(?:\+-|±)\s*(\d+))?\s*$")


@dataclass(frozen=True)
class LengthDistribution:
    mean: int
    spread: int = 0

    @classmethod
    def parse(cls, text: str, what: str) -> LengthDistribution:
        match = _LENGTH.match(text)
        if not match:
            raise ConfigError(f"{what} {text!r}: give a token count (512) or mean+-spread (512+-128)")
        mean, spread = int(match.group(1)), int(match.group(2) or 0)
        if mean < 1 or spread >= mean:
            raise ConfigError(f"{what} {text!r}: the mean must be >= 1 and the spread below it")
        return cls(mean, spread)

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.mean - self.spread, self.mean + self.spread) if self.spread else self.mean

    def __str__(self) -> str:
        return f"{self.mean}+-{self.spread}" if self.spread else str(self.mean)


@dataclass(frozen=True)
class PlannedRequest:
    arrival_s: float
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Workload:
    requests: tuple[PlannedRequest, ...]
    description: str

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    @property
    def rate(self) -> float:
        """Mean arrival rate (req/s)."""
        return (len(self.requests) - 1) / self.duration_s if self.duration_s > 0 else float("inf")

    @property
    def max_total_tokens(self) -> int:
        return max(r.input_tokens + r.output_tokens for r in self.requests)

    @classmethod
    def poisson(
        cls,
        rate: float,
        input_len: LengthDistribution,
        output_len: LengthDistribution,
        num_requests: int,
        seed: int = 0,
    ) -> Workload:
        if not rate > 0:
            raise ConfigError(f"the arrival rate must be > 0 req/s, got {rate}")
        if num_requests < 1:
            raise ConfigError(f"the number of requests must be >= 1, got {num_requests}")
        rng = random.Random(seed)
        t, requests = 0.0, []
        for _ in range(num_requests):
            requests.append(PlannedRequest(t, input_len.draw(rng), output_len.draw(rng)))
            t += rng.expovariate(rate)
        described = f"Poisson {rate:g} req/s, input {input_len}, output {output_len} tokens, {num_requests} requests"
        return cls(tuple(requests), described)

    @classmethod
    def from_trace(cls, path: str | Path, speedup: float = 1.0) -> Workload:
        """A JSONL trace; arrivals relative to the first, divided by speedup. An empty or bad
        trace is a one-line ConfigError."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"trace {path}: no such file")
        rows = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                rows.append((float(row.get("timestamp", 0)), int(row["input_length"]), int(row["output_length"])))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise ConfigError(f"trace {path}:{number}: bad line ({exc!r})") from None
            if rows[-1][1] < 1 or rows[-1][2] < 1:
                raise ConfigError(f"trace {path}:{number}: input_length and output_length must be >= 1")
        if not rows:
            raise ConfigError(f"trace {path} has no requests")
        rows.sort()
        start = rows[0][0]
        requests = tuple(PlannedRequest((ms - start) / 1000 / speedup, i, o) for ms, i, o in rows)
        return cls(requests, f"trace {path.name} ({len(requests)} requests)")
