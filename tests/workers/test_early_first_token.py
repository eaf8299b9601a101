"""The early first token on local Ray (real prefill and decode actors, gloo): with
`early_first_token` the prefill replica pushes the first token to the decode replica as soon as
it is sampled, and the client has it while the KV transfer is still held (its sends stalled by
a chaos fault the test switches off, so nothing here is timed, and no wait has a wall-clock bound
of its own: the test's timeout ends one that never returns). The rest of the stream then
follows, equal to the stream without it; a transfer that fails after the first token moves the
stream (migration, reason `prefill_failed`) and the client still gets the same tokens; every
pool returns to baseline.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from splitserve.cluster.routing.replica_pools import PREFILL
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.cluster import HELD_S, cluster_config, pool_states, start_cluster, wait_for_baseline

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# Without migration a failed transfer could not move the stream: the first token waits for the KV.
WITHOUT = msgspec.structs.replace(GREEDY, migration=False)


class Moves:
    """A MigrationObserver: the moves the dispatcher made, by pool and reason."""

    def __init__(self) -> None:
        self.moves: list[tuple[str, str]] = []

    def moved(self, pool: str, reason: str, num_tokens: int) -> None:
        self.moves.append((pool, reason))

    def refused(self, reason: str) -> None:
        raise AssertionError(f"a move was refused: {reason}")

    def gap(self, seconds: float) -> None:
        pass

    def recomputed(self, num_tokens: int) -> None:
        pass


@pytest.fixture(scope="module")
def early_cluster(ray_cluster, tiny_model, loop):
    # The transfer lease as long as a held fault: the decode replica never gives the held
    # transfer up on its own, however slow the machine (the first request meets the prefill
    # limit's ceiling, the lease; a later give-up would move the stream, as the second test wants).
    cfg = cluster_config(tiny_model, num_prefill=1, num_decode=1, lease_s=HELD_S, early_first_token=True)
    cluster = start_cluster(loop, cfg)
    try:
        yield cluster
    finally:
        loop.run(cluster.shutdown(), timeout=None)


def prompt(n: int) -> list[int]:
    return [(11 * i + 5 * n) % 400 + 20 for i in range(40)]  # fresh blocks for each n


def stall_sends(loop, cluster, **fault) -> None:
    refs = [r.handle.inject_fault.remote(**fault) for r in cluster.prefill_pool.live_replicas()]

    async def applied():
        return await asyncio.gather(*refs)

    loop.run(applied(), timeout=None)  # no bound of its own: the test's timeout ends it


def blocks_received(loop, cluster) -> int:
    decode_ids = {r.replica_id for r in cluster.decode_pool.live_replicas()}
    return sum(s.transfer.num_blocks for rid, s in pool_states(loop, cluster, None).items() if rid in decode_ids)


def held_stream(loop, cluster, ids: list[int], moves: Moves | None = None):
    """Start a stream while every KV send is held; returns (its first chunk, the stream)."""
    stream = cluster.generate(ids, GREEDY, migrations=moves)

    async def first_chunk():
        return await anext(stream)

    # No bound: the test's timeout ends a first token that never comes.
    return loop.run(first_chunk(), timeout=None), stream


def rest_of(loop, stream) -> list:
    async def drain():
        return [chunk async for chunk in stream]

    return loop.run(drain(), timeout=None)


def test_the_first_token_streams_while_its_kv_is_held(loop, early_cluster):
    cluster = early_cluster
    received = blocks_received(loop, cluster)
    stall_sends(loop, cluster, stall_send_s=HELD_S)
    try:
        first, stream = held_stream(loop, cluster, prompt(0))
        # The client has the first token, from the prefill replica, and no KV block has landed.
        assert len(first.token_ids) == 1 and first.prefill_replica is not None
        assert {"prefill_compute", "handoff"} <= set(first.first_token_stages)
        assert blocks_received(loop, cluster) == received
    finally:
        stall_sends(loop, cluster, stall_send_s=0.0)
    chunks = [first, *rest_of(loop, stream)]
    assert blocks_received(loop, cluster) > received
    tokens = [t for chunk in chunks for t in chunk.token_ids]
    # The same stream as without the early token (migration off: the first token waits for the KV).
    reference = loop.run(cluster.complete(prompt(0), WITHOUT), timeout=None)
    assert tokens == reference["token_ids"] and chunks[-1].finished
    assert "".join(chunk.text for chunk in chunks) == reference["text"]
    assert cluster.dispatcher.num_migrations == 0
    wait_for_baseline(loop, cluster)


def test_a_transfer_that_fails_after_the_first_token_moves_the_stream(loop, early_cluster):
    cluster = early_cluster
    moves = Moves()
    migrations = cluster.dispatcher.num_migrations
    stall_sends(loop, cluster, stall_send_s=HELD_S)
    try:
        first, stream = held_stream(loop, cluster, prompt(1), moves)
        assert len(first.token_ids) == 1 and first.prefill_replica is not None
        # The held send wakes and fails: the transfer behind the first token is lost.
        stall_sends(loop, cluster, fail_sends=1)
        chunks = [first, *rest_of(loop, stream)]
    finally:
        stall_sends(loop, cluster)
    # Moved once, off the prefill replica (the only one: the decode replica prefills the
    # continuation itself), and the client's stream is the one it would have had.
    assert moves.moves == [(PREFILL, "prefill_failed")]
    assert cluster.dispatcher.num_migrations == migrations + 1
    reference = loop.run(cluster.complete(prompt(1), WITHOUT), timeout=None)
    assert [t for chunk in chunks for t in chunk.token_ids] == reference["token_ids"]
    assert "".join(chunk.text for chunk in chunks) == reference["text"] and chunks[-1].finished
    wait_for_baseline(loop, cluster)
