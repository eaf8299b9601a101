"""The router's policies are WorkerSelector objects: RouterConfig.policy picks one, a caller may
plug in its own, and a new config's policy applies to the next request."""

from __future__ import annotations

import pytest

from splitserve.cluster.routing.load import LoadReport
from splitserve.cluster.routing.replica_pools import DECODE, PREFILL
from splitserve.cluster.routing.router import Router
from splitserve.cluster.routing.router_config import ROUTER_POLICIES, RouterConfig
from splitserve.cluster.routing.worker_selector import (
    KVSelector,
    LeastLoadedSelector,
    PoolView,
    RandomSelector,
    RoundRobinSelector,
    Selection,
    WorkerSelector,
)

EXPECTED = {
    "kv": KVSelector,
    "round-robin": RoundRobinSelector,
    "least-loaded": LeastLoadedSelector,
    "random": RandomSelector,
}


class LastCandidate(WorkerSelector):
    """A test double: always the last candidate, and it says so."""

    def __init__(self) -> None:
        self.pools: list[str] = []

    def select(self, view: PoolView, hashes: tuple[int, ...], num_tokens: int) -> Selection:
        self.pools.append(view.pool)
        return Selection(view.candidates[-1], 0, "last")


def _router(**kwargs) -> Router:
    router = Router(block_size=4, **kwargs)
    for pool in (PREFILL, DECODE):
        for i in range(3):
            router.add_replica(pool, f"{pool}-{i}")
    return router


@pytest.mark.parametrize("policy", ROUTER_POLICIES)
def test_each_policy_is_a_selector_object(policy):
    assert set(EXPECTED) == set(ROUTER_POLICIES)
    selector = _router(config=RouterConfig(policy=policy)).selector
    assert type(selector) is EXPECTED[policy] and isinstance(selector, WorkerSelector)


def test_a_plugged_selector_decides_both_pools():
    selector = LastCandidate()
    router = _router(config=RouterConfig(local_prefill_threshold=0), selector=selector)
    router.update_load(DECODE, "decode-2", LoadReport(queued_prefill_tokens=10**6, num_running=100))
    decision = router.route(list(range(64)), exclude_prefill=["prefill-2"])
    # the busiest decode replica (the kv policy would never pick it) and the last prefill one not excluded
    assert (decision.decode_replica, decision.prefill_replica, decision.reason) == ("decode-2", "prefill-1", "last")
    assert selector.pools == [DECODE, PREFILL]
    assert router.decision_counts() == {"last": 1}


def test_a_new_config_policy_applies_to_the_next_request():
    router = _router(config=RouterConfig(policy="kv", local_prefill_threshold=0))
    assert isinstance(router.selector, KVSelector)
    router.config = router.config.model_copy(update={"policy": "round-robin"})
    picks = [router.route(list(range(8))).decode_replica for _ in range(3)]
    assert isinstance(router.selector, RoundRobinSelector) and picks == ["decode-0", "decode-1", "decode-2"]
