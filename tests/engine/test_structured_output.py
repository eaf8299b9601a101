"""Constrained decoding in the engine (llguidance): outputs valid by construction from a
random-weight model, compiled once per schema, invalid grammars refused with the grammar
engine's message, unconstrained rows untouched, max_tokens cut-offs reported as "length",
and the speculative-decoding rollback hook."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from splitserve.bench.serving.json_schemas import MAX_INSTANCE_TOKENS, SCHEMAS
from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.structured_output.token_bitmask import allocate_token_bitmask, apply_token_bitmask_
from splitserve.proto.messages.grammar_spec import GrammarSpec
from splitserve.proto.messages.invalid_request import InvalidRequestError
from splitserve.proto.messages.sampling_params import SamplingParams

BOTH_SCHEDULINGS = True  # every engine test runs with async scheduling and without (conftest.py)

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model) -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=1024, max_num_seqs=128))


def constrained(spec: GrammarSpec, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", MAX_INSTANCE_TOKENS)
    kw.setdefault("temperature", 1.0)
    return SamplingParams(structured_output=spec, **kw)


def assert_baseline(engine: LLMEngine) -> None:
    assert engine.kv.num_free_blocks == engine.config.num_kv_blocks
    assert not engine.scheduler.has_unfinished()


def test_100_requests_over_5_schemas_are_valid_json(engine):
    names = list(SCHEMAS)
    prompts, params = [], []
    for i in range(100):
        name = names[i % len(names)]
        prompts.append(f"Give me a {name} as JSON, number {i}:")
        # Sampled (seeded) and greedy rows in one batch: both must be valid.
        params.append(constrained(GrammarSpec.json_schema(SCHEMAS[name]), seed=i, temperature=0 if i % 4 == 0 else 1))
    compiles_before = engine.grammar.num_compiles
    outputs = engine.generate(prompts, params)
    for i, out in enumerate(outputs):
        schema = SCHEMAS[names[i % len(names)]]
        assert out.finish_reason == "stop", (out.finish_reason, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    assert engine.grammar.num_compiles - compiles_before <= len(SCHEMAS)  # once per schema
    assert_baseline(engine)


def test_regex_choice_grammar_and_json_object(engine):
    specs = {
        "regex": (GrammarSpec("regex", r"[A-Z][a-z]{2,5}-\d{3}"), lambda t: re.fullmatch(r"[A-Z][a-z]{2,5}-\d{3}", t)),
        "choice": (GrammarSpec.choice(["red", "green", "blue sky"]), lambda t: t in ("red", "green", "blue sky")),
        "lark": (GrammarSpec("grammar", 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/'), None),
        "gbnf": (GrammarSpec("grammar", 'root ::= "x=" [0-9] [0-9]? ";"'), lambda t: re.fullmatch(r"x=\d\d?;", t)),
    }
    prompts, params = [], []
    for i in range(24):
        spec, _ = list(specs.values())[i % len(specs)]
        prompts.append(f"Answer {i}:")
        params.append(constrained(spec, seed=i, max_tokens=64))
    for i, out in enumerate(engine.generate(prompts, params)):
        name = list(specs)[i % len(specs)]
        check = specs[name][1] or (lambda t: re.fullmatch(r"\(\d{1,3}(,\d{1,3})*\)", t))
        assert out.finish_reason == "stop" and check(out.text), (name, out.finish_reason, out.text)
    obj = engine.generate(["JSON please:"], [constrained(GrammarSpec("json_object"), max_tokens=400, seed=3)])[0]
    if obj.finish_reason == "stop":  # unbounded: a random model may run to max_tokens
        assert isinstance(json.loads(obj.text), dict)
    assert_baseline(engine)


def test_invalid_grammars_are_refused_with_the_engines_message(engine):
    cases = [
        (GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "frobnicate"}}}), "frobnicate"),
        (GrammarSpec("regex", "a(b"), "unclosed group"),
        (GrammarSpec("grammar", "start: foo"), "foo"),
    ]
    for spec, needle in cases:
        with pytest.raises(InvalidRequestError, match=needle):
            engine.make_sequence("hi", None, constrained(spec))
    for bad in ({"kind": "yaml"}, {"kind": "json_schema", "value": "{not json"}, {"kind": "regex", "value": ""}):
        with pytest.raises(InvalidRequestError):
            SamplingParams(structured_output=bad)
    assert_baseline(engine)


def test_unconstrained_rows_are_unchanged_next_to_constrained_ones(engine):
    prompts = ["The quick brown fox", "Once upon a time", "In a hole in the ground"]
    alone = engine.generate(prompts, GREEDY)
    spec = GrammarSpec.json_schema(SCHEMAS["person"])
    mixed = engine.generate(prompts + ["Person:"] * 3, [GREEDY] * 3 + [constrained(spec, seed=1)] * 3)
    assert [o.token_ids for o in mixed[:3]] == [o.token_ids for o in alone]


def test_max_tokens_cut_off_reports_length(engine):
    spec = GrammarSpec.json_schema(SCHEMAS["order"])
    out = engine.generate(["Order:"], [constrained(spec, max_tokens=5, seed=0)])[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)
    assert_baseline(engine)


def test_grammar_end_stops_even_with_ignore_eos(engine):
    out = engine.generate(["Pick:"], [constrained(GrammarSpec.choice(["yes", "no"]), ignore_eos=True)])[0]
    assert out.finish_reason == "stop" and out.text in ("yes", "no")


def test_rollback_hook_restores_earlier_masks(engine):
    """Speculative decoding's hook: accept drafted tokens, roll back the rejected ones."""
    tok = engine.tokenizer
    matcher = engine.grammar.new_matcher(GrammarSpec.json_schema(SCHEMAS["person"]))
    draft = tok.encode('{"name":"Al","age":4', add_special_tokens=False)
    masks = [matcher.allowed_token_ids()]
    for token in draft:
        assert matcher.accept_token(token)
        masks.append(matcher.allowed_token_ids())
    matcher.rollback(3)
    assert matcher.num_accepted == len(draft) - 3
    assert matcher.allowed_token_ids() == masks[len(draft) - 3]
    assert matcher.accept_tokens(draft[-3:]) == 3 and matcher.allowed_token_ids() == masks[-1]
    with pytest.raises(ValueError):
        matcher.rollback(len(draft) + 1)


def test_bitmask_op_matches_the_bits():
    bitmask = allocate_token_bitmask(3, 77)  # 3 words: ids 0..95
    gen = torch.Generator().manual_seed(0)
    bitmask.copy_(torch.randint(-(2**31), 2**31 - 1, bitmask.shape, generator=gen, dtype=torch.int32))
    logits = torch.randn(3, 100, generator=gen)  # a model vocabulary padded past the mask's ids
    masked = apply_token_bitmask_(logits.clone(), bitmask)
    for row in range(3):
        for token in range(100):
            allowed = token < 96 and bool(int(bitmask[row, token // 32]) >> (token % 32) & 1)
            assert (masked[row, token] == logits[row, token]) if allowed else masked[row, token] == float("-inf")
