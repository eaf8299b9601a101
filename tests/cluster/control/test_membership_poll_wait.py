"""MembershipFollower's long-poll wait: the steady wait (each call costs the serving ingress
CPU) except while a replica the view marks draining still has this ingress's requests, whose
end the controller's drain waits to see. The drain itself, end to end with real replicas:
tests/cluster/control/test_controller.py."""

from __future__ import annotations

import asyncio

from splitserve.cluster.ingress.dispatcher import Dispatcher
from splitserve.cluster.ingress.membership_follower import MembershipFollower
from splitserve.cluster.routing.replica_pools import DECODE, PREFILL
from splitserve.cluster.routing.router import Router
from splitserve.cluster.routing.router_config import RouterConfig
from splitserve.proto.messages.membership import MembershipView, ReplicaInfo


def view(version: int, draining: set[str]) -> MembershipView:
    replicas = [
        ReplicaInfo(pool, replica_id, "ns", draining=replica_id in draining)
        for pool, replica_id in ((DECODE, "decode-0"), (DECODE, "decode-1"), (PREFILL, "prefill-0"))
    ]
    return MembershipView(version=version, replicas=replicas, expected={DECODE: 2, PREFILL: 1})


def test_the_wait_is_short_only_while_a_draining_replica_has_this_ingress_s_requests():
    waits: list[float] = []
    views = [view(1, set()), view(2, {"decode-1"})]

    async def fetch(seen_version: int, ingress_id: str, report, wait_s: float):
        waits.append(wait_s)
        return None

    dispatcher = Dispatcher(Router(RouterConfig(), block_size=16), ingress_id="i0")
    follower = MembershipFollower(fetch, dispatcher, "i0", wait_s=1.0, drain_wait_s=0.25)
    assert follower._poll_wait() == 1.0  # no view yet

    follower.view = views[0]
    dispatcher.inflight["i0-1"] = "decode-1"  # a request streaming from decode-1
    assert follower._poll_wait() == 1.0  # nothing drains: the steady wait, busy or not

    follower.view = views[1]  # decode-1 drains while this ingress still streams from it
    assert follower._poll_wait() == 0.25
    dispatcher.inflight_prefill["i0-2"] = "prefill-0"
    del dispatcher.inflight["i0-1"]  # its request ended: nothing left for the drain to wait on
    assert follower._poll_wait() == 1.0

    asyncio.run(follower.sync(follower._poll_wait()))
    assert waits == [1.0]  # the call carries the wait chosen


def test_without_a_drain_wait_every_call_waits_the_same():
    async def fetch(*_):
        return None

    dispatcher = Dispatcher(Router(RouterConfig(), block_size=16), ingress_id="i1")
    follower = MembershipFollower(fetch, dispatcher, "i1", wait_s=0.5)
    follower.view = view(3, {"decode-0"})
    dispatcher.inflight["i1-1"] = "decode-0"
    assert follower._poll_wait() == 0.5
