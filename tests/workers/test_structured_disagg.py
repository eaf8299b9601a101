"""Constrained decoding through the disaggregated path (real prefill + decode actors, KV over
gloo): the prefill replica samples the first token under the grammar, decode replays it and
continues; outputs are valid by construction; bad grammars fail with 400 before any compute;
a huge schema's compile does not stall other requests; no KV block leaks."""

from __future__ import annotations

import asyncio
import json
import re
import time

import jsonschema
import pytest

from splitserve.cluster.request_error import ErrorKind, RequestError
from splitserve.engine.io.sampling_params import SamplingParams
from splitserve.engine.sample.grammar_spec import GrammarSpec
from splitserve.engine.testing.json_schemas import MAX_INSTANCE_TOKENS, SCHEMAS
from tests.helpers.cluster import cluster_config, pool_states, start_cluster, wait_for_baseline

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def cluster(ray_cluster, tiny_model, loop):
    cluster = start_cluster(loop, cluster_config(tiny_model, num_blocks=512))
    yield cluster
    loop.run(cluster.shutdown(), timeout=60)


def prompt(i: int) -> list[int]:
    return [20 + (7 * i + 3 * k) % 400 for k in range(5 + i % 30)]


def constrained(spec: GrammarSpec, seed: int, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", MAX_INSTANCE_TOKENS)
    return SamplingParams(structured_output=spec, seed=seed, **kw)


def run_all(loop, cluster, requests, timeout=300):
    async def go():
        return await asyncio.gather(*(cluster.complete(p, params) for p, params in requests))

    return loop.run(go(), timeout=timeout)


def test_json_schema_requests_through_1p1d_are_valid(loop, cluster):
    """30 here; the 100 (and 100 streamed) over HTTP go through 1P+1D too."""
    names = list(SCHEMAS)
    requests = [
        (prompt(i), constrained(GrammarSpec.json_schema(SCHEMAS[names[i % 5]]), seed=i, temperature=0.3 + i % 3))
        for i in range(30)
    ]
    results = run_all(loop, cluster, requests)
    tok = cluster_tokenizer(cluster)
    for i, res in enumerate(results):
        assert res["prefill_replica"] == "prefill-0"
        assert res["finish_reason"] == "stop", res
        jsonschema.validate(json.loads(tok.decode(res["token_ids"])), SCHEMAS[names[i % 5]])
        assert res["text"] == tok.decode(res["token_ids"])
    states = wait_for_baseline(loop, cluster)
    prefill, decode = states["prefill-0"].engine, states["decode-0"].engine
    # Every first token was sampled on the prefill replica, under the grammar.
    assert prefill.grammar_masked_rows >= 30 and prefill.grammar_compiles == 5
    assert decode.grammar_compiles == 5 and decode.grammar_mask_steps > 0


def cluster_tokenizer(cluster):
    from splitserve.engine.io.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(cluster.cfg.model)


def test_regex_and_choice_through_1p1d(loop, cluster):
    regex = r"(yes|no)-[0-9]{2,4}"
    choices = ["alpha", "beta gamma", "δ"]
    requests = [(prompt(i), constrained(GrammarSpec("regex", regex), seed=i, max_tokens=32)) for i in range(6)]
    requests += [(prompt(i), constrained(GrammarSpec.choice(choices), seed=i, max_tokens=32)) for i in range(6)]
    results = run_all(loop, cluster, requests)
    for res in results[:6]:
        assert res["finish_reason"] == "stop" and re.fullmatch(regex, res["text"]), res
    for res in results[6:]:
        assert res["finish_reason"] == "stop" and res["text"] in choices, res
    wait_for_baseline(loop, cluster)


def test_invalid_schema_is_400_and_leaks_nothing(loop, cluster):
    bad = SamplingParams(structured_output=GrammarSpec("regex", "([a-z]"), max_tokens=8)
    with pytest.raises(RequestError) as err:
        run_all(loop, cluster, [(prompt(1), bad)])
    assert err.value.kind is ErrorKind.INVALID and "regex" in str(err.value)
    wait_for_baseline(loop, cluster)
    ok = run_all(loop, cluster, [(prompt(2), SamplingParams(max_tokens=4, ignore_eos=True))])[0]
    assert len(ok["token_ids"]) == 4


def huge_schema(num_fields: int = 3000) -> dict:
    props = {
        f"f{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}[0-9]{{2,{i % 5 + 3}}}$"}
        for i in range(num_fields)
    }
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def test_huge_schema_compile_does_not_stall_other_requests(loop, cluster):
    huge = SamplingParams(structured_output=GrammarSpec.json_schema(huge_schema()), max_tokens=4, seed=0)
    plain = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0)
    events: list[tuple[str, float]] = []

    async def first_chunk(name, params, p):
        async for _ in cluster.generate(p, params):
            events.append((name, time.monotonic()))
            break  # the first chunk is what compile delays

    async def go():
        huge_task = asyncio.ensure_future(first_chunk("huge", huge, prompt(3)))
        await asyncio.sleep(0.1)  # its compile is under way
        await asyncio.gather(*(first_chunk(f"plain{i}", plain, prompt(10 + i)) for i in range(3)))
        plain_done = time.monotonic()
        await huge_task
        return plain_done

    plain_done = loop.run(go(), timeout=120)
    huge_at = dict(events)["huge"]
    assert all(name.startswith("plain") for name, _ in events[:3]), events
    assert huge_at > plain_done
    # The huge request's grammar was compiled on both replicas, outside their engine loops.
    states = pool_states(loop, cluster)
    assert states["decode-0"].engine.grammar_compile_seconds > 0.2
    wait_for_baseline(loop, cluster)
