"""Local or remote prefill by measured cost (RouterConfig.prefill_placement "measured") on real
replicas (local Ray, 1 prefill + 1 decode, the tiny model), observed through the ingress's
metrics -- the router's decisions by reason and the first-token stages (a remote prefill has
a `handoff` stage, a local one none) -- never by timing:

- cold (no replica measured yet): the threshold rule, so a remote prefill, as without the
  setting; that and one prefill on the decode replica (the threshold as an override) give
  both replicas measured profiles;
- an idle decode replica holding a prompt's 224-token prefix prefills its last 32 tokens
  itself ("local-prefill-cheaper"), rather than have the prefill replica compute all 256 and
  send them;
- the prefix with a 128-token tail while the decode replica runs 48 held sequences (the test
  hold of tests/helpers/migration_streams.py) goes to the prefill replica
  ("remote-prefill-cheaper"): each of them would wait for the local prefill.

Why those shapes: the measured costs are only as steady as the machine, so each choice is
made with a wide margin -- 256 tokens remote against 32 local (8x) when idle, 49 x 128 stalled
tokens against 352 (18x) when full. (With a 32-token tail, 6x, a loaded CI run once measured
the replicas' per-token costs far enough apart to choose local.) Greedy output equals the colocated engine's on both paths,
and every pool is back at its baseline after.
"""

from __future__ import annotations

import asyncio
import re

import pytest
import ray

from splitserve.cluster.frontend.serving_api import ChoiceRequest
from splitserve.cluster.routing.prefill_placement import LOCAL_CHEAPER, REMOTE_CHEAPER
from splitserve.cluster.routing.replica_pools import DECODE, PREFILL
from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.cluster import cluster_config, serving_backend, wait_for_baseline, wait_until
from tests.helpers.migration_streams import hold_decode_steps

pytestmark = pytest.mark.ray
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
FILLER = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
HOLD_AT = 2  # the fillers' output length when their steps are held
NUM_FILLERS = 48  # running on the decode replica (max_num_seqs 64 leaves the probe a slot)
PREFIX = [(11 * i) % 300 + 20 for i in range(224)]  # 14 blocks of 16
DECISION = re.compile(r'^splitserve_router_decisions_total\{[^}]*reason="([\w-]+)"[^}]*\} (\S+)$', re.M)
STAGE_COUNT = re.compile(r'^splitserve_first_token_stage_seconds_count\{[^}]*stage="(\w+)"[^}]*\} (\S+)$', re.M)


def tail(salt: int, n: int = 32) -> list[int]:
    return [(7 * i + 13 * salt) % 250 + 30 for i in range(n)]


@pytest.fixture(scope="module")
def serving(ray_cluster, tiny_model, loop):
    cfg = cluster_config(
        tiny_model,
        policy="kv",
        num_blocks=256,
        router={"policy": "kv", "local_prefill_threshold": 0, "prefill_placement": "measured"},
    )
    with serving_backend(loop, cfg, tiny_model) as backend:
        yield backend


@pytest.fixture(scope="module")
def reference(tiny_model):
    engine = LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=64))
    return lambda prompt: engine.generate([prompt], GREEDY)[0].token_ids


def counts(serving) -> dict[str, float]:
    """Decisions by reason ("decision:<reason>") and first-token stages observed, so far."""
    text = serving.metrics.render().decode()
    got = {f"decision:{reason}": float(v) for reason, v in DECISION.findall(text)}
    return got | {stage: float(v) for stage, v in STAGE_COUNT.findall(text)}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


async def stream(serving, prompt: list[int], params: SamplingParams) -> list[int]:
    tokens: list[int] = []
    async for chunk in serving.generate(ChoiceRequest(prompt, params)):
        tokens += chunk.token_ids
    return tokens


def route_one(loop, serving, prompt: list[int]) -> tuple[list[int], dict[str, float]]:
    before = counts(serving)
    tokens = loop.run(stream(serving, prompt, GREEDY), timeout=120)
    return tokens, delta(counts(serving), before)


def with_threshold(serving, threshold: int) -> None:
    router = serving.cluster.router
    router.config = router.config.model_copy(update={"local_prefill_threshold": threshold})


def figures(serving) -> str:
    router = serving.cluster.router
    return f"decode {router.load(DECODE, 'decode-0').report}; prefill {router.load(PREFILL, 'prefill-0').report}"


def holding(serving) -> bool:
    """Whether decode-0 holds its step now; not known yet (its answer is slow on a loaded
    machine) counts as no, and the caller's wait asks again (that wait's bound is the test's)."""
    try:
        return ray.get(serving.cluster.decode_pool.get("decode-0").handle.holding.remote(), timeout=10)
    except ray.exceptions.GetTimeoutError:
        return False


