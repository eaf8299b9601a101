"""Constrained decoding through the disaggregated path (real prefill + decode actors, KV over
gloo): the prefill replica samples the first token under the grammar, decode replays it and
continues; outputs are valid by construction; bad grammars fail with 400 before any compute;
a huge schema's compile does not stall other requests; no KV block leaks."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from splitserve.bench.serving.json_schemas import MAX_INSTANCE_TOKENS, SCHEMAS
from splitserve.cluster.request_error import ErrorKind, RequestError
from splitserve.proto.messages.grammar_spec import GrammarSpec
from splitserve.proto.messages.sampling_params import SamplingParams
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


def huge_schema(num_fields: int = 300) -> dict:
    props = {
        f"f{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}[0-9]{{2,{i % 5 + 3}}}$"}
        for i in range(num_fields)
    }
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


# Run inside a replica actor (Ray's __ray_call__). While held, every grammar compile there waits
# on its worker thread until released: a compile as long as the test needs, on any machine.
def _hold_compiles(worker) -> None:
    import threading

    grammar = worker.loop.engine.grammar
    build, started, release = grammar._build, threading.Event(), threading.Event()

    def held(spec):
        started.set()
        release.wait(120)  # a safety net: the test releases it
        return build(spec)

    grammar._build = held
    worker.compile_hold = (started, release, build)


def _compile_started(worker) -> bool:
    return worker.compile_hold[0].is_set()


def _release_compiles(worker) -> None:
    _, release, build = worker.compile_hold
    worker.loop.engine.grammar._build = build
    release.set()


def test_huge_schema_compile_does_not_stall_other_requests(loop, cluster):
    huge = SamplingParams(structured_output=GrammarSpec.json_schema(huge_schema()), max_tokens=4, seed=0)
    plain = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0)
    replicas = [r for pool in (cluster.prefill_pool, cluster.decode_pool) for r in pool.live_replicas()]
    compiles_before = {rid: s.engine.grammar_compiles for rid, s in pool_states(loop, cluster).items()}
    events: list[str] = []

    async def on_replicas(fn) -> list:
        return await asyncio.gather(*(r.handle.__ray_call__.remote(fn) for r in replicas))

    async def first_chunk(name, params, p):
        async for _ in cluster.generate(p, params):
            events.append(name)
            break  # the first chunk is what compile delays

    async def go():
        await on_replicas(_hold_compiles)
        huge_task = asyncio.ensure_future(first_chunk("huge", huge, prompt(3)))
        try:
            while not any(await on_replicas(_compile_started)):
                await asyncio.sleep(0.01)
            # The compile is held open: had it run on an engine loop or an actor's event loop,
            # these could not stream (and this would time out).
            await asyncio.gather(*(first_chunk(f"plain{i}", plain, prompt(10 + i)) for i in range(3)))
            streamed_while_held = list(events)
        finally:
            await on_replicas(_release_compiles)
        await huge_task
        return streamed_while_held

    streamed_while_held = loop.run(go(), timeout=120)
    assert sorted(streamed_while_held) == ["plain0", "plain1", "plain2"], streamed_while_held
    assert events[-1] == "huge", events
    # The huge request's grammar was compiled once on each replica, outside their engine loops.
    states = pool_states(loop, cluster)
    assert {rid: s.engine.grammar_compiles - compiles_before[rid] for rid, s in states.items()} == {
        rid: 1 for rid in states
    }
    wait_for_baseline(loop, cluster)
