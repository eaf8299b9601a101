"""Router: cost policy, herding, pending load, disaggregation, availability, no torch (the
KVIndex under it: test_kv_index.py)."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from splitserve.cluster.routing.load import LoadReport
from splitserve.cluster.routing.replica_pools import DECODE, PREFILL, UnknownReplicaError
from splitserve.cluster.routing.route_decision import RouteDecision
from splitserve.cluster.routing.router import NoReplicaError, Router
from splitserve.cluster.routing.router_config import RouterConfig
from splitserve.engine.core.block_hash import hash_blocks, root_hash

REPO = Path(__file__).resolve().parents[3]
BS = 4  # block size: tiny prompts


def _tokens(seed: int, num_blocks: int) -> list[int]:
    return [seed * 1000 + i for i in range(num_blocks * BS)]


def _router(policy: str = "kv", num_prefill: int = 2, num_decode: int = 2, **cfg) -> Router:
    cfg.setdefault("local_prefill_threshold", 0)
    router = Router(RouterConfig(policy=policy, **cfg), block_size=BS, seed=7)
    for i in range(num_prefill):
        router.add_replica(PREFILL, f"p{i}")
    for i in range(num_decode):
        router.add_replica(DECODE, f"d{i}")
    return router


def _store(router: Router, pool: str, rid: str, hashes: list[int]) -> None:
    seq = router.index(pool).last_seq(rid) + 1
    assert router.apply_events(pool, rid, [[seq, "stored", hashes]])


# ---- Router: kv policy ------------------------------------------------------------------
def test_kv_policy_prefers_the_prefix_holder_under_similar_load():
    router = _router()
    tokens = _tokens(1, 8)
    _store(router, PREFILL, "p1", hash_blocks(tokens, BS))
    router.update_load(PREFILL, "p0", LoadReport(0, 1, 0.1))
    router.update_load(PREFILL, "p1", LoadReport(16, 1, 0.1))  # slightly busier, but holds the prefix
    decision = router.route(tokens)
    assert decision.prefill_replica == "p1"
    assert decision.reason == "kv-prefix"
    assert decision.prefill_cached_tokens == len(tokens) - 1  # last token is recomputed
    assert router.decision_counts() == {"kv-prefix": 1}


def test_a_lora_adapters_prefix_counts_only_where_that_adapter_computed_it():
    """The router hashes an adapter request's blocks as its engines do (seeded with the
    adapter): a base prefix is no hit for it, and its own prefix is."""
    router = _router()
    tokens = _tokens(2, 8)
    _store(router, PREFILL, "p0", hash_blocks(tokens, BS))  # the base model's blocks
    _store(router, PREFILL, "p1", hash_blocks(tokens, BS, root_hash(None, "sql")))  # adapter sql's
    assert router.route(tokens).prefill_replica == "p0"
    for _ in range(3):  # not a tie broken by chance
        decision = router.route(tokens, lora_adapter="sql")
        assert decision.prefill_replica == "p1" and decision.prefill_cached_tokens == len(tokens) - 1
        decision.release_claims()
    assert router.route(tokens, lora_adapter="chat").prefill_cached_tokens == 0  # another adapter: no credit


def test_kv_policy_sends_to_idle_replica_when_holder_is_overloaded():
    router = _router(queue_weight=1.0, prefix_weight=1.0)
    tokens = _tokens(2, 8)  # 32 tokens
    _store(router, PREFILL, "p1", hash_blocks(tokens, BS))
    router.update_load(PREFILL, "p1", LoadReport(5000, 8, 0.9))
    decision = router.route(tokens)
    assert decision.prefill_replica == "p0"
    assert decision.reason == "load-over-prefix"
    assert decision.prefill_cached_tokens == 0
    # A large enough prefix_weight makes the same holder win again.
    router = _router(queue_weight=1.0, prefix_weight=1000.0)
    _store(router, PREFILL, "p1", hash_blocks(tokens, BS))
    router.update_load(PREFILL, "p1", LoadReport(5000, 8, 0.9))
    assert router.route(tokens).prefill_replica == "p1"


def test_decode_choice_uses_overlap_and_load():
    router = _router(num_decode=3)
    tokens = _tokens(3, 8)
    _store(router, DECODE, "d2", hash_blocks(tokens, BS)[:6])
    decision = router.route(tokens)
    assert decision.decode_replica == "d2"
    assert decision.decode_cached_tokens == 24
    assert decision.num_transfer_tokens == 8
    # A nearly full decode cache costs more than the overlap saves.
    router.update_load(DECODE, "d2", LoadReport(0, 30, 0.99))
    assert router.route(tokens).decode_replica in {"d0", "d1"}


def test_burst_of_identical_requests_spreads_without_herding():
    router = _router(num_prefill=4, num_decode=4)
    spread = Counter()
    decode_spread = Counter()
    for _ in range(100):
        decision = router.route(_tokens(4, 8))
        spread[decision.prefill_replica] += 1
        decode_spread[decision.decode_replica] += 1
    assert set(spread) == {"p0", "p1", "p2", "p3"}
    assert all(20 <= n <= 30 for n in spread.values()), spread
    assert all(20 <= n <= 30 for n in decode_spread.values()), decode_spread
    # A load report clears the optimistic accounting.
    router.update_load(PREFILL, "p0", LoadReport(0, 0, 0.0))
    assert router.load(PREFILL, "p0").pending_tokens == 0


def test_finished_requests_give_their_pending_load_back_until_the_next_report():
    """One client's requests one after another, no load report in between: each finished
    request gives its share back, so the prefix holder keeps the group. Without that, the
    finished requests piled up as phantom load and the group left its cache."""
    tokens = _tokens(5, 64)  # 256 tokens, all cached on p1

    def follow_ups(release: bool) -> tuple[list, Router]:
        router = _router()
        _store(router, PREFILL, "p1", hash_blocks(tokens, BS))
        chosen = []
        for _ in range(12):
            decision = router.route(tokens)
            chosen.append(decision.prefill_replica)
            if release:
                decision.release_prefill()  # its first token came back
                assert router.load(PREFILL, decision.prefill_replica).pending_requests == 0
                decision.release_claims()  # it finished
        return chosen, router

    assert "p0" in follow_ups(release=False)[0]  # phantom load drives the group away
    chosen, router = follow_ups(release=True)
    assert chosen == ["p1"] * 12
    assert all(
        router.load(pool, rid).pending_requests == 0 for pool in (PREFILL, DECODE) for rid in router.replica_ids(pool)
    )
    # Releasing twice, or after a report replaced the pending counts, takes nothing more back.
    first = router.route(tokens)
    router.update_load(PREFILL, "p1", LoadReport(0, 1, 0.1))  # this report counts `first`
    second = router.route(tokens)
    first.release_claims()
    first.release_claims()
    assert router.load(PREFILL, "p1").pending_requests == 1  # still `second`'s
    second.release_prefill()
    assert router.load(PREFILL, "p1").pending_requests == 0


def test_equal_costs_are_broken_randomly():
    # Zero weights: every replica always costs the same; choice must not stick to one.
    router = _router(num_prefill=4, queue_weight=0.0, running_weight=0.0, prefix_weight=0.0)
    picks = Counter(router.route(_tokens(5, 2)).prefill_replica for _ in range(200))
    assert len(picks) == 4 and min(picks.values()) >= 25, picks


def test_conditional_disaggregation_threshold():
    router = _router(local_prefill_threshold=16)
    tokens = _tokens(6, 8)  # 32 tokens
    _store(router, DECODE, "d0", hash_blocks(tokens, BS)[:5])  # 20 cached, 12 left
    decision = router.route(tokens)
    assert decision.local_prefill and decision.prefill_replica is None
    assert decision.decode_replica == "d0"
    assert decision.reason == "local-prefill"
    assert decision.num_transfer_tokens == 0
    assert router.load(DECODE, "d0").pending_tokens == 12
    # 16 uncached tokens is not < 16: disaggregate.
    router = _router(local_prefill_threshold=16)
    _store(router, DECODE, "d0", hash_blocks(tokens, BS)[:4])
    decision = router.route(tokens)
    assert decision.prefill_replica is not None and decision.num_transfer_tokens == 16
    # Short prompts prefill locally even with prefix-blind policies.
    assert _router("round-robin", local_prefill_threshold=16).route(_tokens(7, 1) + [1, 2]).local_prefill


# ---- Router: prefix-blind policies ------------------------------------------------------
def test_round_robin_cycles_and_ignores_prefix():
    router = _router("round-robin", num_prefill=3)
    tokens = _tokens(8, 8)
    _store(router, PREFILL, "p2", hash_blocks(tokens, BS))
    picks = [router.route(tokens).prefill_replica for _ in range(6)]
    assert picks == ["p0", "p1", "p2", "p0", "p1", "p2"]
    assert router.decision_counts() == {"round-robin": 6}


def test_least_loaded_picks_lowest_load_and_ignores_prefix():
    router = _router("least-loaded", num_prefill=3)
    tokens = _tokens(9, 8)
    _store(router, PREFILL, "p0", hash_blocks(tokens, BS))
    router.update_load(PREFILL, "p0", LoadReport(100, 0, 0.0))
    router.update_load(PREFILL, "p1", LoadReport(0, 1, 0.0))  # 64 with running_weight 64
    router.update_load(PREFILL, "p2", LoadReport(500, 0, 0.0))
    decision = router.route(tokens)
    assert decision.prefill_replica == "p1" and decision.reason == "least-loaded"
    assert decision.prefill_cached_tokens == 0


def test_random_policy_uses_every_replica():
    router = _router("random", num_prefill=3)
    picks = Counter(router.route(_tokens(1, 2)).prefill_replica for _ in range(90))
    assert set(picks) == {"p0", "p1", "p2"}


# ---- Router: availability ---------------------------------------------------------------
def test_draining_and_excluded_replicas_get_no_requests():
    router = _router(num_prefill=3, num_decode=2)
    router.set_draining(PREFILL, "p0", True)
    router.set_draining(DECODE, "d1", True)
    for _ in range(20):
        decision = router.route(_tokens(1, 4), exclude_prefill=["p1"])
        assert decision.prefill_replica == "p2" and decision.decode_replica == "d0"
    router.set_draining(PREFILL, "p0", False)
    assert "p0" in {router.route(_tokens(1, 4)).prefill_replica for _ in range(20)}


def test_no_replica_error_and_local_prefill_fallback():
    router = _router(num_prefill=1, num_decode=1)
    router.set_draining(DECODE, "d0", True)
    with pytest.raises(NoReplicaError) as info:
        router.route(_tokens(1, 4))
    assert info.value.pool == DECODE
    router.set_draining(DECODE, "d0", False)
    router.remove_replica(PREFILL, "p0")
    decision = router.route(_tokens(1, 4))
    assert decision.local_prefill and decision.reason == "no-prefill-replica"
    strict = Router(RouterConfig(local_prefill_threshold=0), block_size=BS, allow_local_prefill_fallback=False)
    strict.add_replica(DECODE, "d0")
    with pytest.raises(NoReplicaError) as info:
        strict.route(_tokens(1, 4))
    assert info.value.pool == PREFILL


def test_remove_replica_drops_index_entries_and_load():
    router = _router()
    tokens = _tokens(10, 4)
    _store(router, PREFILL, "p1", hash_blocks(tokens, BS))
    router.remove_replica(PREFILL, "p1")
    assert "p1" not in router.index(PREFILL)
    assert router.index(PREFILL).prefix_match(hash_blocks(tokens, BS)) == {}
    assert not router.update_load(PREFILL, "p1", LoadReport(0, 0, 0.0))  # late report: ignored
    assert not router.apply_events(PREFILL, "p1", [[2, "stored", [1]]])
    assert router.replicas_needing_resync(PREFILL) == []
    with pytest.raises(UnknownReplicaError):
        router.set_draining(PREFILL, "p1", True)


def test_router_resync_through_pool_api():
    router = _router()
    assert not router.apply_events(PREFILL, "p0", [[3, "stored", [1]]])
    assert router.replicas_needing_resync(PREFILL) == ["p0"]
    router.resync(PREFILL, "p0", (3, [1]))
    assert router.replicas_needing_resync(PREFILL) == []


def test_route_input_validation():
    router = _router()
    with pytest.raises(ValueError):
        router.route()
    with pytest.raises(ValueError):
        router.route(block_hashes=[1, 2])  # num_prompt_tokens missing
    with pytest.raises(ValueError):
        router.route(block_hashes=[1, 2], num_prompt_tokens=5)  # 2 blocks of 4 > 5 tokens
    with pytest.raises(ValueError):
        router.route([])
    with pytest.raises(ValueError):
        router.update_load(PREFILL, "p0", LoadReport(0, 0, 1.5))
    with pytest.raises(ValueError):
        router.add_replica("middle", "x")
    decision = router.route(block_hashes=hash_blocks(_tokens(1, 2), BS), num_prompt_tokens=9)
    assert isinstance(decision, RouteDecision) and decision.num_prompt_tokens == 9


def test_router_modules_do_not_import_torch():
    code = (
        "import sys, splitserve.cluster.routing.router, splitserve.cluster.routing.index, splitserve.cluster.routing.load; "
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_router_microbench_runs_small(capsys):
    from splitserve.bench.control_plane.router_microbench import main

    assert (
        main(
            [
                "--num-replicas",
                "4",
                "--num-blocks",
                "2000",
                "--num-roots",
                "8",
                "--num-decisions",
                "50",
                "--num-hashing-decisions",
                "5",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| prefill stored |" in out and "| route(block_hashes), both pools | 50 |" in out
    with pytest.raises(SystemExit):
        main(["--num-replicas", "0"])