def let_reports_through(serving) -> None:
    """The router sees the held fillers running. A replica reads its state between steps, so a
    read queued while the fillers' step is held waits there (the report may still say idle, as
    it did before they came): each hold one token further lets one step through, and the read
    queued behind it with it. The fillers stay held, as their max_tokens is past every hold."""
    router = serving.cluster.router
    for hold_at in range(HOLD_AT + 1, FILLER.max_tokens):
        if router.load(DECODE, "decode-0").report.num_running >= NUM_FILLERS:
            return
        hold_decode_steps(serving.cluster, hold_at)
        wait_until(lambda: holding(serving), None, f"the fillers' steps were not held again at {hold_at} tokens")
    raise AssertionError(f"the router never saw the {NUM_FILLERS} fillers running: {figures(serving)}")


def test_local_on_an_idle_decode_replica_remote_on_a_full_one(loop, serving, reference):
    router = serving.cluster.router
    # Cold: nothing measured, so the threshold rule (0 here): a remote prefill.
    cold = [(3 * i) % 280 + 25 for i in range(256)]
    tokens, seen = route_one(loop, serving, cold)
    assert tokens == reference(cold)
    assert seen.get("handoff") == 1 and not {f"decision:{LOCAL_CHEAPER}", f"decision:{REMOTE_CHEAPER}"} & set(seen)
    # The dispatcher handed the router its handoff stage; one sample (the pair's set-up) prices no hop yet.
    assert router.remote_handoff.num_samples == 1 and router.remote_handoff.seconds == 0.0
    # The threshold as an override: the decode replica prefills (and caches) the prefix itself.
    with_threshold(serving, 10**6)
    try:
        tokens, seen = route_one(loop, serving, PREFIX + tail(0))
    finally:
        with_threshold(serving, 0)
    assert seen.get("decision:local-prefill") == 1 and "handoff" not in seen
    wait_until(
        lambda: (
            router.load(DECODE, "decode-0").report.prefill_line(fresh=True) is not None
            and router.load(DECODE, "decode-0").report.num_running == 0
            and router.load(PREFILL, "prefill-0").report.transfer_bytes_per_second > 0
            and router.load(PREFILL, "prefill-0").report.prefill_line(fresh=True) is not None
        ),
        None,
        lambda: f"no measured, idle reports: {figures(serving)}",
    )

    # An idle decode replica: it prefills the 32 tokens it lacks.
    idle_prompt = PREFIX + tail(1)
    tokens, seen = route_one(loop, serving, idle_prompt)
    assert seen.get(f"decision:{LOCAL_CHEAPER}") == 1 and "handoff" not in seen, (seen, figures(serving))
    assert seen.get("relay") == 1 and tokens == reference(idle_prompt)

    # A full one: NUM_FILLERS sequences held on it (prefilled there: the threshold override).
    hold_decode_steps(serving.cluster, HOLD_AT)
    with_threshold(serving, 10**6)
    unfilled = counts(serving)
    fillers = [
        asyncio.run_coroutine_threadsafe(stream(serving, tail(100 + i, 8), FILLER), loop.loop)
        for i in range(NUM_FILLERS)
    ]
    probe = None
    try:
        # Every filler's first token relayed too, so that the probe's is the one first token
        # after `before`.
        wait_until(
            lambda: delta(counts(serving), unfilled).get("relay") == NUM_FILLERS and holding(serving),
            None,
            lambda: f"the decode replica did not fill and hold: {delta(counts(serving), unfilled)}; {figures(serving)}",
        )
        let_reports_through(serving)
        with_threshold(serving, 0)
        before = counts(serving)
        full_prompt = PREFIX + tail(2, 128)
        probe = asyncio.run_coroutine_threadsafe(stream(serving, full_prompt, GREEDY), loop.loop)
        # Its first chunk came back (held sequences let a joining one through).
        wait_until(
            lambda: delta(counts(serving), before).get("relay") == 1,
            None,
            lambda: f"the probe's first token never came: {delta(counts(serving), before)}; {figures(serving)}",
        )
        seen = delta(counts(serving), before)
        assert seen.get(f"decision:{REMOTE_CHEAPER}") == 1 and seen.get("handoff") == 1, (seen, figures(serving))
    finally:
        with_threshold(serving, 0)
        hold_decode_steps(serving.cluster, 0)
        results = [f.result(timeout=180) for f in fillers]
        if probe is not None:
            assert probe.result(timeout=120) == reference(full_prompt)
    assert all(len(r) == FILLER.max_tokens for r in results)
    wait_for_baseline(loop, serving.cluster, timeout_s=60)
