"""Compiles GrammarSpecs with llguidance, once per distinct spec (an LRU cache), and hands out
fresh per-request matchers.

Why llguidance and not xgrammar: bench/results/grammar_mask_cost.md. In short, xgrammar's
masks are cheaper to compute on this machine, but its JSON-schema strings with minLength /
maxLength admit raw control characters and broken UTF-8 (an open upstream bug), so outputs
are not valid by construction; llguidance's were valid in every run, and its mask cost is
hidden behind the model's forward pass (engine/structured_output/grammar_mask.py).

Thread-safe: workers compile on a worker thread, never on the engine loop thread (llguidance
drops the GIL while it builds a grammar, so the loop keeps stepping).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future

from splitserve.engine.structured_output.grammar_config import GrammarConfig
from splitserve.engine.structured_output.grammar_limits import check_limits
from splitserve.engine.structured_output.grammar_matcher import GrammarMatcher
from splitserve.proto.messages.grammar_spec import GrammarSpec
from splitserve.proto.messages.invalid_request import InvalidRequestError

DEFAULT_CACHE_SIZE = GrammarConfig().cache_size
# Compact JSON: a free-whitespace grammar would let a weak model emit whitespace forever.
_JSON_OPTIONS = {"whitespace_flexible": False}
_GBNF_RULE = re.compile(r"^\s*[A-Za-z_][\w-]*\s*::=", re.MULTILINE)


def grammar_source(spec: GrammarSpec) -> str:
    """The llguidance grammar (its JSON form) for a spec. Raises InvalidRequestError."""
    import llguidance

    matcher = llguidance.LLMatcher
    if spec.kind == "json_schema":
        return matcher.grammar_from_json_schema(spec.value, overrides=_JSON_OPTIONS)
    if spec.kind == "json_object":
        return matcher.grammar_from_json_schema({"type": "object"}, overrides=_JSON_OPTIONS)
    if spec.kind == "regex":
        return matcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        # JSON string literals are valid Lark literals (same escapes).
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choices()))
    text = spec.value
    if _GBNF_RULE.search(text):  # GBNF / xgrammar-style EBNF (`root ::= ...`), as vLLM accepts
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            text = gbnf_to_lark(text)
        except Exception as exc:  # its parser raises several types
            raise InvalidRequestError(f"invalid grammar: {exc}") from None
    return matcher.grammar_from_lark(text)


def compile_grammar(spec: GrammarSpec, tokenizer):
    """The compiled, never-advanced llguidance matcher for spec. Raises InvalidRequestError
    for an invalid spec, and for one no output can satisfy: llguidance compiles an empty
    language (`{"$ref": "#"}`, `[^\\s\\S]`) and only fails at the first mask, which would
    end the request with an empty, broken output; probing that mask here refuses it."""
    import llguidance

    try:
        source = grammar_source(spec)
    except ValueError as exc:  # llguidance's "not a valid JSON object" and ours
        raise InvalidRequestError(f"invalid {spec.kind}: {exc}") from None
    limits = llguidance.LLParserLimits(verbose_errors=False)
    error = llguidance.LLMatcher.validate_grammar(source, tokenizer, limits=limits)
    if error:
        raise InvalidRequestError(f"invalid {_describe(spec)}: {error.strip()}")
    compiled = llguidance.LLMatcher(tokenizer, source, log_level=0, limits=limits)
    if compiled.is_error():
        raise InvalidRequestError(f"invalid {_describe(spec)}: {compiled.get_error().strip()}")
    probe = compiled.deep_copy()
    probe.compute_bitmask()
    if probe.is_error():
        raise InvalidRequestError(f"the {_describe(spec)} can never be satisfied: no output matches it")
    return compiled


class GrammarCompiler:
    """One per process and tokenizer. compile() is the expensive part; new_matcher() is cheap
    for a cached spec (a copy of the compiled, never-advanced matcher)."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: list[int],
        cache_size: int | None = None,
        config: GrammarConfig | None = None,
    ):
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.config = config or GrammarConfig()
        self.cache_size = cache_size or self.config.cache_size
        self._tokenizer = None
        self._cache: OrderedDict[GrammarSpec, object] = OrderedDict()
        self._inflight: dict[GrammarSpec, Future] = {}  # concurrent requests share one compile
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()
        self.num_compiles = 0
        self.num_cache_hits = 0
        self.num_refused = 0  # over a limit, invalid, or unsatisfiable
        self.compile_seconds = 0.0

    @property
    def tokenizer(self):
        """The llguidance tokenizer (built on first use: ~1 s for a 128k vocabulary)."""
        if self._tokenizer is None:
            with self._tokenizer_lock:
                if self._tokenizer is None:
                    import llguidance

                    self._tokenizer = llguidance.LLTokenizer(
                        self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self.eos_token_ids
                    )
        return self._tokenizer

    def compile(self, spec: GrammarSpec):
        """The compiled grammar for spec (cached). Raises InvalidRequestError with the
        grammar engine's message when the schema, regex or grammar is invalid."""
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                self.num_cache_hits += 1
                return compiled
            pending = self._inflight.get(spec)
            if pending is None:
                pending = self._inflight[spec] = Future()
                owner = True
            else:
                owner = False
        if not owner:
            return pending.result()  # the same grammar, or the same InvalidRequestError
        try:
            compiled = self._build(spec)
            pending.set_result(compiled)
            return compiled
        except BaseException as exc:
            pending.set_exception(exc)
            raise
        finally:
            with self._lock:
                self._inflight.pop(spec, None)

    def _build(self, spec: GrammarSpec):
        start = time.perf_counter()
        try:
            # The static bounds first: past them llguidance's native code may crash the process.
            check_limits(spec, self.config)
            compiled = compile_grammar(spec, self.tokenizer)
        except InvalidRequestError:
            with self._lock:
                self.num_refused += 1
            raise
        elapsed = time.perf_counter() - start
        with self._lock:
            self.num_compiles += 1
            self.compile_seconds += elapsed
            self._cache[spec] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def new_matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        compiled = self.compile(spec)
        with self._lock:  # copying reads the template; keep it away from a concurrent copy
            return GrammarMatcher(compiled.deep_copy(), self.vocab_size)

    def stats(self) -> dict[str, float]:
        return {
            "grammar_compiles": self.num_compiles,
            "grammar_cache_hits": self.num_cache_hits,
            "grammar_cache_entries": len(self._cache),
            "grammar_refused": self.num_refused,
            "grammar_compile_seconds": self.compile_seconds,
        }


def _describe(spec: GrammarSpec) -> str:
    return {"json_schema": "JSON schema", "json_object": "JSON object grammar"}.get(spec.kind, spec.kind)
