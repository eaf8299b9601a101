"""Grammar bounds before llguidance (engine/structured_output/grammar_limits.py, schema_satisfiable.py),
the compiler's empty-language refusal, and the ingress's isolated compile pool: a worker
that really dies (os.abort) costs one request, the pool recovers, this process lives on."""

from __future__ import annotations

import os

import pytest

from splitserve.engine.io.tokenizer import Tokenizer
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.structured_output.grammar_compiler import GrammarCompiler
from splitserve.engine.structured_output.grammar_config import GrammarConfig
from splitserve.engine.structured_output.grammar_limits import (
    GrammarLimitError,
    check_limits,
    reference_depth,
    regex_repeat_bound,
)
from splitserve.engine.structured_output.grammar_worker import CRASH_MARKER_ENV
from splitserve.engine.structured_output.isolated_grammar_checker import IsolatedGrammarChecker
from splitserve.engine.structured_output.schema_satisfiable import unsatisfiable_reason
from splitserve.proto.messages.grammar_spec import GrammarSpec
from splitserve.proto.messages.invalid_request import InvalidRequestError
from tests.helpers.hostile_cases import deep_gbnf_chain, deep_json, hostile_constraints

CONFIG = GrammarConfig()


@pytest.mark.parametrize("name", list(hostile_constraints()))
def test_hostile_constraints_are_refused_naming_the_limit(name):
    spec, word = hostile_constraints()[name]
    with pytest.raises(GrammarLimitError, match=word):
        check_limits(spec, CONFIG)


def test_a_deep_json_schema_is_a_clear_error_not_a_recursion_error():
    for text in (deep_json(10_000), "[" * 10_000 + "]" * 10_000):
        with pytest.raises(InvalidRequestError, match="levels deep"):
            GrammarSpec("json_schema", text)
    with pytest.raises(GrammarLimitError, match="max_schema_depth"):
        check_limits(GrammarSpec("json_schema", deep_json(100)), CONFIG)
    check_limits(GrammarSpec("json_schema", deep_json(20)), CONFIG)


def test_bounds_and_satisfiability_accept_ordinary_grammars():
    recursive = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}
    for spec in (
        GrammarSpec("grammar", 'root ::= obj\nobj ::= "{" pair ("," pair)* "}"\npair ::= [a-z]+ ":" (obj | [0-9]+)'),
        GrammarSpec("grammar", 'start: item+\nitem: WORD ","?\n%import common.WORD'),
        GrammarSpec("regex", r"\d{3}-\d{4}|[a-z]{1,100}"),
        GrammarSpec.json_schema(recursive),
        GrammarSpec.json_schema({"type": "string", "pattern": "^a{1,50}$"}),
    ):
        check_limits(spec, CONFIG)
    assert unsatisfiable_reason(recursive) is None
    assert unsatisfiable_reason({"type": "object", "required": ["a"], "properties": {"a": {"$ref": "#"}}})
    assert regex_repeat_bound("(a{100}){100}") == 10_000 and regex_repeat_bound(r"[{9}]\p{L}{3}") == 3
    # A cycle counts its rules once; the chain below it adds its length.
    assert reference_depth({"a": ["b"], "b": ["a", "c"], "c": ["d"], "d": []}) == 4
    assert reference_depth({f"r{i}": [f"r{i + 1}"] for i in range(50_000)} | {"r50000": []}) == 50_001


@pytest.fixture(scope="module")
def model_facts(tiny_model):
    tokenizer = Tokenizer.from_pretrained(tiny_model)
    config = ModelConfig.from_pretrained(tiny_model)
    return tokenizer.to_json(), config.vocab_size, tokenizer.eos_token_ids or config.eos_token_ids


def test_compiler_refuses_empty_languages_and_checks_bounds_first(model_facts):
    compiler = GrammarCompiler(*model_facts, config=CONFIG)
    with pytest.raises(InvalidRequestError, match="can never be satisfied"):
        compiler.compile(GrammarSpec("regex", r"[^\s\S]"))
    with pytest.raises(GrammarLimitError, match="max_rules"):
        compiler.compile(GrammarSpec("grammar", deep_gbnf_chain(10_000)))
    compiler.new_matcher(GrammarSpec("regex", "[a-z]+"))
    stats = compiler.stats()
    assert stats["grammar_refused"] == 2 and stats["grammar_cache_entries"] == 1


def test_a_crashing_compile_costs_one_request_and_the_pool_recovers(model_facts):
    pid = os.getpid()
    marker = "CRASH-THE-WORKER"
    checker = IsolatedGrammarChecker(*model_facts, GrammarConfig(compile_workers=1), env={CRASH_MARKER_ENV: marker})
    try:
        checker.warm()
        (first_pid,) = checker.worker_pids()
        checker.check(GrammarSpec("regex", "[a-z]+"))
        with pytest.raises(InvalidRequestError, match="killed by signal 6"):
            checker.check(GrammarSpec("regex", f"x{marker}"))  # the worker calls os.abort()
        checker.check(GrammarSpec("regex", "[0-9]+"))  # the next grammar succeeds on a new worker
        (second_pid,) = checker.worker_pids()
        assert second_pid != first_pid
        with pytest.raises(InvalidRequestError, match="killed by signal 6"):  # the cached verdict
            checker.check(GrammarSpec("regex", f"x{marker}"))
        with pytest.raises(InvalidRequestError, match="invalid regex"):
            checker.check(GrammarSpec("regex", "(unclosed"))
        assert checker.worker_pids() == [second_pid]  # an invalid grammar is no crash
        stats = checker.stats()
        assert stats["worker_losses"] == 1 and stats["hits"] == 1 and stats["entries"] == 4
    finally:
        checker.close()
    assert os.getpid() == pid  # the process that asked lives on
