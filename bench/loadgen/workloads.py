"""Seeded synthetic workloads: prefix repetition, multi-turn chat, mixed long/short prompts.

Every generator is a frozen dataclass (checked in __post_init__) whose `generate(seed)` returns
the same list of BenchRequest for the same seed. Prompts are token ids drawn uniformly from the
caller's vocab range; arrival offsets are left at 0 and assigned by splitserve.bench.loadgen.arrivals. The Mooncake
trace replay lives in splitserve.bench.loadgen.trace_workload.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from splitserve.bench.loadgen.records import BenchRequest, WorkloadError

WORKLOAD_KINDS: tuple[str, ...] = ("prefix-repetition", "multi-turn", "mixed", "trace", "quote")


@dataclass(frozen=True)
class VocabRange:
    """Token ids are drawn from [low, high); keep it inside the served model's vocabulary and
    away from special tokens (which usually sit at the very start or end)."""

    low: int = 1000
    high: int = 30000

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.high:
            raise WorkloadError(f"vocab range needs 0 <= low < high, got [{self.low}, {self.high})")

    @classmethod
    def parse(cls, text: str) -> VocabRange:
        """'LOW:HIGH' (high exclusive)."""
        low, sep, high = text.partition(":")
        if not sep:
            raise WorkloadError(f"vocab range must look like LOW:HIGH, got {text!r}")
        try:
            return cls(int(low), int(high))
        except ValueError as exc:
            raise WorkloadError(f"vocab range must be integers LOW:HIGH, got {text!r}") from exc

    @property
    def size(self) -> int:
        return self.high - self.low

    def sample(self, rng: np.random.Generator, num_tokens: int) -> list[int]:
        return rng.integers(self.low, self.high, size=num_tokens).tolist()

    def sample_distinct(self, rng: np.random.Generator, num_tokens: int) -> list[int]:
        """Distinct ids, used as first tokens so sibling prompts diverge at a known position."""
        if num_tokens > self.size:
            raise WorkloadError(f"need {num_tokens} distinct token ids but the vocab range has {self.size}")
        return (rng.choice(self.size, size=num_tokens, replace=False) + self.low).tolist()


class Workload(Protocol):
    kind: str

    def generate(self, seed: int) -> list[BenchRequest]: ...

    def describe(self) -> dict[str, Any]: ...


def _describe(workload: Any) -> dict[str, Any]:
    return {"kind": workload.kind, **dataclasses.asdict(workload)}


@dataclass(frozen=True)
class PrefixRepetitionWorkload:
    """`num_prefixes` shared prefixes x `suffixes_per_prefix` unique suffixes each.

    Requests of one group share exactly `prefix_len` leading tokens: suffix first tokens are
    distinct within a group and prefix first tokens are distinct across groups.
    """

    num_prefixes: int = 4
    prefix_len: int = 512
    suffixes_per_prefix: int = 8
    suffix_len: int = 64
    max_tokens: int = 128
    vocab: VocabRange = VocabRange()
    shuffle: bool = True
    kind: str = dataclasses.field(default="prefix-repetition", init=False)

    def __post_init__(self) -> None:
        for name in ("num_prefixes", "prefix_len", "suffixes_per_prefix", "suffix_len", "max_tokens"):
            if getattr(self, name) < 1:
                raise WorkloadError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.vocab.size < max(self.num_prefixes, self.suffixes_per_prefix):
            raise WorkloadError("vocab range is smaller than num_prefixes or suffixes_per_prefix")

    def generate(self, seed: int) -> list[BenchRequest]:
        rng = np.random.default_rng(seed)
        prefix_firsts = self.vocab.sample_distinct(rng, self.num_prefixes)
        requests = []
        for p in range(self.num_prefixes):
            prefix = [prefix_firsts[p]] + self.vocab.sample(rng, self.prefix_len - 1)
            suffix_firsts = self.vocab.sample_distinct(rng, self.suffixes_per_prefix)
            for s in range(self.suffixes_per_prefix):
                suffix = [suffix_firsts[s]] + self.vocab.sample(rng, self.suffix_len - 1)
                requests.append(
                    BenchRequest(
                        request_id=f"prefix{p}-suffix{s}",
                        prompt_token_ids=tuple(prefix + suffix),
                        max_tokens=self.max_tokens,
                        group_id=f"prefix{p}",
                    )
                )
        if self.shuffle:
            requests = [requests[i] for i in rng.permutation(len(requests))]
        return requests

    def describe(self) -> dict[str, Any]:
        return _describe(self)


@dataclass(frozen=True)
class MultiTurnWorkload:
    """Conversations whose prompt grows each turn.

    Turn 0 is `first_turn_len` tokens; turn k's prompt is turn k-1's prompt + a `max_tokens`-long
    stand-in for the previous answer + `user_turn_len` new user tokens. Each turn depends on the
    previous one (the client sends it only after that one finished). Requests are ordered turn by
    turn across conversations, so a closed-loop client never waits on an unsent request.
    """

    num_conversations: int = 8
    num_turns: int = 4
    first_turn_len: int = 256
    user_turn_len: int = 64
    max_tokens: int = 128
    vocab: VocabRange = VocabRange()
    kind: str = dataclasses.field(default="multi-turn", init=False)

    def __post_init__(self) -> None:
        for name in ("num_conversations", "num_turns", "first_turn_len", "user_turn_len", "max_tokens"):
            if getattr(self, name) < 1:
                raise WorkloadError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.vocab.size < self.num_conversations:
            raise WorkloadError("vocab range is smaller than num_conversations")

    def prompt_len(self, turn_index: int) -> int:
        return self.first_turn_len + turn_index * (self.max_tokens + self.user_turn_len)

    def generate(self, seed: int) -> list[BenchRequest]:
        rng = np.random.default_rng(seed)
        firsts = self.vocab.sample_distinct(rng, self.num_conversations)
        by_turn: list[list[BenchRequest]] = [[] for _ in range(self.num_turns)]
        for c in range(self.num_conversations):
            prompt = [firsts[c]] + self.vocab.sample(rng, self.first_turn_len - 1)
            previous_id = None
            for turn in range(self.num_turns):
                if turn > 0:
                    prompt = prompt + self.vocab.sample(rng, self.max_tokens + self.user_turn_len)
                request = BenchRequest(
                    request_id=f"conv{c}-turn{turn}",
                    prompt_token_ids=tuple(prompt),
                    max_tokens=self.max_tokens,
                    group_id=f"conv{c}",
                    conversation_id=f"conv{c}",
                    turn_index=turn,
                    depends_on=previous_id,
                )
                by_turn[turn].append(request)
                previous_id = request.request_id
        return [request for turn_requests in by_turn for request in turn_requests]

    def describe(self) -> dict[str, Any]:
        return _describe(self)


@dataclass(frozen=True)
class MixedLengthWorkload:
    """`num_requests` prompts of which round(long_fraction * num_requests) (at least one when the
    fraction is > 0) are long. Lengths are uniform in [len*(1-jitter), len*(1+jitter)]."""

    num_requests: int = 100
    short_len: int = 128
    long_len: int = 4096
    long_fraction: float = 0.05
    length_jitter: float = 0.25
    max_tokens: int = 128
    vocab: VocabRange = VocabRange()
    kind: str = dataclasses.field(default="mixed", init=False)

    def __post_init__(self) -> None:
        for name in ("num_requests", "short_len", "long_len", "max_tokens"):
            if getattr(self, name) < 1:
                raise WorkloadError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise WorkloadError(f"long_fraction must be in [0, 1], got {self.long_fraction}")
        if not 0.0 <= self.length_jitter < 1.0:
            raise WorkloadError(f"length_jitter must be in [0, 1), got {self.length_jitter}")

    @property
    def num_long(self) -> int:
        if self.long_fraction == 0.0:
            return 0
        return max(1, round(self.long_fraction * self.num_requests))

    def length_bounds(self, nominal: int) -> tuple[int, int]:
        low = max(1, round(nominal * (1.0 - self.length_jitter)))
        return low, max(low, round(nominal * (1.0 + self.length_jitter)))

    def generate(self, seed: int) -> list[BenchRequest]:
        rng = np.random.default_rng(seed)
        long_positions = set(rng.choice(self.num_requests, size=self.num_long, replace=False).tolist())
        requests = []
        for i in range(self.num_requests):
            is_long = i in long_positions
            low, high = self.length_bounds(self.long_len if is_long else self.short_len)
            length = int(rng.integers(low, high + 1))
            requests.append(
                BenchRequest(
                    request_id=f"mixed{i}-{'long' if is_long else 'short'}",
                    prompt_token_ids=tuple(self.vocab.sample(rng, length)),
                    max_tokens=self.max_tokens,
                    group_id="long" if is_long else "short",
                )
            )
        return requests

    def describe(self) -> dict[str, Any]:
        return _describe(self)
