"""Per-request sampling parameters, validated on construction and msgpack-friendly."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

GREEDY_TEMPERATURE = 1e-5
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256


class InvalidRequestError(ValueError):
    """The caller asked for something the engine cannot do; the message says what."""


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    seed: int | None = None  # same seed -> same tokens, whatever the batch
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False  # return the log-probability of each chosen token
    include_stop_str_in_output: bool = False
    # A GrammarSpec (engine/sample/grammar_spec.py) the output must match; a dict on the wire.
    structured_output: Any = None

    def __post_init__(self) -> None:
        if self.structured_output is not None:
            from splitserve.engine.sample.grammar_spec import GrammarSpec  # it imports this module

            self.structured_output = GrammarSpec.from_dict(self.structured_output)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(
            isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool) and self.max_tokens >= 1,
            f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
        )
        _check(
            _is_number(self.temperature) and 0 <= self.temperature <= 100,
            f"temperature must be a number in [0, 100], got {self.temperature!r}",
        )
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(
            isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= -1,
            f"top_k must be an integer >= 0 (0 or -1 disables), got {self.top_k!r}",
        )
        if self.top_k == -1:
            self.top_k = 0
        _check(
            self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
            f"seed must be an integer in [0, 2**63), got {self.seed!r}",
        )
        _check(len(self.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        for s in self.stop:
            _check(
                isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS,
                f"each stop string must be a non-empty string of at most {MAX_STOP_STRING_CHARS} characters",
            )
        for t in self.stop_token_ids:
            _check(isinstance(t, int) and t >= 0, f"stop_token_ids must be non-negative integers, got {t!r}")

    @property
    def is_greedy(self) -> bool:
        # Below this temperature logits/temperature overflows to inf; the limit is argmax.
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SamplingParams:
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise InvalidRequestError(f"unknown sampling parameters: {sorted(unknown)}")
        try:
            return cls(**raw)
        except TypeError as exc:
            raise InvalidRequestError(str(exc)) from None


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message)
