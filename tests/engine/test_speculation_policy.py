"""The adaptive speculation policy and its step cost model, fed known measurements."""

from __future__ import annotations

import math

import pytest

from splitserve.engine.speculative.speculation_policy import MARGIN, PROBE_BUDGET, PROBE_INTERVAL, SpeculationPolicy
from splitserve.engine.speculative.speculative_config import SpeculativeConfig
from splitserve.engine.speculative.step_cost_model import StepCostModel


def policy(**kw) -> SpeculationPolicy:
    return SpeculationPolicy(SpeculativeConfig(method="ngram", **kw))


def feed_costs(p: SpeculationPolicy, fixed: float, per_token: float, sizes=(1, 3, 5, 9)) -> None:
    for _ in range(50):
        for n in sizes:
            p.record_step(n, fixed + per_token * n)


def test_cost_model_recovers_a_linear_cost_and_falls_back_to_its_prior():
    model = StepCostModel()
    for _ in range(30):
        for n in (4, 8, 12):
            model.observe(n, 0.010 + 0.002 * n)
    a, b, c = model.fit()
    assert a == pytest.approx(0.010, rel=1e-6) and b == pytest.approx(0.002, rel=1e-6) and c == 0
    flat = StepCostModel()
    for _ in range(10):
        flat.observe(8, 0.016)  # one size only: b cannot be fitted, half the mean cost per token
    assert flat.fit()[1] == pytest.approx(0.001)
    noisy = StepCostModel()
    for _ in range(10):
        noisy.observe(1, 0.012)  # a busy machine: the bigger steps happened to run faster
        noisy.observe(9, 0.010)
    assert noisy.fit()[1] == pytest.approx(0.05 * 0.011 / 5, rel=0.01)  # never free: 5% of the mean per-token cost


def test_cost_model_separates_a_verify_steps_fixed_cost():
    # Batch 1 on CPU: a verify step leaves the batched decode path (+2 ms), then +0.1 ms a token.
    model = StepCostModel()
    for _ in range(20):
        model.observe(1, 0.002 + 0.0001)
        for k in (1, 3, 8):
            model.observe(1 + k, 0.002 + 0.002 + 0.0001 * (1 + k), verifies=True)
    a, b, c = model.fit()
    assert b == pytest.approx(0.0001, rel=1e-3) and c == pytest.approx(0.002, rel=1e-3)
    assert model.step_seconds(9, verifies=True) == pytest.approx(0.002 + 0.002 + 0.0009, rel=1e-3)
    # Verify steps all of one size: c and b are not separable, a straight line it is.
    line = StepCostModel()
    for _ in range(20):
        line.observe(1, 0.002)
        line.observe(9, 0.005, verifies=True)
    assert line.fit()[1:] == (pytest.approx(0.003 / 8), 0.0)


def test_a_verify_steps_fixed_cost_must_be_covered():
    p = policy(num_speculative_tokens=8)
    for _ in range(20):
        p.record_step(1, 0.002)
        for k in (1, 3, 8):
            p.record_step(1 + k, 0.004 + 0.0001 * (1 + k), verifies=True)
    for _ in range(200):
        p.record_draft("good", 8, 8)
    assert p.choose(["good"])["good"] == 8  # ~8 extra tokens cover the doubled step
    q = policy(num_speculative_tokens=8)
    for _ in range(20):
        q.record_step(1, 0.002)
        for k in (1, 3, 8):
            q.record_step(1 + k, 0.004 + 0.0001 * (1 + k), verifies=True)
    for _ in range(50):
        q.record_draft("so-so", 1, 1)  # alpha ~ 1/4: its drafts pay per token, not the +2 ms step
        for _ in range(3):
            q.record_draft("so-so", 1, 0)
    assert p.price(1) < 0.25 < q.verify_price(1)
    assert q.choose(["so-so"])["so-so"] == 8  # the first step's full-length probe ...
    assert q.choose(["so-so"])["so-so"] == 0  # ... then declined


def test_fixed_policy_always_asks_for_the_maximum():
    p = policy(policy="fixed", num_speculative_tokens=5)
    assert p.choose(["a", "b"]) == {"a": 5, "b": 5}


def test_good_drafts_on_a_cheap_step_get_the_maximum_k():
    p = policy(num_speculative_tokens=6)
    feed_costs(p, fixed=0.010, per_token=0.0002)  # memory-bound: draft tokens nearly free
    for _ in range(20):
        p.record_draft("a", 6, 6)
    assert p.price(1) < 0.05
    assert p.choose(["a"]) == {"a": 6}


def test_k_follows_acceptance_and_price():
    p = policy(num_speculative_tokens=8)
    feed_costs(p, fixed=0.010, per_token=0.001)
    assert p.price(4) == pytest.approx(0.004 / 0.014, rel=1e-6)  # b * B / T(B)
    bar = p.price(4) * MARGIN
    for _ in range(200):
        p.record_draft("a", 4, 3)  # 3 of 4 tried tokens accepted -> alpha ~ 0.75
    alpha = p.acceptance("a")
    k = p.choose(["a", "b", "c", "d"])["a"]
    # The largest k whose last draft token still pays: alpha^k > price >= alpha^(k+1).
    assert alpha**k > bar >= alpha ** (k + 1) and 1 <= k < 8


def test_large_batch_or_poor_drafts_turn_it_off_and_probes_stay_rare():
    p = policy(num_speculative_tokens=8)
    feed_costs(p, fixed=0.0, per_token=0.001, sizes=(32, 36, 40))  # compute-bound: price 1
    for _ in range(50):
        p.record_draft("a", 4, 4)
    assert p.price(32) == pytest.approx(1.0)
    assert all(p.choose(["a"] + [f"x{i}" for i in range(31)])["a"] == 0 for _ in range(3 * PROBE_INTERVAL))

    q = policy(num_speculative_tokens=8)
    feed_costs(q, fixed=0.010, per_token=0.001)  # price 0.17 at batch 2: probing is allowed
    for _ in range(100):
        q.record_draft("other", 4, 0)  # the pool's drafts all fail
    assert q.choose(["first"]) == {"first": 8}  # the first step probes at full length ...
    assert q.choose(["new"]) == {"new": 1}  # ... a new request still tries once ...
    q.record_draft("new", 1, 0)
    ks = [q.choose(["new", "old"]) for _ in range(4 * PROBE_INTERVAL)]
    # ... then each declined request re-tries k = 1 every price / PROBE_BUDGET steps (~1% of
    # its tokens), and one of them gets a full-length probe every PROBE_INTERVAL steps.
    retry_after = math.ceil(q.price(2) / PROBE_BUDGET)
    assert 10 < retry_after < 30
    for rid in ("new", "old"):
        tries = [i for i, chosen in enumerate(ks) if chosen[rid]]
        gaps = {b - a for a, b in zip(tries, tries[1:])}
        assert gaps <= {retry_after, retry_after + 1} | set(range(1, retry_after)), (rid, tries)
        assert len(tries) >= len(ks) // (retry_after + 1)
    deep = [i for i, chosen in enumerate(ks) if 8 in chosen.values()]
    assert deep == [PROBE_INTERVAL - 2 + PROBE_INTERVAL * n for n in range(4)]
    assert sum(k for chosen in ks for k in chosen.values()) < 0.1 * 8 * len(ks)  # mostly off
