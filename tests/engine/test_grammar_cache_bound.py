"""The memory bound of issue #28, cheaply: under a stream of distinct grammars (each a cache
miss, what a hostile or churning workload sends) the replicas' compiled-grammar cache and the
ingress's verdict cache stop at grammar.cache_size, their metrics say so, and past that bound
this process's RSS stops growing (bench/results/hostile_input.md runs the 30-minute version)."""

from __future__ import annotations

import psutil
import pytest

from splitserve.bench.serving.json_schemas import SCHEMAS
from splitserve.engine.io.tokenizer import Tokenizer
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.structured_output.grammar_compiler import GrammarCompiler
from splitserve.engine.structured_output.grammar_config import GrammarConfig
from splitserve.engine.structured_output.isolated_grammar_checker import IsolatedGrammarChecker
from splitserve.proto.messages.grammar_spec import GrammarSpec

CACHE_SIZE = 16
BEYOND = 20 * CACHE_SIZE  # distinct grammars compiled after the cache is full


@pytest.fixture(scope="module")
def model_facts(tiny_model):
    tokenizer = Tokenizer.from_pretrained(tiny_model)
    config = ModelConfig.from_pretrained(tiny_model)
    return tokenizer.to_json(), config.vocab_size, tokenizer.eos_token_ids or config.eos_token_ids


def distinct_schema(i: int) -> GrammarSpec:
    """A JSON schema no other i gives: a cache miss every time."""
    base = list(SCHEMAS.values())[i % len(SCHEMAS)]
    properties = {**base.get("properties", {}), f"extra_{i}": {"type": "integer"}}
    return GrammarSpec.json_schema({**base, "title": f"distinct-{i}", "properties": properties})


def rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20


def test_the_compiled_grammar_cache_and_rss_stop_growing_at_the_bound(model_facts):
    compiler = GrammarCompiler(*model_facts, config=GrammarConfig(cache_size=CACHE_SIZE))
    _ = compiler.tokenizer  # built once, before the first measurement
    start = rss_mib()
    for i in range(CACHE_SIZE):
        compiler.new_matcher(distinct_schema(i))  # what a request does: compile, then a matcher
    full = rss_mib()
    for i in range(CACHE_SIZE, CACHE_SIZE + BEYOND):
        compiler.new_matcher(distinct_schema(i))
        assert compiler.stats()["grammar_cache_entries"] <= CACHE_SIZE
    end = rss_mib()
    stats = compiler.stats()
    assert stats["grammar_cache_entries"] == CACHE_SIZE  # the metric splitserve_grammar_cache_entries_replica
    assert stats["grammar_compiles"] == CACHE_SIZE + BEYOND and stats["grammar_cache_hits"] == 0
    # 20x as many grammars past the bound cost less memory than the ones that filled the cache
    # (an unbounded cache grows ~linearly: 20x the fill's growth).
    assert end - full < max(full - start, 1.0), (start, full, end)
    # The oldest were evicted (compiled again), the newest are hits.
    compiler.compile(distinct_schema(0))
    compiler.compile(distinct_schema(CACHE_SIZE + BEYOND - 1))
    assert compiler.stats()["grammar_compiles"] == CACHE_SIZE + BEYOND + 1
    assert compiler.stats()["grammar_cache_hits"] == 1


def test_the_ingress_verdict_cache_stops_at_the_bound(model_facts):
    checker = IsolatedGrammarChecker(*model_facts, GrammarConfig(cache_size=CACHE_SIZE, compile_workers=1))
    try:
        total = 3 * CACHE_SIZE
        for i in range(total):
            checker.check(distinct_schema(i))
            assert checker.stats()["entries"] <= CACHE_SIZE
        stats = checker.stats()
        # entries: the metric splitserve_grammar_verdict_cache_entries
        assert stats["entries"] == CACHE_SIZE and stats["misses"] == total and stats["hits"] == 0
        checker.check(distinct_schema(0))  # evicted: compiled again
        checker.check(distinct_schema(total - 1))  # kept: a hit
        assert checker.stats()["misses"] == total + 1 and checker.stats()["hits"] == 1
    finally:
        checker.close()
