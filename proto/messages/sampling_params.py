"""Per-request sampling parameters: a msgspec Struct, validated on construction and again when
decoded, that crosses every process boundary as itself (the ingress's Submit, prefill's Handoff)."""

from __future__ import annotations

from typing import Any

import msgspec

from splitserve.proto.messages.continuation import Continuation
from splitserve.proto.messages.grammar_spec import GrammarSpec
from splitserve.proto.messages.invalid_request import InvalidRequestError

GREEDY_TEMPERATURE = 1e-5
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
MAX_TOP_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_LOGIT_BIAS_ENTRIES = 1024
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range: -100 bans a token, +100 makes it (nearly) certain


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True):
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    seed: int | None = None  # same seed -> same tokens, whatever the batch
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False  # return the log-probability of each chosen token
    top_logprobs: int = 0  # with logprobs: also the most likely alternatives, up to MAX_TOP_LOGPROBS
    # Not None: also every prompt token's log-probability given the tokens before it, with this
    # many most likely alternatives per position (completions echo + logprobs; vLLM's prompt_logprobs).
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False  # keep the stop string (or stop token's text) in the text
    # vLLM's penalties: presence/frequency count output tokens, repetition prompt + output tokens.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)  # token id -> added to its logit
    min_tokens: int = 0  # EOS and stop tokens are masked (stop strings ignored) until this many
    # What the output must match (a GrammarSpec; its {"kind", "value"} dict is accepted too).
    structured_output: GrammarSpec | None = None
    # False opts this request out of speculative decoding (where the engine speculates).
    speculative_decoding: bool = True
    # vLLM's priority: lower runs first. Schedulers order waiting work by (priority, arrival)
    # and preempt the highest value first when blocks or batch slots are short.
    priority: int = 0
    # False opts this request out of migration: its stream ends with an error when its decode
    # replica fails mid-stream, instead of going on from another one.
    migration: bool = True
    # Set by the ingress only, on a migrated request's continuation: its prompt ends with the
    # output the client already has (proto/messages/continuation.py).
    continuation: Continuation | None = None
    # The LoRA adapter (by its served name) this request runs with; None: the base model.
    lora_adapter: str | None = None

    def __post_init__(self) -> None:
        self.structured_output = _grammar_spec(self.structured_output)
        self._check_basic()
        self._check_logits_processing()

    def _check_basic(self) -> None:
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
            _check(_is_int(t) and t >= 0, f"stop_token_ids must be non-negative integers, got {t!r}")
        _check(isinstance(self.logprobs, bool), f"logprobs must be a boolean, got {self.logprobs!r}")
        _check(
            _is_int(self.top_logprobs) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
            f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}",
        )
        _check(
            self.prompt_logprobs is None
            or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS),
            f"prompt_logprobs must be None or an integer in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs!r}",
        )
        if self.top_logprobs:
            self.logprobs = True  # alternatives come with the chosen token's own log-probability
        _check(
            _is_int(self.priority) and -(2**31) <= self.priority < 2**31,
            f"priority must be a 32-bit integer (lower runs first), got {self.priority!r}",
        )
        _check(
            isinstance(self.speculative_decoding, bool),
            f"speculative_decoding must be a boolean, got {self.speculative_decoding!r}",
        )
        _check(isinstance(self.migration, bool), f"migration must be a boolean, got {self.migration!r}")
        _check(
            self.lora_adapter is None or (isinstance(self.lora_adapter, str) and 0 < len(self.lora_adapter) <= 256),
            f"lora_adapter must be None or an adapter name of 1 to 256 characters, got {self.lora_adapter!r}",
        )

    def _check_logits_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, f"{name} must be a number in [-2, 2], got {value!r}")
        _check(
            _is_number(self.repetition_penalty) and 0 < self.repetition_penalty < float("inf"),
            f"repetition_penalty must be a finite number > 0 (1 disables it), got {self.repetition_penalty!r}",
        )
        _check(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}",
        )
        self.logit_bias = _normalize_logit_bias(self.logit_bias)

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def processes_logits(self) -> bool:
        """Whether the sampler must change this request's logits before choosing a token."""
        return self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0

    @property
    def num_resumed_tokens(self) -> int:
        """A continuation's output tokens at the end of its prompt (0: not a continuation)."""
        return 0 if self.continuation is None else self.continuation.num_output_tokens

    @property
    def is_greedy(self) -> bool:
        # Below this temperature logits/temperature overflows to inf; the limit is argmax.
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def _grammar_spec(raw: Any) -> GrammarSpec | None:
    if raw is None or isinstance(raw, GrammarSpec):
        return raw
    if not isinstance(raw, dict) or set(raw) - {"kind", "value"} or "kind" not in raw:
        raise InvalidRequestError("structured_output must be {'kind': ..., 'value': ...}")
    return GrammarSpec(raw["kind"], raw.get("value", ""))


def _normalize_logit_bias(raw: Any) -> dict[int, float]:
    """{token id: bias} from a dict (int or decimal-string keys) or [token id, bias] pairs;
    biases are clamped to [-100, 100] as OpenAI and vLLM do."""
    if raw is None:
        return {}
    if isinstance(raw, dict):
        items = list(raw.items())
    elif isinstance(raw, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in raw):
        items = [tuple(p) for p in raw]
    else:
        raise InvalidRequestError("logit_bias must map token ids to numbers")
    _check(len(items) <= MAX_LOGIT_BIAS_ENTRIES, f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries")
    bias: dict[int, float] = {}
    for token, value in items:
        if isinstance(token, str) and token.strip().isdigit():
            token = int(token)
        _check(_is_int(token) and token >= 0, f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
        _check(
            _is_number(value) and abs(value) != float("inf"),
            f"logit_bias values must be finite numbers, got {value!r} for token {token}",
        )
        bias[token] = float(min(max(value, -LOGIT_BIAS_LIMIT), LOGIT_BIAS_LIMIT))
    return bias


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message)
